"""Multi-turn chat with and without prefix caching: time to first token on the turns after the first.

    python -m bench.prefix_cache                    # 8 conversations of 4 turns, one shared system prompt
    python -m bench.prefix_cache --pair             # each target with its model drafter

Two targets of the same model, one with prefix caching (the default) and one with
--no-prefix-caching, each on one thread, no drafter (the target's prefill is what the cache
saves). With --pair each target has its own model drafter, caching like its target: the
drafter's prefix cache makes its prefill of the next turn cheap, so drafts come sooner; the
report adds the decode speed of those turns and the drafter's prefill time. Each conversation runs on both, turn by turn, alternating which goes first, so that a
drifting machine hits both alike; an idle target uses no CPU. Every conversation opens with the
same long system prompt; each turn appends the answer and a follow-up question, so the history
grows. Through the OpenAI API, streamed, greedy. Reports TTFT p50 of turns 2 and later for each
target, their ratio, the prompt length and the cached tokens the server reported.
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

from bench.prompt_set import load_prompts
from tandem.launch import ServiceProcess, free_port
from tandem.metrics_scrape import metric, scrape
from tandem.registry import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL

SYSTEM = " ".join(["You are a careful assistant for a team that runs language models in production.",
                   "Answer in plain words, give the reason for each claim, say what you do not know,",
                   "and prefer short lists over long paragraphs when a list is clearer."] * 20)
FOLLOW_UPS = ("Why is that?", "Give one example.", "What would change your answer?", "Say it in one sentence.")


@dataclass(slots=True)
class Turn:
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    text: str
    completion_tokens: int = 0
    decode_seconds: float = 0.0  # first token to last


@dataclass(slots=True)
class Target:
    name: str
    url: str
    drafter_metrics_url: str = ""
    turns: list[Turn] = field(default_factory=list)  # turns 2 and later
    drafter_prefill: tuple[float, float] = (0.0, 0.0)  # the drafter's prefill rounds: (seconds, count)


def opening(question: str) -> list[dict]:
    """A conversation's first messages: the shared system prompt and its question."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def follow_up(history: list[dict], answer: str, turn: int) -> None:
    """The history grows by the answer to `turn` and the next question."""
    history += [{"role": "assistant", "content": answer},
                {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]


async def chat(session: aiohttp.ClientSession, url: str, messages: list[dict], max_tokens: int,
               model: str | None = None) -> Turn:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **({"model": model} if model else {})}
    start, ttft, last, text, usage = time.perf_counter(), None, 0.0, "", {}
    async with session.post(url + "/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    last = time.perf_counter() - start
                    ttft = ttft if ttft is not None else last
                    text += choice["delta"]["content"]
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    ttft = ttft if ttft is not None else time.perf_counter() - start
    return Turn(ttft, usage.get("prompt_tokens", 0), details.get("cached_tokens", 0), text,
                usage.get("completion_tokens", 0), max(0.0, last - ttft))


async def run(targets: list[Target], conversations: int, turns: int, max_tokens: int) -> None:
    questions = [p.messages[-1][1] for p in load_prompts(conversations)]
    async with aiohttp.ClientSession() as session:
        for index, question in enumerate(questions):
            histories = {t.name: opening(question) for t in targets}
            for turn in range(turns):
                order = targets if (index + turn) % 2 == 0 else targets[::-1]
                for target in order:
                    history = histories[target.name]
                    result = await chat(session, target.url, history, max_tokens)
                    if turn:
                        target.turns.append(result)
                    follow_up(history, result.text, turn)


def read_drafter_prefill(target: Target) -> None:
    samples = scrape(target.drafter_metrics_url)
    target.drafter_prefill = (metric(samples, "tandem_draft_prefill_duration_seconds_sum"),
                              metric(samples, "tandem_draft_prefill_duration_seconds_count"))


def report(targets: list[Target], pair: bool) -> None:
    columns = ["target", "turns", "prompt tokens (min, mean)", "cached tokens (mean)", "TTFT p50 ms"]
    if pair:
        columns += ["decode tok/s (turns 2+)", "drafter prefill ms (mean)"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    p50, decode = {}, {}
    for t in targets:
        p50[t.name] = statistics.median(x.ttft for x in t.turns) * 1000
        cells = [t.name, str(len(t.turns)), f"{min(x.prompt_tokens for x in t.turns)}, {statistics.mean(x.prompt_tokens for x in t.turns):.0f}",
                 f"{statistics.mean(x.cached_tokens for x in t.turns):.0f}", f"{p50[t.name]:.1f}"]
        if pair:
            decode[t.name] = (sum(x.completion_tokens - 1 for x in t.turns)
                              / max(sum(x.decode_seconds for x in t.turns), 1e-9))
            seconds, count = t.drafter_prefill
            cells += [f"{decode[t.name]:.1f}", f"{seconds / max(count, 1) * 1000:.1f}"]
        print("| " + " | ".join(cells) + " |")
    print(f"TTFT p50 ratio, cache on / off: {p50['cache on'] / p50['cache off']:.3f}")
    if pair:
        print(f"decode tok/s ratio, cache on / off: {decode['cache on'] / decode['cache off']:.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--pair", action="store_true", help="each target with a model drafter (--draft-model)")
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="tandem-prefix-cache-"))
    variants = (("cache on", []), ("cache off", ["--no-prefix-caching"]))
    drafters = {name: ServiceProcess("draft_service", ["--drafter", "model", "--model", args.draft_model,
                                                       "--threads", "1", *flags],
                                     log_path=logs / f"{name} drafter.log").start()
                for name, flags in variants if args.pair}
    processes = {name: ServiceProcess("target_service", [
        "--model", args.model, "--threads", "1", *flags,
        *(["--drafter", drafters[name].address] if args.pair else [])],
        log_path=logs / f"{name}.log", http_port=free_port()).start() for name, flags in variants}
    try:
        targets = [Target(name, p.wait_healthy(300).http_url,
                          drafters[name].wait_healthy(300).metrics_url if args.pair else "")
                   for name, p in processes.items()]
        drafter = f"the {args.draft_model} drafter" if args.pair else "no drafter"
        print(f"{args.model}, {drafter}, 1 thread each, {args.conversations} conversations of {args.turns} turns, "
              f"{args.max_tokens} tokens per answer, T=0 (logs: {logs})")
        asyncio.run(run(targets, args.conversations, args.turns, args.max_tokens))
        if args.pair:
            for target in targets:
                read_drafter_prefill(target)
        report(targets, args.pair)
    finally:
        for process in [*processes.values(), *drafters.values()]:
            process.terminate(10)


if __name__ == "__main__":
    main()
