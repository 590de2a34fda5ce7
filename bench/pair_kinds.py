"""Tokens/s of the async pair against the target alone, per drafter and prompt kind, in one run each.

    python -m bench.pair_kinds [--drafters suffix suffix+model model] [--kinds rewrite code chat]
                               [--num-prompts 8] [--max-tokens 128] [--dtype bfloat16]
                               [--eagle-head HEAD]   (adds the drafter eagle3: that EAGLE-3 head)

For each (kind, drafter) it starts a draft service and a target (one thread each, the target
keeping pre-drafts, as deployed), warms both up on two prompts of that kind that it does not
measure, then sends the kind's first --num-prompts prompts one at a time, greedy: first without
speculation (the target alone), then with it. Prints tokens/s of each, their ratio, and from the
target's metrics the mean acceptance length, the share of verify steps that had to wait for a
fresh proposal (misses) and whether the outputs were identical.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.prompt_set import KINDS
from bench.serve import DRAFTERS, EAGLE3, eagle3_drafter_flags
from bench.versus_vllm import generate_all, prompt_ids
from tandem.launch import ServiceProcess
from tandem.metrics_scrape import metric, scrape
from tandem.registry import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL

@dataclass(frozen=True, slots=True)
class PairRow:
    kind: str
    drafter: str
    alone_tok_s: float
    pair_tok_s: float
    mal: float
    miss_share: float
    identical: int
    prompts: int

    def format(self) -> str:
        return (f"| {self.kind} | {self.drafter} | {self.alone_tok_s:.1f} | {self.pair_tok_s:.1f} | "
                f"{self.pair_tok_s / self.alone_tok_s:.2f} | {self.mal:.2f} | {self.miss_share:.0%} | "
                f"{self.identical}/{self.prompts} |")


def drafter_flags(drafter: str, args: argparse.Namespace) -> list[str]:
    """The draft service's flags for one drafter kind."""
    if drafter == EAGLE3:
        return eagle3_drafter_flags(args.eagle_head, args.model)
    draft_model = args.draft_model if "model" in drafter else args.model  # lookup drafters: its tokenizer
    return ["--model", draft_model, "--drafter", drafter]


def measure(kind: str, drafter: str, args: argparse.Namespace, logs: Path) -> PairRow:
    prompts = prompt_ids(args.num_prompts + 2, kind, args.model)
    measured, warm = prompts[: args.num_prompts], prompts[args.num_prompts :]
    draft = ServiceProcess("draft_service", [*drafter_flags(drafter, args), "--threads", "1"],
                           log_path=logs / f"draft-{kind}-{drafter}.log").start()
    target = ServiceProcess("target_service", ["--model", args.model, "--dtype", args.dtype, "--threads", "1",
                                               "--drafter", draft.address],
                            log_path=logs / f"target-{kind}-{drafter}.log").start()
    try:
        draft.wait_healthy(300)
        target.wait_healthy(300)
        target.wait_metric("tandem_drafter_connected", 1.0)
        asyncio.run(generate_all(target.address, warm, 32, True, False))
        alone_s, alone = asyncio.run(generate_all(target.address, measured, args.max_tokens, False, False))
        before = scrape(target.metrics_url)
        pair_s, paired = asyncio.run(generate_all(target.address, measured, args.max_tokens, True, False))
        after = scrape(target.metrics_url)
    finally:
        target.terminate(10)
        draft.terminate(10)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    steps, misses = delta("tandem_spec_decode_num_drafts_total"), delta("tandem_draft_miss_total")
    return PairRow(kind, drafter, sum(map(len, alone)) / alone_s, sum(map(len, paired)) / pair_s,
                   1 + delta("tandem_spec_decode_num_accepted_tokens_total") / max(1.0, steps),
                   misses / max(1.0, steps + misses), sum(a == p for a, p in zip(alone, paired)), len(measured))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", nargs="+", choices=(*DRAFTERS, EAGLE3),
                        default=["suffix", "suffix+model", "model"])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=["rewrite", "code", "chat"])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--eagle-head", help="an EAGLE-3 head folder for --drafters eagle3 (distill --kind eagle3)")
    args = parser.parse_args(argv)
    if EAGLE3 in args.drafters and not args.eagle_head:
        parser.error("--drafters eagle3 needs --eagle-head")
    logs = Path(tempfile.mkdtemp(prefix="tandem-pair-kinds-"))
    print(f"{args.model} {args.dtype}, 1 + 1 threads, {args.num_prompts} prompts per kind, greedy, "
          f"{args.max_tokens} max tokens, one at a time (logs: {logs})")
    print("| prompts | drafter | alone tok/s | pair tok/s | pair / alone | MAL | misses | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in args.kinds:
        for drafter in args.drafters:
            print(measure(kind, drafter, args, logs).format(), flush=True)


if __name__ == "__main__":
    main()
