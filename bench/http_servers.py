"""Which HTTP server library the OpenAI front door uses: aiohttp against Starlette on uvicorn.

Each runs in a child process on uvloop beside an idle grpc.aio server (as in the target), and
streams server-sent events the way a completion does: one small JSON chunk per token, a token
every `--token-ms`, from a queue that another task fills (the engine's role). A client process
drives `--concurrency` streams at once. Reported per library: the server's CPU time per event
(what it takes from the model on a small box), events per second and time to the first byte.

    python -m bench.http_servers --concurrency 16 --requests 64 --events 128
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time

from tandem.launch import free_port

CHUNK = {"id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 0, "model": "m",
         "choices": [{"index": 0, "delta": {"content": " token"}, "finish_reason": None}]}


async def _tokens(events: int, token_ms: float):
    """What the engine's outbox gives a request: one token every token_ms, from another task."""
    queue: asyncio.Queue = asyncio.Queue()

    async def engine() -> None:
        for _ in range(events):
            await asyncio.sleep(token_ms / 1000)
            queue.put_nowait(CHUNK)
        queue.put_nowait(None)

    task = asyncio.create_task(engine())
    try:
        while (chunk := await queue.get()) is not None:
            yield json.dumps(chunk)
    finally:
        task.cancel()


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _serve_aiohttp(port: int, events: int, token_ms: float) -> None:
    from aiohttp import web
    from aiohttp_sse import sse_response

    async def stream(request: web.Request) -> web.StreamResponse:
        async with sse_response(request, allow_all_methods=True) as sse:
            async for data in _tokens(events, token_ms):
                await sse.send(data)
            await sse.send("[DONE]")
        return sse

    async def cpu(request: web.Request) -> web.Response:
        return web.json_response({"cpu": _cpu_seconds()})

    app = web.Application()
    app.router.add_post("/stream", stream)
    app.router.add_get("/cpu", cpu)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


async def _serve_starlette(port: int, events: int, token_ms: float) -> None:
    import uvicorn
    from sse_starlette import EventSourceResponse
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def stream(request):
        async def body():
            async for data in _tokens(events, token_ms):
                yield {"data": data}
            yield {"data": "[DONE]"}
        return EventSourceResponse(body(), ping=3600)

    async def cpu(request):
        return JSONResponse({"cpu": _cpu_seconds()})

    app = Starlette(routes=[Route("/stream", stream, methods=["POST"]), Route("/cpu", cpu)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, loop="none", http="httptools"))
    await server.serve()


def serve(library: str, port: int, events: int, token_ms: float) -> None:
    import grpc
    import uvloop

    async def main() -> None:
        grpc_server = grpc.aio.server()
        grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        serve_http = _serve_aiohttp if library == "aiohttp" else _serve_starlette
        await serve_http(port, events, token_ms)

    uvloop.run(main())


async def drive(port: int, concurrency: int, requests: int) -> dict:
    import aiohttp

    base = f"http://127.0.0.1:{port}"
    ttfb: list[float] = []
    events = 0
    async with aiohttp.ClientSession() as session:
        for _ in range(100):  # wait for the server
            try:
                async with session.get(f"{base}/cpu") as response:
                    cpu_before = (await response.json())["cpu"]
                break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.1)
        limit = asyncio.Semaphore(concurrency)

        async def one() -> None:
            nonlocal events
            async with limit:
                sent = time.perf_counter()
                async with session.post(f"{base}/stream", json={}) as response:
                    first = True
                    async for line in response.content:
                        if line.startswith(b"data:"):
                            if first:
                                ttfb.append(time.perf_counter() - sent)
                                first = False
                            events += 1

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        wall = time.perf_counter() - started
        async with session.get(f"{base}/cpu") as response:
            cpu = (await response.json())["cpu"] - cpu_before
    return {"events_per_s": events / wall, "server_cpu_us_per_event": cpu / events * 1e6,
            "ttfb_p50_ms": statistics.median(ttfb) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--libraries", nargs="+", default=["aiohttp", "starlette"])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--events", type=int, default=128)
    parser.add_argument("--token-ms", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.events, args.token_ms)
        return
    results: dict[str, list[dict]] = {library: [] for library in args.libraries}
    for _ in range(args.rounds):  # interleaved, so that a noisy box hits both alike
        for library in args.libraries:
            port = free_port()
            child = subprocess.Popen([sys.executable, "-m", "bench.http_servers", "--serve", library,
                                      "--port", str(port), "--events", str(args.events),
                                      "--token-ms", str(args.token_ms)])
            try:
                results[library].append(asyncio.run(drive(port, args.concurrency, args.requests)))
            finally:
                child.kill()
                child.wait()
    for library, runs in results.items():
        summary = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(library, " ".join(f"{key}={value:.1f}" for key, value in summary.items()))


if __name__ == "__main__":
    main()
