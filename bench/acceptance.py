"""Acceptance of compressed drafts on real next-token distributions of the embedded model.

p is SmolLM2-135M at temperature T with the full context, along continuations it generated itself
(T=0.7, EOS masked) for a few chat prompts: the positions a target verifies. Two drafters q:
- int8: the same model with every weight matrix rounded to int8 per output row, what a
  weight-quantized copy of the target would propose (a strong drafter);
- window: the same model that sees only the last WINDOW tokens, a drafter that is cheap because
  it reads little context (a weaker one).
For each, the acceptance rate E[sum_x min(p, q')] of rejection sampling, where q' = decode(encode(q, K)),
for K = 1 to 256 and for q itself, with the wire bytes per draft token (full q: dense float32).

    .venv/bin/python bench/acceptance.py
"""
from __future__ import annotations

import argparse
import time

import torch

from tandem_kernels import decode, encode, processed_probs, sample, wire_bytes_per_token
from tandem.config import ModelConfig
from tandem.loaders import load_checkpoint
from tandem.model.batch import SequenceChunk
from tandem.model.llama import LayerWeights, LlamaModel, ModelWeights, build_model
from tandem.registry import resolve_model_path
from tandem.runtime import load_tokenizer

PROMPTS = [
    "Explain how a hash table handles collisions.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of the French Revolution?",
    "Give me a recipe for a simple vegetable soup.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Why is the sky blue? Answer for a ten-year-old.",
]
TEMPERATURES = (0.3, 0.7, 1.0, 1.3)
TOP_KS = (1, 4, 8, 16, 32, 64, 128, 256)
WINDOW = 16
SLOTS = 32
MAX_LEN = 512


def _ones(n: int) -> dict[str, torch.Tensor]:
    """Sampling parameters with no top-k, top-p or min-p, for n rows."""
    return {"top_k": torch.zeros(n, dtype=torch.int64), "top_p": torch.ones(n), "min_p": torch.zeros(n)}


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return processed_probs(logits, torch.full((logits.shape[0],), temperature), **_ones(logits.shape[0]))


def generate(model: LlamaModel, prompts: list[list[int]], num_tokens: int, no_eos: list[int]) -> list[list[int]]:
    """Continuations sampled at T=0.7 (seeded, EOS masked), all prompts decoded as one batch."""
    sequences = [list(p) for p in prompts]
    chunks = [SequenceChunk(slot=i, start=0, token_ids=p) for i, p in enumerate(prompts)]
    for step in range(num_tokens):
        logits = model.run(chunks).index_fill(1, torch.tensor(no_eos), float("-inf"))  # [B, V]
        positions = torch.tensor([len(s) for s in sequences])
        tokens = sample(_probs(logits, 0.7), torch.arange(len(sequences)), positions).tolist()
        chunks = [SequenceChunk(slot=i, start=len(s), token_ids=[t]) for i, (s, t) in enumerate(zip(sequences, tokens))]
        for s, t in zip(sequences, tokens):
            s.append(t)
    return sequences


def full_context_logits(model: LlamaModel, sequences: list[list[int]], prompt_lens: list[int]) -> torch.Tensor:
    """Logits [N, V] predicting every generated token from everything before it."""
    rows = []
    for slot, (tokens, start) in enumerate(zip(sequences, prompt_lens)):
        chunk = SequenceChunk(slot=slot, start=0, token_ids=tokens[:-1], num_logits=len(tokens) - start)
        rows.append(model.run([chunk]))
    return torch.cat(rows)


def window_logits(model: LlamaModel, sequences: list[list[int]], prompt_lens: list[int]) -> torch.Tensor:
    """Logits [N, V] predicting every generated token from the WINDOW tokens before it only."""
    contexts = [
        tokens[max(0, t - WINDOW) : t]
        for tokens, start in zip(sequences, prompt_lens)
        for t in range(start, len(tokens))
    ]
    rows = []
    for first in range(0, len(contexts), SLOTS):
        batch = contexts[first : first + SLOTS]
        rows.append(model.run([SequenceChunk(slot=i, start=0, token_ids=c) for i, c in enumerate(batch)]))
    return torch.cat(rows)


def _cpu_model(config: ModelConfig, weights: ModelWeights) -> LlamaModel:
    return build_model(
        config, weights, dtype=torch.float32, device=torch.device("cpu"), num_slots=SLOTS, max_model_len=MAX_LEN
    )


def int8_rows(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] rounded to int8 with one scale per output row, back in float32."""
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return (weight / scale).round().clamp(-127, 127) * scale


def int8_model(config: ModelConfig, weights: ModelWeights) -> LlamaModel:
    """The model with every weight matrix int8-rounded (norms stay exact)."""
    layers = [
        LayerWeights(
            layer.attn_norm, int8_rows(layer.qkv), layer.qkv_bias, int8_rows(layer.o),
            layer.mlp_norm, int8_rows(layer.gate_up), int8_rows(layer.down),
        )  # fmt: skip
        for layer in weights.layers
    ]
    embed = int8_rows(weights.embed)
    lm_head = embed if weights.lm_head is weights.embed else int8_rows(weights.lm_head)
    quantized = ModelWeights(embed, layers, weights.norm, lm_head, weights.rope_inv_freq)
    return _cpu_model(config, quantized)


def acceptance_by_k(p: torch.Tensor, q: torch.Tensor) -> dict[int | None, float]:
    """Mean over rows of sum_x min(p, q'), for q' = decode(encode(q, K)) and for q itself (None)."""
    results = {None: float(torch.minimum(p, q).sum(dim=1).mean())}
    # encode keeps the top-K of q in stable descending order, so one sort serves every K.
    top, ids = q.sort(dim=1, descending=True, stable=True)
    top, ids = top[:, : max(TOP_KS)], ids[:, : max(TOP_KS)]  # [N, 32]
    for k in TOP_KS:
        compressed = encode(top, k)  # ids are columns of `top`
        q_prime = decode(compressed)  # [N, k]
        assert bool((q_prime.sum(dim=1) == 1.0).all())
        p_at = p.gather(1, ids.gather(1, compressed.ids.long()))  # [N, k]
        results[k] = float(torch.minimum(p_at, q_prime).sum(dim=1).mean())
    return results


def table(name: str, p_logits: torch.Tensor, q_logits: torch.Tensor) -> dict[float, dict[int | None, float]]:
    """Print and return acceptance by temperature and K."""
    vocab = p_logits.shape[1]
    header = "".join(f"{'K=' + str(k):>9}" for k in TOP_KS) + f"{'full q':>9}"
    print(f"\n{name}: acceptance sum_x min(p, q') over {p_logits.shape[0]} positions\n{'T':>5}{header}")
    results = {}
    for temperature in TEMPERATURES:
        p, q = _probs(p_logits, temperature), _probs(q_logits, temperature)
        results[temperature] = acceptance_by_k(p, q)
        print(f"{temperature:>5}" + "".join(f"{results[temperature][k]:>9.4f}" for k in (*TOP_KS, None)))
    print(f"{'bytes':>5}" + "".join(f"{wire_bytes_per_token(k):>9}" for k in TOP_KS) + f"{4 * vocab:>9}")
    return results


def smallest_k(results: list[dict[float, dict[int | None, float]]], max_temperature: float) -> int | None:
    """The smallest K within 1% (relative) of full q at every T <= max_temperature, for every drafter."""
    for k in TOP_KS:
        if all(r[t][k] >= 0.99 * r[t][None] for r in results for t in TEMPERATURES if t <= max_temperature):
            return k
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=96, help="generated tokens per prompt")
    # One thread: beside any other busy process, two ran the hash and the model several times slower.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    config, weights = load_checkpoint(path)
    target = _cpu_model(config, weights)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in PROMPTS]
    sequences = generate(target, prompts, args.tokens, sorted(tokenizer.eos_token_ids))
    prompt_lens = [len(p) for p in prompts]
    elapsed = time.perf_counter() - started
    print(f"{args.model}: {len(prompts)} prompts, {args.tokens} generated tokens each ({elapsed:.0f} s)")
    p_logits = full_context_logits(target, sequences, prompt_lens)
    drafters = {
        "int8 weights": full_context_logits(int8_model(config, weights), sequences, prompt_lens),
        f"last {WINDOW} tokens only": window_logits(target, sequences, prompt_lens),
    }
    results = [table(name, p_logits, q_logits) for name, q_logits in drafters.items()]
    for max_temperature in (0.7, 1.0):
        k = smallest_k(results, max_temperature)
        found = f"K={k}" if k else f"none up to K={TOP_KS[-1]}"
        print(f"smallest K within 1% of full q at every T <= {max_temperature} for both drafters: {found}")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
