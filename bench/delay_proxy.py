"""A TCP proxy that delays every byte by a set one-way delay each way: a network we can set.

    python -m bench.delay_proxy --listen 127.0.0.1:50060 --upstream 127.0.0.1:50052 --delay-ms 5
                                [--jitter-ms 1] [--seed 0]

Each chunk read from one side is written to the other `delay` seconds later (plus, with jitter, a
uniform draw in [0, jitter]), never before the chunk read ahead of it: byte order is kept, as TCP
keeps it, so a jittered chunk also holds up the ones behind it. A round trip through the proxy
takes twice the one-way delay. Bandwidth is not limited.

The kernel here has no netem (tc qdisc), so tests and benchmarks put this between the target and
the drafter. It costs one event-loop callback per chunk each way.

A partition: SIGUSR1 stops forwarding, holding what arrives without closing either connection (a
switch that drops packets while TCP keeps retrying); SIGUSR2 resumes, delivering what was held.
In-process, `DelayProxy.partition()` and `heal()` do the same.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tandem.launch import free_port

CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class Delay:
    one_way: float  # seconds, each direction
    jitter: float = 0.0  # seconds: each chunk's delay is one_way plus a uniform draw in [0, jitter]

    def __post_init__(self) -> None:
        if self.one_way < 0 or self.jitter < 0:
            raise ValueError(f"delays must be >= 0, got one_way={self.one_way}, jitter={self.jitter}")


class _Pipe:
    """One direction of one connection: chunks wait in order until their delivery time."""

    def __init__(self, proxy: DelayProxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.proxy, self.reader, self.writer = proxy, reader, writer
        self.queue: deque[tuple[float, bytes]] = deque()
        self.ready = asyncio.Event()
        self.last_due = 0.0

    async def read(self) -> None:
        """Timestamp each chunk as it arrives; an empty chunk marks the end."""
        loop = asyncio.get_running_loop()
        try:
            while chunk := await self.reader.read(CHUNK):
                self._put(loop.time(), chunk)
        except (ConnectionError, OSError):
            pass
        self._put(loop.time(), b"")

    def _put(self, now: float, chunk: bytes) -> None:
        due = max(now + self.proxy.draw_delay(), self.last_due)
        self.last_due = due
        self.queue.append((due, chunk))
        self.ready.set()

    async def write(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                while not self.queue:
                    self.ready.clear()
                    await self.ready.wait()
                due, chunk = self.queue[0]
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                await self.proxy.flowing.wait()
                self.queue.popleft()
                if not chunk:  # the sender closed its side: pass the half-close on
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
                    break
                self.writer.write(chunk)
                await self.writer.drain()
        except (ConnectionError, OSError):
            pass

    async def run(self) -> None:
        await asyncio.gather(self.read(), self.write())


class DelayProxy:
    """Listens on `listen_port` (0: any free one) and forwards each connection to upstream."""

    def __init__(self, upstream_host: str, upstream_port: int, delay: Delay, *, listen_host: str = "127.0.0.1",
                 listen_port: int = 0, seed: int = 0):
        self.upstream = (upstream_host, upstream_port)
        self.delay = delay
        self.listen = (listen_host, listen_port)
        self.flowing = asyncio.Event()
        self.flowing.set()
        self._random = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self.connections = 0  # accepted so far

    def draw_delay(self) -> float:
        return self.delay.one_way + (self._random.uniform(0, self.delay.jitter) if self.delay.jitter else 0.0)

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"{self.listen[0]}:{self.port}"

    async def start(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._serve, *self.listen)
        return self

    def partition(self) -> None:
        """Stop forwarding, closing nothing: what arrives is held."""
        self.flowing.clear()

    def heal(self) -> None:
        self.flowing.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        task = asyncio.create_task(self._forward(client_reader, client_writer, up_reader, up_writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forward(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter,
                       up_reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter) -> None:
        """Both directions, until both sides have closed theirs; then the connection closes."""
        try:
            await asyncio.gather(_Pipe(self, client_reader, up_writer).run(), _Pipe(self, up_reader, client_writer).run())
        finally:
            for writer in (client_writer, up_writer):
                with contextlib.suppress(Exception):
                    writer.close()


@dataclass
class ProxyProcess:
    """The proxy as a process of its own (so that its CPU is counted apart): `address` forwards to upstream."""

    upstream: str
    delay_ms: float
    jitter_ms: float = 0.0
    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ProxyProcess:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.delay_proxy", "--listen", self.address, "--upstream", self.upstream,
             "--delay-ms", str(self.delay_ms), "--jitter-ms", str(self.jitter_ms)],
            stdout=out, stderr=subprocess.STDOUT)
        return self

    def partition(self) -> None:
        self.process.send_signal(signal.SIGUSR1)

    def heal(self) -> None:
        self.process.send_signal(signal.SIGUSR2)

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


async def _serve_forever(args: argparse.Namespace) -> None:
    upstream_host, upstream_port = _host_port(args.upstream)
    listen_host, listen_port = _host_port(args.listen)
    proxy = await DelayProxy(upstream_host, upstream_port, Delay(args.delay_ms / 1000, args.jitter_ms / 1000),
                             listen_host=listen_host, listen_port=listen_port, seed=args.seed).start()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, proxy.partition)
    loop.add_signal_handler(signal.SIGUSR2, proxy.heal)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"delay proxy {proxy.address} -> {args.upstream}, {args.delay_ms} ms each way", flush=True)
    await stop.wait()
    await proxy.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", required=True, help="host:port to accept on")
    parser.add_argument("--upstream", required=True, help="host:port to forward to")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay, each direction")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="extra delay drawn uniformly in [0, this]")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        import uvloop
        uvloop.run(_serve_forever(args))
    except ImportError:
        asyncio.run(_serve_forever(args))


if __name__ == "__main__":
    main()
