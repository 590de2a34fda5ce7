"""The load generator: closed loop at a set concurrency, or open loop with Poisson arrivals.

It speaks the public APIs only, as a user would: the Generation API (tandem.client), or OpenAI's
chat completions (bench.http_client); and records what a user sees of each request.
"""
from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import grpc

from bench.prompt_set import Prompt
from tandem.client import GenerationResult, generate
from tandem.v1 import generation_pb2, generation_pb2_grpc

T = TypeVar("T")


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds; `sent` is from the start of its run."""

    prompt_id: str
    kind: str
    sent: float
    ttft: float
    e2e: float
    prompt_tokens: int
    completion_tokens: int
    draft_tokens: int
    accepted_tokens: int
    draft_steps: int
    finish_reason: str
    itl: list[float] = field(default_factory=list)  # gap before each token after the first; 0 within a burst
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        n = self.completion_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    def to_json(self) -> dict:
        row = asdict(self)
        row["itl"] = [round(x, 5) for x in self.itl]
        row["tpot"] = self.tpot
        return row


@dataclass(frozen=True, slots=True)
class Arrivals:
    """closed: `concurrency` requests in flight at all times; open: Poisson at `rate` requests/s."""

    kind: str  # "closed" or "open"
    concurrency: int = 1
    rate: float = 0.0
    seed: int = 0

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.kind == "closed" else f"rate={self.rate:g}/s"


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    duration: float  # first request sent to last response


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s) of n requests with exponential gaps; the same seed gives every mode the same schedule."""
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def build_request(prompt: Prompt, index: int, temperature: float, max_tokens: int,
                  speculate: bool | None, seed: int, extra: dict | None = None) -> generation_pb2.GenerateRequest:
    """extra: more SamplingParams fields (penalties, logit_bias, ...), the same for every request."""
    params = generation_pb2.SamplingParams(temperature=temperature, max_tokens=max_tokens, **(extra or {}))
    if temperature > 0:
        params.seed = seed + index  # the same seed per prompt in every mode
    if speculate is not None:
        params.speculate = speculate
    messages = [generation_pb2.ChatMessage(role=r, content=c) for r, c in prompt.messages]
    return generation_pb2.GenerateRequest(
        request_id=f"bench-{prompt.id}", chat=generation_pb2.ChatMessages(messages=messages),
        sampling_params=params)


def _record(prompt: Prompt, sent: float, result: GenerationResult) -> RequestRecord:
    times = result.token_times
    return RequestRecord(
        prompt_id=prompt.id, kind=prompt.kind, sent=sent, ttft=result.ttft, e2e=result.elapsed,
        prompt_tokens=result.prompt_tokens, completion_tokens=len(result.token_ids),
        draft_tokens=result.draft_tokens, accepted_tokens=result.accepted_tokens,
        draft_steps=result.draft_steps, finish_reason=result.finish_reason,
        itl=[b - a for a, b in zip(times, times[1:])])


async def run_load(address: str, prompts: list[Prompt], arrivals: Arrivals, *, temperature: float,
                   max_tokens: int, speculate: bool | None, seed: int = 0, timeout: float = 600.0,
                   extra: dict | None = None) -> RunResult:
    """Sends every prompt once over the Generation API, on one channel, and waits for all of them."""
    requests = [build_request(p, i, temperature, max_tokens, speculate, seed, extra) for i, p in enumerate(prompts)]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int, sent: float) -> RequestRecord:
            try:
                return _record(prompts[i], sent, await generate(stub, requests[i], timeout=timeout))
            except grpc.aio.AioRpcError as e:
                return failed_record(prompts[i], sent, f"{e.code().name}: {e.details()}")

        return await drive(len(prompts), arrivals, one)


def failed_record(prompt: Prompt, sent: float, error: str) -> RequestRecord:
    return RequestRecord(prompt.id, prompt.kind, sent, 0.0, 0.0, 0, 0, 0, 0, 0, "error", error=error)


async def in_flight(calls: list[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    """Each call's result, in order, with at most `limit` of them running at once: a call starts as
    soon as another ends, as a client that keeps `limit` requests in flight sends them."""
    slots = asyncio.Semaphore(limit)

    async def bounded(call: Callable[[], Awaitable[T]]) -> T:
        async with slots:
            return await call()

    return list(await asyncio.gather(*(bounded(call) for call in calls)))


async def drive(n: int, arrivals: Arrivals, one: Callable[[int, float], Awaitable[RequestRecord]]) -> RunResult:
    """Runs one(i, sent) for every request i, closed loop or open loop, and waits for all of them."""
    records: list[RequestRecord | None] = [None] * n
    start = time.perf_counter()

    async def run(i: int) -> None:
        records[i] = await one(i, time.perf_counter() - start)

    if arrivals.kind == "closed":
        await in_flight([functools.partial(run, i) for i in range(n)], arrivals.concurrency)
    else:
        tasks = []
        for i, at in enumerate(poisson_arrivals(n, arrivals.rate, arrivals.seed)):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            tasks.append(asyncio.create_task(run(i)))
        await asyncio.gather(*tasks)
    return RunResult([r for r in records if r is not None], time.perf_counter() - start)
