"""Per-token cost of the distilled drafter against its target, measured in one run.

    python bench/drafter_cost.py [--threads 1] [--rounds 7] [--context 256] [--drafter-dtype auto]

Both models hold `--context` tokens in their KV cache; each round times a decode step (1 token)
of each, interleaved so that the shared machine's noise hits both alike, plus the target's verify
step (k+1 = 5 tokens). Prints the medians and the ratios that decide whether drafting pays:
drafter / target decode, and a k=4 drafting round (4 drafter steps) / target verify.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from tandem.model.batch import SequenceChunk
from tandem.model.llama import LlamaModel
from tandem.registry import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL
from tandem.runtime import load_model


def prefilled(name: str, context: int, dtype: str) -> LlamaModel:
    model = load_model(name, dtype=dtype, num_slots=1, max_model_len=context + 16).model
    model.run([SequenceChunk(0, 0, list(range(2000, 2000 + context)))])
    return model


def time_ms(model: LlamaModel, chunk: SequenceChunk, repeats: int) -> float:
    began = time.perf_counter()
    for _ in range(repeats):
        model.run([chunk])
    return (time.perf_counter() - began) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_MODEL)
    parser.add_argument("--drafter", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--dtype", default="float32", help="the target's")
    parser.add_argument("--drafter-dtype", default="auto", help="auto: bfloat16 for a drafter file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, drafter = prefilled(args.target, args.context, args.dtype), prefilled(args.drafter, args.context, args.drafter_dtype)
    decode = SequenceChunk(0, args.context, [1000])
    verify = SequenceChunk(0, args.context, list(range(1000, 1005)), num_logits=5)
    times: dict[str, list[float]] = {"target decode": [], "target verify k+1=5": [], "drafter decode": []}
    for _ in range(args.rounds):
        times["target decode"].append(time_ms(target, decode, args.repeats))
        times["drafter decode"].append(time_ms(drafter, decode, args.repeats))
        times["target verify k+1=5"].append(time_ms(target, verify, args.repeats))
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"threads {args.threads}, target {args.dtype}, drafter {args.drafter_dtype}, context {args.context}, "
          f"medians of {args.rounds} rounds:")
    for name, value in medians.items():
        print(f"  {name:<22} {value:7.2f} ms")
    print(f"drafter / target decode:         {medians['drafter decode'] / medians['target decode']:.3f}")
    print(f"4 drafter steps / target verify: {4 * medians['drafter decode'] / medians['target verify k+1=5']:.3f}")


if __name__ == "__main__":
    main()
