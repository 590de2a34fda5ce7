"""What the sampling extras cost: the same requests with and without them, in one run.

    python -m bench.sampling_cost                       # penalties, c=1 and 8, speculation on and off
    python -m bench.sampling_cost --extra logprobs      # the top 5 logprobs of every token

One target and one model drafter (the distilled smollm2-135m-draft), each on one thread. For each
concurrency and speculation setting, the plain requests and the ones with the extra fields
alternate chunk by chunk (--rounds), so that a drifting machine hits both alike. Reports tokens/s,
the ratio of the two, and the mean acceptance length (MAL) with speculation on.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench.load import Arrivals, RequestRecord, run_load
from bench.prompt_set import load_prompts
from bench.stats import acceptance
from tandem.launch import ServiceProcess
from tandem.registry import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL

EXTRAS = {
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "rules": {"presence_penalty": 0.5, "logit_bias": {13: -1.0, 28: 1.0}, "bad_words": ["Sure"]},
    "logprobs": {"logprobs": 5},
}


@dataclass(slots=True)
class CostSetting:
    """One (concurrency, speculation) setting: records of the plain requests and of those with extras."""

    records: dict[str, list[RequestRecord]] = field(default_factory=lambda: {"plain": [], "extra": []})
    seconds: dict[str, float] = field(default_factory=lambda: {"plain": 0.0, "extra": 0.0})

    def tok_s(self, variant: str) -> float:
        return sum(r.completion_tokens for r in self.records[variant]) / self.seconds[variant]

    def mal(self, variant: str) -> float | None:
        return acceptance(self.records[variant])["mean_acceptance_length"]


def measure(address: str, args: argparse.Namespace) -> dict[tuple[int, bool], CostSetting]:
    prompts = load_prompts(args.num_prompts + 2)
    warm, prompts = prompts[:2], prompts[2:]
    for extra in (None, EXTRAS[args.extra]):  # first requests pay one-time costs: keep them out
        asyncio.run(run_load(address, warm, Arrivals("closed", 2), temperature=args.temperature, max_tokens=16,
                             speculate=True, extra=extra))
    chunk = -(-len(prompts) // args.rounds)
    cells = {}
    for concurrency in args.concurrency:
        for speculate in (False, True):
            cell = cells[(concurrency, speculate)] = CostSetting()
            for start in range(0, len(prompts), chunk):
                for variant, extra in (("plain", None), ("extra", EXTRAS[args.extra])):
                    result = asyncio.run(run_load(address, prompts[start : start + chunk],
                                                  Arrivals("closed", concurrency), temperature=args.temperature,
                                                  max_tokens=args.max_tokens, speculate=speculate, extra=extra))
                    failed = [r.error for r in result.records if r.error]
                    if failed:
                        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
                    cell.records[variant] += result.records
                    cell.seconds[variant] += result.duration
    return cells


def report(cells: dict[tuple[int, bool], CostSetting]) -> None:
    print("| c | speculation | plain tok/s | with extras tok/s | ratio | plain MAL | extras MAL |")
    print("|---|---|---|---|---|---|---|")
    for (concurrency, speculate), cell in cells.items():
        mal = [cell.mal(v) for v in ("plain", "extra")]
        shown = [f"{m:.2f}" if m is not None else "-" for m in mal]
        print(f"| {concurrency} | {'on' if speculate else 'off'} | {cell.tok_s('plain'):.1f} | "
              f"{cell.tok_s('extra'):.1f} | {cell.tok_s('extra') / cell.tok_s('plain'):.3f} | {shown[0]} | {shown[1]} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extra", choices=sorted(EXTRAS), default="penalties")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sync", action="store_true", help="the target waits for drafts every step (--sync-speculation)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="tandem-sampling-cost-"))
    draft = ServiceProcess("draft_service", ["--model", args.draft_model, "--drafter", "model", "--threads", "1"],
                           log_path=logs / "draft.log").start()
    sync = ["--sync-speculation"] if args.sync else []
    target = ServiceProcess("target_service", ["--model", args.model, "--threads", "1", "--drafter", draft.address,
                                               *sync], log_path=logs / "target.log").start()
    try:
        draft.wait_healthy(300)
        target.wait_healthy(300)
        target.wait_metric("tandem_drafter_connected", 1.0)
        print(f"{args.model}, drafter {args.draft_model}{', synchronous' if args.sync else ''}, 1 + 1 threads, "
              f"{args.num_prompts} prompts, "
              f"T={args.temperature:g}, {args.max_tokens} max tokens, extras: {EXTRAS[args.extra]} (logs: {logs})")
        report(measure(target.address, args))
    finally:
        target.terminate(10)
        draft.terminate(10)


if __name__ == "__main__":
    main()
