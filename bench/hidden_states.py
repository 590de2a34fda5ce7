"""What sending the target's features costs (EAGLE-3 drafters): bytes per token, and the step with
and without capturing them, interleaved in one run on the same sequence.

A capturing step also turns its features into bf16 and then into the Extend's bytes; both are
timed here as part of it.

    python -m bench.hidden_states [--dtype bfloat16] [--threads 1] [--rounds 200]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from tandem.hidden_states import FeatureLayout
from tandem.loaders import load_checkpoint
from tandem.model.batch import SequenceChunk
from tandem.model.eagle3 import default_feature_layers
from tandem.model.llama import LlamaModel, build_model
from tandem.registry import resolve_model_path

PROMPT_LEN = 256


def step_seconds(model: LlamaModel, layout: FeatureLayout | None, chunk: SequenceChunk) -> float:
    """One forward of the chunk; with a layout, capturing its features and encoding the committed rows."""
    began = time.perf_counter()
    batch = model.build_batch([chunk])
    if layout is None:
        model.forward(batch)
    else:
        _, features = model.forward_capturing(batch, layout.layers)
        layout.encode(features.to(torch.bfloat16))
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config, weights = load_checkpoint(resolve_model_path(args.model))
    layout = FeatureLayout(default_feature_layers(config.num_layers), config.hidden_size)
    model = build_model(config, weights, dtype=getattr(torch, args.dtype), device=torch.device("cpu"),
                        num_slots=1, max_model_len=PROMPT_LEN + 16)
    model.run([SequenceChunk(0, 0, list(range(1000, 1000 + PROMPT_LEN)))])
    print(f"{args.model} {args.dtype}, {args.threads} thread(s), {model.decoder.__class__.__name__}; "
          f"layers {list(layout.layers)}: {layout.row_bytes} bytes per token")
    for name, width in (("decode", 1), ("verify k=4", 5)):
        chunk = SequenceChunk(0, PROMPT_LEN, list(range(2000, 2000 + width)), num_logits=width)
        times: dict[str, list[float]] = {"plain": [], "capturing": []}
        for _ in range(args.rounds):  # interleaved, so that drift hits both alike
            times["plain"].append(step_seconds(model, None, chunk))
            times["capturing"].append(step_seconds(model, layout, chunk))
        plain, capturing = (statistics.median(times[k]) * 1e3 for k in ("plain", "capturing"))
        print(f"{name}: plain {plain:.2f} ms, capturing {capturing:.2f} ms, ratio {capturing / plain:.3f} "
              f"(medians of {args.rounds})")


if __name__ == "__main__":
    main()
