"""Milliseconds per forward of the runtime: packed CPU linears against plain F.linear, in one run.

    python bench/forward_speed.py [--threads 1] [--rounds 5] [--context 128] [--random]

Three steps, each against a KV cache already holding `--context` tokens per sequence:
decode (1 sequence, 1 token), verify (1 sequence, k+1 = 5 tokens, 5 logits) and batch-8
decode (8 sequences, 1 token each). The machine is shared and noisy, so the variants run
interleaved, round after round, and the table shows each one's median and the ratio.
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
from tandem.model.llama import LlamaModel, ModelWeights, build_model
from tandem.model.linear import LinearBackend

BACKENDS: tuple[LinearBackend, ...] = ("torch", "auto")


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
    }


def prefilled(config: ModelConfig, weights: ModelWeights, dtype: torch.dtype, backend: LinearBackend,
              context: int) -> LlamaModel:
    model = build_model(config, weights, dtype=dtype, device=torch.device("cpu"), num_slots=8,
                        max_model_len=context + 16, linear_backend=backend)
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
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="forwards per timing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config, weights = load_weights(args.model, args.random)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    models = {(d, b): prefilled(config, weights, d, b, args.context) for d in dtypes for b in BACKENDS}
    cases = steps(args.context)
    times: dict[tuple, list[float]] = {(s, d, b): [] for s in cases for d, b in models}
    for _ in range(args.rounds):
        for (step, dtype, backend), samples in times.items():
            model, chunks = models[dtype, backend], cases[step]
            model.run(chunks)  # untimed: the first forward after another variant's pays for its misses
            samples.append(time_ms(lambda: model.run(chunks), args.repeats))
    print(f"model={args.model} threads={args.threads} context={args.context} rounds={args.rounds} "
          f"repeats={args.repeats}  (median ms per forward)")
    print(f"{'step':16}{'dtype':10}{'F.linear':>10}{'packed':>10}{'speedup':>9}")
    for step in cases:
        for dtype in dtypes:
            old, new = (statistics.median(times[step, dtype, b]) for b in BACKENDS)
            print(f"{step:16}{str(dtype).removeprefix('torch.'):10}{old:10.1f}{new:10.1f}{old / new:9.2f}")


if __name__ == "__main__":
    main()
