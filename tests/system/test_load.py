"""A burst of 2,000 concurrent streams over several channels against a pair with its drafter
connected: every stream gets its tokens or a clean RESOURCE_EXHAUSTED (none CANCELLED), the
target answers health checks throughout, and its memory stays bounded."""
from __future__ import annotations

import asyncio
import collections

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.service_fixtures import PROMPTS, greedy_request
from tandem.client import generate, open_channel
from tandem.launch import ServiceProcess
from tandem.v1 import generation_pb2_grpc

CHANNELS = 8


def _rss_mb(process: ServiceProcess) -> int:
    status = open(f"/proc/{process.process.pid}/status").read()
    return int(status.split("VmRSS:")[1].split()[0]) // 1024


async def _burst(address: str, streams: int, max_tokens: int) -> tuple[collections.Counter, list[str]]:
    """Outcome counts of `streams` concurrent Generate calls, and the health statuses seen meanwhile."""
    channels = [open_channel(address) for _ in range(CHANNELS)]
    stubs = [generation_pb2_grpc.GenerationStub(c) for c in channels]
    outcomes: collections.Counter = collections.Counter()
    health: list[str] = []
    done = asyncio.Event()

    async def one(i: int) -> None:
        try:
            request = greedy_request(PROMPTS[i % len(PROMPTS)], max_tokens, ignore_eos=True)
            result = await generate(stubs[i % CHANNELS], request, timeout=600)
            outcomes["ok" if len(result.token_ids) == max_tokens else "short"] += 1
        except grpc.aio.AioRpcError as err:
            outcomes[err.code().name] += 1

    async def watch_health() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not done.is_set():
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    health.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                except grpc.aio.AioRpcError as err:
                    health.append(err.code().name)
                await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch_health())
    await asyncio.gather(*(one(i) for i in range(streams)))
    done.set()
    await watcher
    for channel in channels:
        await channel.close()
    return outcomes, health


def _pair(tmp_path, target_args: list[str]) -> tuple[ServiceProcess, ServiceProcess]:
    draft = ServiceProcess("draft_service", ["--drafter", "ngram", "--threads", "1"],
                           log_path=tmp_path / "draft.log").start()
    # Both cores for the target: the n-gram drafter's lookups take microseconds.
    target = ServiceProcess("target_service", ["--threads", "2", "--max-model-len", "512", "--drafter",
                                               draft.address, *target_args], log_path=tmp_path / "target.log").start()
    draft.wait_healthy()
    target.wait_healthy()
    target.wait_metric("tandem_drafter_connected", 1.0)
    return draft, target


def test_a_burst_of_2000_streams_gets_tokens_or_resource_exhausted(tmp_path):
    draft, target = _pair(tmp_path, [])
    try:
        before = _rss_mb(target)
        outcomes, health = asyncio.run(_burst(target.address, 2000, 4))
        assert set(outcomes) <= {"ok", "RESOURCE_EXHAUSTED"}, outcomes
        assert sum(outcomes.values()) == 2000 and outcomes["ok"] >= 64
        assert health and set(health) == {"SERVING"}, collections.Counter(health)
        assert _rss_mb(target) < before + 1024, "a burst must not leave the target's memory grown by a GiB"
    finally:
        target.kill()
        draft.kill()


@pytest.mark.slow
def test_2000_streams_that_all_fit_in_the_queue_all_get_their_tokens(tmp_path):
    draft, target = _pair(tmp_path, ["--max-queue", "4000", "--max-num-seqs", "64"])
    try:
        outcomes, health = asyncio.run(_burst(target.address, 2000, 16))
        assert outcomes == {"ok": 2000}
        assert set(health) == {"SERVING"}, collections.Counter(health)
    finally:
        target.kill()
        draft.kill()
