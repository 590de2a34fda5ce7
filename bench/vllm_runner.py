"""Runs inside vLLM's own virtual environment (it imports vllm, not tandem): greedy generation of
given prompt token ids, one request after another and all at once, optionally with vLLM's n-gram
speculation. bench/versus_vllm.py starts it; it writes one JSON object to --out.

    VENV/bin/python bench/vllm_runner.py --model HF_DIR --prompts ids.json --out result.json
        [--dtype float32|bfloat16] [--ngram K] [--max-tokens 128]
"""
import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; the default wants more than a small box has


def main() -> None:
    from vllm import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF checkpoint folder")
    parser.add_argument("--prompts", required=True, help="JSON: a list of prompt token id lists")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--ngram", type=int, default=0, help="draft tokens of n-gram speculation; 0: off")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    prompts = json.load(open(args.prompts))
    speculative = None
    if args.ngram:
        speculative = {"method": "ngram", "num_speculative_tokens": args.ngram,
                       "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, seed=0, speculative_config=speculative)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def generate(batch: list[list[int]]) -> tuple[float, list[list[int]]]:
        began = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], greedy, use_tqdm=False)
        return time.perf_counter() - began, [list(o.outputs[0].token_ids) for o in outputs]

    generate(prompts[:2])  # warm-up: the first batch pays for graph capture and allocation
    one_seconds, one_outputs = 0.0, []
    for ids in prompts:
        seconds, outputs = generate([ids])
        one_seconds += seconds
        one_outputs += outputs
    all_seconds, all_outputs = generate(prompts)
    json.dump({"one_at_a_time": {"seconds": one_seconds, "outputs": one_outputs},
               "all_at_once": {"seconds": all_seconds, "outputs": all_outputs}}, open(args.out, "w"))


if __name__ == "__main__":  # vLLM starts its engine processes by spawn
    main()
