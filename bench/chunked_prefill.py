"""What a long prompt costs the streams already running: prompts whole in one step, or in chunks.

    python -m bench.chunked_prefill                  # budgets 1000000 (whole prompts), 2048, 512, 256
    python -m bench.chunked_prefill --drafter model  # each target with its own model drafter
    python -m bench.chunked_prefill --prompt-logprobs 1  # the long prompts ask their prompt's logprobs
    python -m bench.chunked_prefill --drafter model --budgets 512 512 --draft-budgets 1000000 512
                                                     # the drafter's own budget: whole prompts, or chunks

One target per --max-num-batched-tokens value, started together and measured in turn, round by
round, so that a drifting machine hits each alike. A round: 4 streams (short prompts, 128 tokens
each) start, and while they run, 3 long prompts of about 1,500 tokens (8 tokens each) arrive 1 s
apart. Greedy, prefix caching off (every long prompt is distinct anyway); no drafter, or with
--drafter one draft service per target (one thread each). Reports the streams' inter-token
latency (p50, p99, max: the stall a long prompt causes; a message's tokens count as one gap),
their output tokens/s and mean acceptance length, and the long prompts' TTFT p50.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.stats import percentile
from tandem.client import GenerationResult, generate
from tandem.launch import ServiceProcess
from tandem.registry import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL
from tandem.v1 import generation_pb2, generation_pb2_grpc

FILLER = ("A long prompt is prefilled in chunks, each in a step beside the running sequences, so that "
          "their streams keep going while it is read. ")
STREAM_PROMPT = "Tell a long story about a lighthouse keeper and a storm."


@dataclass(slots=True)
class BudgetVariant:
    budget: int
    draft_budget: int | None  # the draft service's --max-num-batched-tokens; None: no drafter
    itl: list[float] = field(default_factory=list)  # the streams' gaps between tokens
    stream_tokens: int = 0
    stream_seconds: float = 0.0
    long_ttft: list[float] = field(default_factory=list)
    accepted: int = 0  # the streams' accepted drafts, and their steps that verified drafts
    draft_steps: int = 0

    @property
    def mal(self) -> float | None:
        return 1 + self.accepted / self.draft_steps if self.draft_steps else None


def request(prompt: str, max_tokens: int, prompt_logprobs: int | None = None) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content=prompt)]),
        sampling_params=generation_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                      prompt_logprobs=prompt_logprobs))


def long_prompt(index: int, words: int) -> str:
    filler = (FILLER * (words // len(FILLER.split()) + 1)).split()[:words]
    return f"Document {index}. " + " ".join(filler) + " Summarize it in one line."


async def one_round(address: str, variant: BudgetVariant, round_index: int, args: argparse.Namespace) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def long_one(i: int) -> GenerationResult:
            await asyncio.sleep(args.stagger * (i + 1))
            prompt = long_prompt(round_index * 100 + i, args.long_words)
            return await generate(stub, request(prompt, 8, args.prompt_logprobs))

        streams = [generate(stub, request(STREAM_PROMPT, args.stream_tokens)) for _ in range(args.streams)]
        results = await asyncio.gather(*streams, *(long_one(i) for i in range(args.long_prompts)))
    for result in results[: args.streams]:
        times = sorted(set(result.token_times))  # the tokens of one message arrive together
        variant.itl += [b - a for a, b in zip(times, times[1:])]
        variant.accepted += result.accepted_tokens
        variant.draft_steps += result.draft_steps
        variant.stream_tokens += len(result.token_ids)
        variant.stream_seconds += result.elapsed
    variant.long_ttft += [r.ttft for r in results[args.streams:]]


def report(variants: list[BudgetVariant]) -> None:
    print("| --max-num-batched-tokens (target / drafter) | stream ITL p50 ms | p99 ms | max ms | stream tok/s (each) "
          "| stream MAL | long TTFT p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for v in variants:
        p50, p99 = percentile(v.itl, 50), percentile(v.itl, 99)
        mal = "-" if v.mal is None else f"{v.mal:.2f}"
        budgets = f"{v.budget} / {'-' if v.draft_budget is None else v.draft_budget}"
        print(f"| {budgets} | {p50 * 1e3:.1f} | {p99 * 1e3:.1f} | {max(v.itl) * 1e3:.1f} | "
              f"{v.stream_tokens / v.stream_seconds:.2f} | {mal} | {percentile(v.long_ttft, 50) * 1e3:.0f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[1_000_000, 2048, 512, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--long-prompts", type=int, default=3)
    parser.add_argument("--long-words", type=int, default=1200, help="about 1.25 tokens a word")
    parser.add_argument("--stagger", type=float, default=1.0, help="seconds between the long prompts")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--drafter", choices=["model", "ngram", "suffix", "suffix+model"],
                        help="a draft service of this kind for each target; default: none")
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--draft-budgets", type=int, nargs="+",
                        help="each drafter's --max-num-batched-tokens, one per --budgets value; default: the same")
    parser.add_argument("--prompt-logprobs", type=int, help="the long prompts ask their prompt's top-N logprobs")
    args = parser.parse_args(argv)
    draft_budgets = args.draft_budgets or args.budgets
    if len(draft_budgets) != len(args.budgets):
        parser.error("give one --draft-budgets value per --budgets value")
    logs = Path(tempfile.mkdtemp(prefix="tandem-chunked-prefill-"))
    drafts = [ServiceProcess("draft_service", ["--drafter", args.drafter, "--threads", "1", "--no-prefix-caching",
                                               "--model", args.draft_model if "model" in args.drafter else args.model,
                                               "--max-num-batched-tokens", str(draft_budget)],
                             log_path=logs / f"draft-{i}.log").start()
              for i, draft_budget in enumerate(draft_budgets)] if args.drafter else []
    targets = [ServiceProcess("target_service", ["--model", args.model, "--threads", "1", "--no-prefix-caching",
                                                 "--max-num-batched-tokens", str(budget),
                                                 *(["--drafter", drafts[i].address] if drafts else [])],
                              log_path=logs / f"target-{i}.log").start() for i, budget in enumerate(args.budgets)]
    variants = [BudgetVariant(budget, draft_budget if args.drafter else None)
                for budget, draft_budget in zip(args.budgets, draft_budgets)]
    try:
        for service in [*drafts, *targets]:
            service.wait_healthy(300)
        for target in targets if drafts else []:
            target.wait_metric("tandem_drafter_connected", 1.0)
        print(f"{args.model}, 1 thread, drafter {args.drafter or 'none'}, {args.streams} streams of {args.stream_tokens} tokens, "
              f"{args.long_prompts} prompts of {args.long_words} words {args.stagger:g} s apart"
              f"{'' if args.prompt_logprobs is None else f' with prompt_logprobs {args.prompt_logprobs}'}, "
              f"{args.rounds} rounds (logs: {logs})")
        for r in range(args.rounds):
            for target, variant in zip(targets, variants):
                asyncio.run(one_round(target.address, variant, r, args))
        report(variants)
    finally:
        for service in [*targets, *drafts]:
            service.terminate(10)


if __name__ == "__main__":
    main()
