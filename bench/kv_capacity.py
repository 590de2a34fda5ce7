"""Concurrent sequences at the same KV memory: one slot of --max-model-len per sequence against paged blocks.

    python -m bench.kv_capacity                     # 32 requests at once, 512-token prompts, 32 tokens each

Two targets hold the same KV memory, 8 x 2048 = 16,384 tokens. "slots" is the cache as it was
before paging: --max-num-seqs 8, so 8 sequences of up to --max-model-len each. "paged" runs
--max-num-seqs 32 --kv-cache-tokens 16384: a sequence holds the blocks of the positions it has
reached (preempted when the pool runs dry), so prompts of a quarter of --max-model-len fit about
4x as many. Every request is
sent at once through the OpenAI completions API, greedy, prefix caching off (every prompt is
distinct anyway). The targets run one after the other, twice each, alternating. Reports, per
target, the most requests running at once (vllm:num_requests_running, polled), the preemptions,
TTFT p50, and the output tokens per second of the whole load, with the medians' ratios paged /
slots.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tandem.launch import ServiceProcess, free_port
from tandem.metrics_scrape import metric, scrape
from tandem.registry import DEFAULT_MODEL

KV_TOKENS = 8 * 2048
VARIANTS = {"slots": ["--max-num-seqs", "8"],
            "paged": ["--max-num-seqs", "32", "--kv-cache-tokens", str(KV_TOKENS)]}
FILLER = ("Paged attention keeps the key and value vectors of each sequence in fixed-size blocks, "
          "so a short request does not hold memory for the longest one it might have been. ")


@dataclass(slots=True)
class CapacityRound:
    peak_running: int
    ttfts: list[float]
    output_tokens: int
    seconds: float
    preemptions: int


@dataclass(slots=True)
class CapacityVariant:
    name: str
    rounds: list[CapacityRound] = field(default_factory=list)


def prompts(count: int, words: int) -> list[str]:
    """Distinct prompts of about `words` words (500 words are 588 tokens here)."""
    filler = (FILLER * (words // len(FILLER.split()) + 1)).split()[:words]
    return [f"Request {i}. " + " ".join(filler) for i in range(count)]


async def complete(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(TTFT, output tokens) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start, ttft, usage = time.perf_counter(), None, {}
    async with session.post(url + "/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(choice.get("text") for choice in chunk["choices"]):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    return (ttft if ttft is not None else time.perf_counter() - start), usage.get("completion_tokens", 0)


async def poll_running(metrics_url: str, stop: asyncio.Event) -> int:
    peak = 0
    while not stop.is_set():
        samples = await asyncio.to_thread(scrape, metrics_url)
        peak = max(peak, int(metric(samples, "vllm:num_requests_running")))
        await asyncio.sleep(0.05)
    return peak


async def load(url: str, metrics_url: str, texts: list[str], max_tokens: int) -> CapacityRound:
    stop = asyncio.Event()
    poller = asyncio.create_task(poll_running(metrics_url, stop))
    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        results = await asyncio.gather(*(complete(session, url, text, max_tokens) for text in texts))
    seconds = time.perf_counter() - start
    stop.set()
    preemptions = int(metric(await asyncio.to_thread(scrape, metrics_url), "tandem_num_preemptions_total"))
    return CapacityRound(await poller, [ttft for ttft, _ in results], sum(tokens for _, tokens in results), seconds,
                 preemptions)


def run_variant(variant: CapacityVariant, args: argparse.Namespace, logs: Path, texts: list[str]) -> None:
    process = ServiceProcess("target_service", [
        "--model", args.model, "--threads", str(args.threads), "--no-prefix-caching",
        "--max-model-len", "2048", *VARIANTS[variant.name]],
        log_path=logs / f"{variant.name}.log", http_port=free_port()).start()
    try:
        process.wait_healthy(300)
        variant.rounds.append(asyncio.run(load(process.http_url, process.metrics_url, texts, args.max_tokens)))
    finally:
        process.terminate(10)


def report(variants: list[CapacityVariant]) -> None:
    print("| target | peak running | preemptions (per round) | TTFT p50 s | output tok/s |")
    print("|---|---|---|---|---|")
    medians = {}
    for v in variants:
        peak = max(r.peak_running for r in v.rounds)
        ttft = statistics.median(statistics.median(r.ttfts) for r in v.rounds)
        speed = statistics.median(r.output_tokens / r.seconds for r in v.rounds)
        medians[v.name] = (peak, ttft, speed)
        preempted = ", ".join(str(r.preemptions) for r in v.rounds)
        print(f"| {v.name} | {peak} | {preempted} | {ttft:.2f} | {speed:.1f} |")
    (p_peak, p_ttft, p_speed), (s_peak, s_ttft, s_speed) = medians["paged"], medians["slots"]
    print(f"paged / slots: peak running {p_peak / s_peak:.2f}x, TTFT p50 {p_ttft / s_ttft:.2f}x, "
          f"output tok/s {p_speed / s_speed:.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=500, help="about a quarter of --max-model-len 2048")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="tandem-kv-capacity-"))
    texts = prompts(args.requests, args.prompt_words)
    variants = [CapacityVariant(name) for name in VARIANTS]
    print(f"{args.model}, {args.threads} threads, KV {KV_TOKENS} tokens in each, {args.requests} requests at once "
          f"of ~{args.prompt_words}-word prompts and {args.max_tokens} tokens, {args.rounds} rounds (logs: {logs})")
    for _ in range(args.rounds):
        for variant in variants:
            run_variant(variant, args, logs, texts)
    report(variants)


if __name__ == "__main__":
    main()
