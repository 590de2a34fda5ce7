"""Greedy text of each weight format against HF transformers loading the same GGUF.

    python -m bench.greedy_oracle [--num-prompts 12] [--max-tokens 64] [--variants fp32,bf16,auto,auto-int8]

transformers dequantizes the GGUF to fp32: it is the oracle. On the last --num-prompts prompts of
the bundled set (the Spec-Bench-like kinds, which no drafter was tuned on), each of Tandem's
formats generates greedily from the same prompt ids: fp32 (--quantization none --dtype float32),
bf16 (none) and the GGUF's own blocks (auto; auto-int8 with their inputs in int8,
--block-activations int8), or q8_0 / q4_0. Prints, per prompt, the first token where each parts
from transformers (= when none does), and how many of the prompts each format keeps whole.

Then, teacher-forced on transformers' greedy text (as llama.cpp's --kl-divergence does): each
format's mean KL divergence from transformers' next-token distribution, and how often its top
token is transformers' (a measure of closeness that one early parting does not decide).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench.greedy import greedy_generate
from bench.prompt_set import load_prompts
from tandem.model.batch import SequenceChunk
from tandem.model.llama import LlamaModel, build_model
from tandem.loaders import load_checkpoint
from tandem.quantization import quantize
from tandem.registry import DEFAULT_MODEL, resolve_model_path

# name -> (compute dtype, quantization, block activations)
VARIANTS = {"fp32": (torch.float32, "none", "int16"), "bf16": (torch.bfloat16, "none", "int16"),
            "auto": (torch.bfloat16, "auto", "int16"), "auto-int8": (torch.bfloat16, "auto", "int8"),
            "q8_0": (torch.bfloat16, "q8_0", "int16"), "q4_0": (torch.bfloat16, "q4_0", "int16")}


def hf_greedy(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """transformers' own incremental greedy loop, with its KV cache and no stop token.

    generate(eos_token_id=None) is not used: in transformers 5.24 it changed a token whose logit
    margin was 0.15 against the model's own forward pass, so it is no oracle for that case.
    """
    tokens, past, step_input = [], None, prompt_ids
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(torch.tensor([step_input]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            step_input = tokens[-1:]
    return tokens


@torch.inference_mode()
def forced_logits(model, prompt_ids: list[int], text: list[int]) -> torch.Tensor:
    """[len(text), vocab] fp32: the next-token logits before each token of `text`, after the prompt."""
    ids = prompt_ids + text[:-1]
    if isinstance(model, LlamaModel):
        return model.run([SequenceChunk(slot=0, start=0, token_ids=ids, num_logits=len(text))]).float()
    return model(torch.tensor([ids])).logits[0, -len(text):].float()


@dataclass
class Closeness:
    """A format's next-token distributions against the oracle's, summed over positions."""
    kl: float = 0.0
    same_top: int = 0
    positions: int = 0

    def add(self, oracle: torch.Tensor, ours: torch.Tensor) -> None:
        """oracle, ours: [positions, vocab] logits."""
        want, got = oracle.log_softmax(-1), ours[:, :oracle.shape[1]].log_softmax(-1)
        self.kl += float((want.exp() * (want - got)).sum())
        self.same_top += int((want.argmax(-1) == got.argmax(-1)).sum())
        self.positions += oracle.shape[0]

    @property
    def mean_kl(self) -> float:
        return self.kl / max(self.positions, 1)

    @property
    def top1(self) -> float:
        return self.same_top / max(self.positions, 1)


def models(names: list[str], max_len: int) -> dict[str, LlamaModel]:
    path = resolve_model_path(DEFAULT_MODEL)
    built = {}
    for name in names:
        dtype, quantization, activations = VARIANTS[name]
        config, weights = load_checkpoint(path, keep_blocks=True)
        weights = quantize(weights, quantization, config, dtype, torch.device("cpu"))
        built[name] = build_model(config, weights, dtype=dtype, device=torch.device("cpu"), num_slots=1,
                                  max_model_len=max_len, block_activations=activations)
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--variants", default="fp32,bf16,auto", help=f"comma-separated: {', '.join(VARIANTS)}")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    oracle = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ours = models(args.variants.split(","), max_len=1024)
    kept = dict.fromkeys(ours, 0)
    divergence = {name: Closeness() for name in ours}
    prompts = load_prompts()[-args.num_prompts:]
    for prompt in prompts:
        ids = list(tokenizer.apply_chat_template(prompt.as_dicts(), add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
        want = hf_greedy(oracle, ids, args.max_tokens)
        cells = []
        for name, model in ours.items():
            got = greedy_generate(model, ids, args.max_tokens)
            parted = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            kept[name] += parted is None
            cells.append(f"{name} {'=' if parted is None else parted}")
            divergence[name].add(forced_logits(oracle, ids, want), forced_logits(model, ids, want))
        print(f"{prompt.id:20} {len(ids):4} prompt tokens  " + "  ".join(cells), flush=True)
    print("same text as transformers: " + ", ".join(f"{name} {n}/{len(prompts)}" for name, n in kept.items()))
    print("teacher-forced on transformers' text: " + ", ".join(
        f"{name} KL {c.mean_kl:.5f} top-1 {c.top1:.1%}" for name, c in divergence.items()))


if __name__ == "__main__":
    main()
