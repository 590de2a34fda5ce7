"""Milliseconds per forward: the native CPU decoder against the PyTorch decoder, in one run.

    python bench/forward_speed.py [--threads 1,2] [--rounds 5] [--context 128] [--random]

Four steps, each against a KV cache already holding `--context` tokens per sequence: decode
(1 sequence, 1 token), verify (1 sequence, k+1 = 5 tokens, 5 logits), batch-8 decode (8
sequences, 1 token each) and batch-8 verify. The PyTorch decoder runs on the first thread count,
the native one on each. The variants run interleaved, round after round, and the table shows each
one's median, the speed-up of each native column over PyTorch, and verify / decode per column.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from tandem.config import ModelConfig
from tandem.model.batch import SequenceChunk
from tandem.model.llama import Backend, LlamaModel, ModelWeights, build_model


def load_weights(model_name: str, random: bool) -> tuple[ModelConfig, ModelWeights]:
    if random:
        from tandem.model.random_weights import SHAPES, random_weights

        config = SHAPES[model_name]
        return config, random_weights(config)
    from tandem.loaders import load_checkpoint
    from tandem.registry import resolve_model_path

    return load_checkpoint(resolve_model_path(model_name))


def steps(context: int) -> dict[str, list[SequenceChunk]]:
    token = [1000]
    return {
        "decode M=1": [SequenceChunk(0, context, token)],
        "verify k+1=5": [SequenceChunk(0, context, list(range(1000, 1005)), num_logits=5)],
        "batch-8 decode": [SequenceChunk(slot, context, token) for slot in range(8)],
        "batch-8 verify": [SequenceChunk(slot, context, list(range(1000, 1005)), num_logits=5) for slot in range(8)],
    }


def prefilled(config: ModelConfig, weights: ModelWeights, dtype: torch.dtype, backend: Backend,
              context: int) -> LlamaModel:
    model = build_model(config, weights, dtype=dtype, device=torch.device("cpu"), num_slots=8,
                        max_model_len=context + 16, backend=backend)
    prompt = list(range(2000, 2000 + context))
    model.run([SequenceChunk(slot, 0, prompt) for slot in range(8)])
    return model


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--random", action="store_true", help="random weights of the model's shape")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", default="1", help="comma-separated thread counts for the native decoder")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="forwards per timing")
    args = parser.parse_args()
    thread_counts = [int(n) for n in args.threads.split(",")]
    config, weights = load_weights(args.model, args.random)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    models = {(d, b): prefilled(config, weights, d, b, args.context) for d in dtypes for b in ("torch", "native")}
    variants = [("torch", thread_counts[0])] + [("native", n) for n in thread_counts]
    cases = steps(args.context)
    times: dict[tuple, list[float]] = {(s, d, v): [] for s in cases for d in dtypes for v in variants}
    for _ in range(args.rounds):
        for (step, dtype, (backend, threads)), samples in times.items():
            torch.set_num_threads(threads)
            model, chunks = models[dtype, backend], cases[step]
            model.run(chunks)  # untimed: the first forward after another variant's pays for its misses
            samples.append(time_ms(lambda: model.run(chunks), args.repeats))
    medians = {key: statistics.median(samples) for key, samples in times.items()}
    names = [f"{backend}@{threads}" for backend, threads in variants]
    print(f"model={args.model} context={args.context} rounds={args.rounds} repeats={args.repeats}  "
          f"(median ms per forward; xN: PyTorch / column)")
    print(f"{'step':16}{'dtype':10}" + "".join(f"{name:>18}" for name in names))
    for step in cases:
        for dtype in dtypes:
            base = medians[step, dtype, variants[0]]
            cells = [f"{medians[step, dtype, v]:8.1f} (x{base / medians[step, dtype, v]:4.2f})" for v in variants]
            print(f"{step:16}{str(dtype).removeprefix('torch.'):10}" + "".join(f"{c:>18}" for c in cells))
    for dtype in dtypes:
        ratios = [medians["verify k+1=5", dtype, v] / medians["decode M=1", dtype, v] for v in variants]
        print(f"{'verify/decode':16}{str(dtype).removeprefix('torch.'):10}" + "".join(f"{r:18.2f}" for r in ratios))


if __name__ == "__main__":
    main()
