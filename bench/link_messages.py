"""What one message pair on the pair's Speculate stream costs in gRPC, apart from everything else.

    python -m bench.link_messages [--pairs 3000] [--rounds 3]
                                  [--experiments= --experiments=-event_engine_client,-event_engine_listener]

A server process answers each TargetUpdate with one DraftProposals, as a drafter does; a client
process sends an update and waits for its answer, as the target's link does (grpc.aio on uvloop,
`write` and `read` on one bidirectional stream). The client runs on one CPU and the server on
another where there is one. Per message pair it reports the client's CPU, on its event loop and
in gRPC's other threads, and the wall round trip. Each --experiments value is GRPC_EXPERIMENTS for
both processes of a configuration (empty: gRPC's default; give it with `=`, as the value may
start with a dash); configurations alternate round by round, so that the box's
drift falls on all alike. What a step of the pair pays for speculating one at a time is about
one such pair (docs/benchmarks-pair-cost.md).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from tandem.launch import cpu_seconds, free_port
from tandem.v1 import drafter_pb2, drafter_pb2_grpc

WARM_PAIRS = 50
UPDATE = drafter_pb2.TargetUpdate(extends=[drafter_pb2.SequenceExtend(seq_id=1, start=100, token_ids=[7])])
ANSWER = drafter_pb2.DraftProposals(proposals=[drafter_pb2.DraftProposal(seq_id=1, base_len=101, token_ids=[8, 9, 10])])


class _Answering(drafter_pb2_grpc.DrafterServicer):
    async def Speculate(self, request_iterator, context):
        async for _ in request_iterator:
            yield ANSWER


async def _serve(port: int) -> None:
    server = grpc.aio.server()
    drafter_pb2_grpc.add_DrafterServicer_to_server(_Answering(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _thread_seconds() -> dict[int, float]:
    """CPU seconds of each of this process's threads, by thread id."""
    return {int(task.name): cpu_seconds("self", int(task.name)) for task in Path("/proc/self/task").iterdir()}


async def _measure(port: int, pairs: int) -> dict[str, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), 60)  # the server process may still be starting
        call = drafter_pb2_grpc.DrafterStub(channel).Speculate(wait_for_ready=True)
        for _ in range(WARM_PAIRS):
            await call.write(UPDATE)
            await call.read()
        loop_thread = threading.get_native_id()
        before, began = _thread_seconds(), time.perf_counter()
        for _ in range(pairs):
            await call.write(UPDATE)
            await call.read()
        wall, after = time.perf_counter() - began, _thread_seconds()
        call.cancel()
    per_pair = 1e6 / pairs  # µs per pair, per second
    spent = {tid: seconds - before.get(tid, 0.0) for tid, seconds in after.items()}
    loop = spent.get(loop_thread, 0) * per_pair
    return {"event_loop_us": loop, "other_threads_us": sum(spent.values()) * per_pair - loop,
            "round_trip_us": wall / pairs * 1e6}


def _pin(cpu_index: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[cpu_index % len(cpus)]})


def run_configuration(experiments: str, pairs: int) -> dict[str, float]:
    """One server and one client process with GRPC_EXPERIMENTS=experiments; the client's figures."""
    env = {**os.environ, "GRPC_EXPERIMENTS": experiments}
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "bench.link_messages", "--serve", str(port)], env=env)
    try:
        client = subprocess.run([sys.executable, "-m", "bench.link_messages", "--client", str(port),
                                 "--pairs", str(pairs)], env=env, capture_output=True, text=True, check=True,
                                timeout=600)
    finally:
        server.terminate()
        server.wait(10)
    return json.loads(client.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, float]]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--experiments", action="append",
                        help="a GRPC_EXPERIMENTS value to compare, once per configuration (default: gRPC's own)")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None or args.client is not None:
        import uvloop

        uvloop.install()
        if args.serve is not None:
            _pin(1)
            asyncio.run(_serve(args.serve))
        else:
            _pin(0)
            print(json.dumps(asyncio.run(_measure(args.client, args.pairs))))
        return {}
    settings = args.experiments or [""]
    results: dict[str, list[dict[str, float]]] = {value: [] for value in settings}
    for round_ in range(args.rounds):
        for value in settings:
            figures = run_configuration(value, args.pairs)
            results[value].append(figures)
            print(f"round {round_ + 1} GRPC_EXPERIMENTS={value or '(default)'}: " + ", ".join(
                f"{name} {figure:.1f}" for name, figure in figures.items()), flush=True)
    for value, runs in results.items():
        medians = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
        cpu = medians["event_loop_us"] + medians["other_threads_us"]
        print(f"GRPC_EXPERIMENTS={value or '(default)'}: client CPU {cpu:.0f} µs a pair "
              f"(event loop {medians['event_loop_us']:.0f}, other threads {medians['other_threads_us']:.0f}), "
              f"round trip {medians['round_trip_us']:.0f} µs (medians of {len(runs)} rounds)")
    return results


if __name__ == "__main__":
    main()
