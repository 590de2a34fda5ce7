"""Single-sequence decode and prefill speed: our runtime against transformers, same GGUF, one run.

    python bench/model_speed.py [--threads 1] [--dtype float32] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench.greedy import greedy_generate
from tandem.loaders import load_checkpoint
from tandem.model.batch import SequenceChunk
from tandem.model.llama import build_model
from tandem.registry import resolve_model_path


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def bench_ours(model_name: str, dtype: torch.dtype, prompt: list[int], new_tokens: int, repeats: int):
    config, weights = load_checkpoint(resolve_model_path(model_name))
    model = build_model(config, weights, dtype=dtype, device=torch.device("cpu"), num_slots=1,
                        max_model_len=len(prompt) + new_tokens + 1)
    prefill = _timed(lambda: model.run([SequenceChunk(0, 0, prompt)]), repeats)
    total = _timed(lambda: greedy_generate(model, prompt, new_tokens), repeats)
    return len(prompt) / prefill, (new_tokens - 1) / (total - prefill)


def bench_transformers(model_name: str, dtype: torch.dtype, prompt: list[int], new_tokens: int, repeats: int):
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model_name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    ids = torch.tensor([prompt])

    def generate():
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0)

    def prefill():
        with torch.inference_mode():
            model(ids)

    prefill_s = _timed(prefill, repeats)
    total = _timed(generate, repeats)
    return len(prompt) / prefill_s, (new_tokens - 1) / (total - prefill_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    ours = bench_ours(args.model, dtype, prompt, args.new_tokens, args.repeats)
    theirs = bench_transformers(args.model, dtype, prompt, args.new_tokens, args.repeats)
    print(f"model={args.model} dtype={args.dtype} threads={args.threads} prompt={args.prompt_tokens} "
          f"new={args.new_tokens}")
    print(f"{'':14}{'prefill tok/s':>15}{'decode tok/s':>15}")
    print(f"{'tandem':14}{ours[0]:15.1f}{ours[1]:15.1f}")
    print(f"{'transformers':14}{theirs[0]:15.1f}{theirs[1]:15.1f}")
    print(f"{'ratio':14}{ours[0] / theirs[0]:15.2f}{ours[1] / theirs[1]:15.2f}")


if __name__ == "__main__":
    main()
