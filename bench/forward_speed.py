"""Milliseconds per forward of decode and verify steps: what verifying k drafts costs, in decode steps.

    python -m bench.forward_speed [--threads 1,2] [--rounds 5] [--context 128] [--max-k 8] [--torch]
                                  [--quantizations none,auto,q8_0,q4_0] [--block-activations int16,int8]
                                  [--isas avx2,avx512_vnni,avx512_bf16]
                                  [--kv-cache-dtypes auto,bfloat16,float16,float32]
                                  [--random --model llama-3.2-1b --block-types Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K]

Against a KV cache already holding `--context` tokens per sequence, batch 1 and batch 8: a decode
(1 token per sequence) and a verify of k drafts (k + 1 tokens and logits per sequence) for k = 1 ..
--max-k, on the native decoder at each thread count (and, with --torch, the PyTorch decoder at the
first). The variants run interleaved, round after round; the tables show each one's median, and
verify / decode: the number of decode steps a verify costs, which is what decides how many drafts
pay (a verify of k drafts adds 1 + alpha + ... + alpha^k tokens for that cost).

--quantizations: each a variant too (tandem/quantization.py): none is the float path in each
--dtypes, auto the GGUF's own block types (SmolLM2's Q4_1 and Q8_0), q8_0 / q4_0 the float
matrices quantized at load. --block-types (with --random): the model's shapes with every matrix
in random blocks of each GGML type, each a variant. --isas: the native decoder's builds
(tandem/model/native.py) to compare, each a variant; by default the best this CPU runs.
--kv-cache-dtypes: the KV cache's element type, each a variant (auto: build_model's choice).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from gguf import GGMLQuantizationType

from tandem.config import ModelConfig
from tandem.model import native
from tandem.model.batch import SequenceChunk
from tandem.model.kv_cache import KV_CACHE_DTYPES
from tandem.model.llama import Backend, LlamaModel, ModelWeights, build_model
from tandem.model.random_weights import SHAPES, random_block_weights, random_weights
from tandem.quantization import quantize


def load_weights(model_name: str, random: bool) -> tuple[ModelConfig, ModelWeights]:
    """The checkpoint's weights, GGUF block matrices kept as stored."""
    if random:
        config = SHAPES[model_name]
        return config, random_weights(config)
    from tandem.loaders import load_checkpoint
    from tandem.registry import resolve_model_path

    return load_checkpoint(resolve_model_path(model_name), keep_blocks=True)


def steps(context: int, max_k: int) -> dict[tuple[int, int], list[SequenceChunk]]:
    """(batch, k) -> the chunks of that step; k = 0 is a decode."""
    cases = {}
    for batch in (1, 8):
        for k in range(max_k + 1):
            tokens = list(range(1000, 1001 + k))
            cases[batch, k] = [SequenceChunk(slot, context, tokens, num_logits=k + 1) for slot in range(batch)]
    return cases


def prefilled(config: ModelConfig, weights: ModelWeights, dtype: torch.dtype, kv_cache_dtype: str,
              block_activations: str, backend: Backend, isa: str, context: int) -> LlamaModel:
    os.environ["TANDEM_NATIVE_ISA"] = isa  # the native build native.load() picks ("": the best), as the tests do
    native.load.cache_clear()
    model = build_model(config, weights, dtype=dtype, device=torch.device("cpu"), num_slots=8,
                        max_model_len=context + 16, backend=backend, kv_cache_dtype=KV_CACHE_DTYPES[kv_cache_dtype],
                        block_activations=block_activations)
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
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--quantizations", default="none", help="comma-separated: none, auto, q8_0, q4_0")
    parser.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated: auto, bfloat16, float16, float32")
    parser.add_argument("--block-types", default="", help="with --random: comma-separated GGML types")
    parser.add_argument("--block-activations", default="int16",
                        help="comma-separated: int16, int8 (block weights' inputs; each a variant)")
    parser.add_argument("--isas", default="", help="comma-separated native builds (avx2, avx512, avx512_vnni, avx512_bf16, amx)")
    parser.add_argument("--threads", default="1", help="comma-separated thread counts for the native decoder")
    parser.add_argument("--torch", action="store_true", help="the PyTorch decoder too, at the first thread count")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="forwards per timing")
    args = parser.parse_args()
    kv_cache_dtypes = args.kv_cache_dtypes.split(",")
    if unknown := set(kv_cache_dtypes) - set(KV_CACHE_DTYPES):
        parser.error(f"--kv-cache-dtypes: {', '.join(sorted(unknown))} not among {', '.join(KV_CACHE_DTYPES)}")
    if args.torch and kv_cache_dtypes != ["auto"]:
        parser.error("--torch runs the PyTorch decoder, whose KV cache is in the compute dtype: leave --kv-cache-dtypes")
    thread_counts = [int(n) for n in args.threads.split(",")]
    config, weights = load_weights(args.model, args.random)
    # (compute dtype, quantization or block type) -> weights
    weight_sets = {(getattr(torch, name), quantization): quantize(weights, quantization, config, getattr(torch, name),
                                                                  torch.device("cpu"))
                   for name in args.dtypes.split(",") for quantization in args.quantizations.split(",")}
    for name in filter(None, args.block_types.split(",")):
        weight_sets[torch.bfloat16, name] = random_block_weights(config, GGMLQuantizationType[name])
    # (compute dtype, quantization or block type, KV cache dtype, block activations)
    precisions = [(*w, kv, act) for w in weight_sets for kv in kv_cache_dtypes
                  for act in (args.block_activations.split(",") if weight_sets[w].in_blocks else ["int16"])]
    isas = args.isas.split(",") if args.isas else [""]
    variants = (([("torch", thread_counts[0], "")] if args.torch else [])
                + [("native", n, isa) for isa in isas for n in thread_counts])
    models = {(p, backend, isa): prefilled(config, weight_sets[p[:2]], p[0], p[2], p[3], backend, isa, args.context)
              for p in precisions for backend, isa in {(v[0], v[2]) for v in variants}}
    cases = steps(args.context, args.max_k)
    times: dict[tuple, list[float]] = {(c, p, v): [] for c in cases for p in precisions for v in variants}
    for _ in range(args.rounds):
        for (case, precision, (backend, threads, isa)), samples in times.items():
            torch.set_num_threads(threads)
            model, chunks = models[precision, backend, isa], cases[case]
            model.run(chunks)  # untimed: the first forward after another variant's pays for its misses
            samples.append(time_ms(lambda: model.run(chunks), args.repeats))
    medians = {key: statistics.median(samples) for key, samples in times.items()}
    names = [f"{backend}{'-' + isa if isa else ''}@{threads}" for backend, threads, isa in variants]
    print(f"model={args.model} context={args.context} rounds={args.rounds} repeats={args.repeats}  "
          f"(median ms per forward; xN: verify / decode of the same batch and variant)")
    for precision in precisions:
        for batch in (1, 8):
            print(f"\n{str(precision[0]).removeprefix('torch.')}, quantization {precision[1]}, KV cache "
                  f"{precision[2]}{', ' + precision[3] + ' activations' if weight_sets[precision[:2]].in_blocks else ''}, "
                  f"batch {batch}")
            print(f"{'step':12}" + "".join(f"{name:>24}" for name in names))
            for k in range(args.max_k + 1):
                label = "decode" if k == 0 else f"verify k={k}"
                cells = [f"{medians[(batch, k), precision, v]:8.1f} "
                         f"(x{medians[(batch, k), precision, v] / medians[(batch, 0), precision, v]:4.2f})"
                         for v in variants]
                print(f"{label:12}" + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
