"""llguidance against xgrammar on the JSON-extraction schemas: compile time and mask time per token.

    python -m bench.grammar_engines

For each engine: the time to prepare the tokenizer, each schema's compile time (its first mask
included, on a fresh compiler without a cache), and the time to compute one token bitmask at every
position of the schemas' reference answers, walked token by token (one thread, as the services run
it). It checks at every position that the mask allows the answer's next token. xgrammar comes with
the bench extra; llguidance is what the services use (tandem/structured/grammar.py says why).
"""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.prompt_set import JsonPrompt, load_json_prompts
from tandem.registry import DEFAULT_MODEL
from tandem.runtime import load_tokenizer, tokenizer_path
from tandem.structured.grammar import words_for
from tandem.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class EngineFigures:
    name: str
    tokenizer_seconds: float
    compile_seconds: list[float]
    mask_seconds: list[float]

    def format(self) -> str:
        masks = sorted(self.mask_seconds)
        return (f"| {self.name} | {self.tokenizer_seconds * 1e3:.0f} | {statistics.mean(self.compile_seconds) * 1e3:.1f} | "
                f"{max(self.compile_seconds) * 1e3:.1f} | {statistics.mean(masks) * 1e6:.1f} | "
                f"{masks[len(masks) // 2] * 1e6:.1f} | {masks[int(0.99 * len(masks))] * 1e6:.1f} | {len(masks)} |")


def _allows(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def walk(new_matcher: Callable[[JsonPrompt], object], fill: Callable[[object, torch.Tensor], None],
         consume: Callable[[object, int], bool], prompts: list[JsonPrompt], paths: list[list[int]],
         vocab_size: int) -> tuple[list[float], list[float]]:
    """Compile seconds per schema (first mask included) and mask seconds per position."""
    bitmask = torch.zeros(1, words_for(vocab_size), dtype=torch.int32)
    compiles, masks = [], []
    for prompt, path in zip(prompts, paths):
        began = time.perf_counter()
        matcher = new_matcher(prompt)
        fill(matcher, bitmask)
        compiles.append(time.perf_counter() - began)
        for token in path:
            began = time.perf_counter()
            fill(matcher, bitmask)
            masks.append(time.perf_counter() - began)
            if not _allows(bitmask, token) or not consume(matcher, token):
                raise AssertionError(f"{prompt.id}: the mask forbids token {token} of the reference answer")
    return compiles, masks


def llguidance_figures(tokenizer: Tokenizer, prompts: list[JsonPrompt], paths: list[list[int]]) -> EngineFigures:
    import llguidance

    began = time.perf_counter()
    ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                          eos_token=sorted(tokenizer.eos_token_ids))
    prepared = time.perf_counter() - began

    def new_matcher(prompt: JsonPrompt):
        return llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(prompt.schema))

    def fill(matcher, bitmask: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    compiles, masks = walk(new_matcher, fill, lambda m, t: m.consume_token(t), prompts, paths, tokenizer.vocab_size)
    return EngineFigures("llguidance", prepared, compiles, masks)


def xgrammar_figures(tokenizer: Tokenizer, prompts: list[JsonPrompt], paths: list[list[int]]) -> EngineFigures:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    eos = sorted(tokenizer.eos_token_ids)
    began = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size, stop_token_ids=eos)
    prepared = time.perf_counter() - began

    def new_matcher(prompt: JsonPrompt):
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(prompt.schema)))

    compiles, masks = walk(new_matcher, lambda m, bitmask: m.fill_next_token_bitmask(bitmask),
                           lambda m, t: m.accept_token(t), prompts, paths, tokenizer.vocab_size)
    return EngineFigures("xgrammar", prepared, compiles, masks)


def main() -> None:
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(tokenizer_path(DEFAULT_MODEL))
    prompts = load_json_prompts()
    paths = [tokenizer.encode(json.dumps(p.reference), add_special_tokens=False) for p in prompts]
    print(f"{len(prompts)} schemas, {sum(map(len, paths))} answer tokens, vocabulary {tokenizer.vocab_size}, 1 thread")
    print("| engine | tokenizer ms | compile ms, mean | compile ms, max | mask us, mean | p50 | p99 | masks |")
    print("|---|---|---|---|---|---|---|---|")
    for figures in (llguidance_figures, xgrammar_figures):
        print(figures(tokenizer, prompts, paths).format(), flush=True)


if __name__ == "__main__":
    main()
