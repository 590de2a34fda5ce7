"""Two targets behind the Shepherd Model Gateway: does cache-aware routing pay with Tandem's prefix cache?

    python -m bench.prefix_routing                  # 8 conversations of 4 turns, 4 at a time

The multi-turn load of bench.prefix_cache (one long shared system prompt, a history that grows
each turn) goes through the gateway's OpenAI API to two targets of the same model (prefix caching
on, one thread each, no drafter), once with `--policy cache_aware` and once with `round_robin`.
Each policy gets fresh targets, so neither finds what the other run cached. Reports, per policy,
the prompt tokens the targets prefilled (their prefix-cache queries less hits), the cached share,
and TTFT p50 of turns 2 and later, and the ratios cache_aware / round_robin.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.load import in_flight
from bench.prefix_cache import chat, follow_up, opening
from bench.prompt_set import load_prompts
from tandem.launch import GatewayProcess, ServiceProcess
from tandem.metrics_scrape import metric, scrape
from tandem.registry import DEFAULT_MODEL

POLICIES = ("cache_aware", "round_robin")


@dataclass(slots=True)
class PolicyRun:
    policy: str
    ttfts: list[float]  # turns 2 and later, seconds
    prompt_tokens: float  # looked up in the targets' prefix caches
    cached_tokens: float

    @property
    def prefilled(self) -> float:
        return self.prompt_tokens - self.cached_tokens


async def converse(session: aiohttp.ClientSession, url: str, model: str, question: str, turns: int,
                   max_tokens: int) -> list[float]:
    """One conversation, turn by turn; the TTFTs of turns 2 and later."""
    history, ttfts = opening(question), []
    for turn in range(turns):
        result = await chat(session, url, history, max_tokens, model)
        if turn:
            ttfts.append(result.ttft)
        follow_up(history, result.text, turn)
    return ttfts


async def load(url: str, model: str, questions: list[str], turns: int, max_tokens: int, concurrency: int) -> list[float]:
    async with aiohttp.ClientSession() as session:
        calls = [functools.partial(converse, session, url, model, q, turns, max_tokens) for q in questions]
        return [t for ttfts in await in_flight(calls, concurrency) for t in ttfts]


def run_policy(policy: str, args: argparse.Namespace, questions: list[str], logs: Path) -> PolicyRun:
    targets = [ServiceProcess("target_service", ["--model", args.model, "--threads", "1"],
                              log_path=logs / f"{policy}-target{i}.log").start() for i in range(2)]
    gateway = GatewayProcess([t.address for t in targets], logs / f"{policy}-smg.log", policy=policy)
    try:
        for target in targets:
            target.wait_healthy(300)
        gateway.start().wait_ready(args.served_name)
        before = [scrape(t.metrics_url) for t in targets]  # the readiness probe's request
        ttfts = asyncio.run(load(gateway.url + "/v1", args.served_name, questions, args.turns, args.max_tokens,
                                 args.concurrency))
        after = [scrape(t.metrics_url) for t in targets]

        def added(name: str) -> float:
            return sum(metric(a, name) - metric(b, name) for a, b in zip(after, before))

        return PolicyRun(policy, ttfts, added("tandem_prefix_cache_queries_total"),
                         added("tandem_prefix_cache_hits_total"))
    finally:
        gateway.kill()
        for target in targets:
            target.terminate(10)


def report(runs: dict[str, PolicyRun]) -> None:
    print("| policy | turns 2+ | prompt tokens | prefilled | cached share | TTFT p50 ms |")
    print("|---|---|---|---|---|---|")
    for run in runs.values():
        print(f"| {run.policy} | {len(run.ttfts)} | {run.prompt_tokens:.0f} | {run.prefilled:.0f} | "
              f"{run.cached_tokens / max(run.prompt_tokens, 1):.3f} | {statistics.median(run.ttfts) * 1000:.1f} |")
    aware, robin = runs["cache_aware"], runs["round_robin"]
    print(f"prefilled tokens ratio, cache_aware / round_robin: {aware.prefilled / max(robin.prefilled, 1):.3f}")
    print(f"TTFT p50 ratio, cache_aware / round_robin: "
          f"{statistics.median(aware.ttfts) / statistics.median(robin.ttfts):.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4, help="conversations in flight at once")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--served-name", default=DEFAULT_MODEL, help="the model name the targets serve")
    args = parser.parse_args(argv)
    if args.turns < 2:
        parser.error("--turns must be at least 2: TTFT is measured on the turns after the first")
    logs = Path(tempfile.mkdtemp(prefix="tandem-prefix-routing-"))
    questions = [p.messages[-1][1] for p in load_prompts(args.conversations)]
    print(f"{args.model}, two targets behind smg, 1 thread each, no drafter, {args.conversations} conversations "
          f"of {args.turns} turns, {args.concurrency} at a time, {args.max_tokens} tokens per answer, T=0 "
          f"(logs: {logs})")
    report({policy: run_policy(policy, args, questions, logs) for policy in POLICIES})


if __name__ == "__main__":
    main()
