"""A tiny random Llama checkpoint folder with its own word-level tokenizer, written by the tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 32


def write_tiny_model(folder: Path, seed: int, logit_scale: float = 12.0, head_dim: int = 16) -> Path:
    """A 2-layer Llama over VOCAB tokens whose next-token distributions are spread, not peaked; 4
    heads of head_dim (2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=4 * head_dim, intermediate_size=8 * head_dim, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"unk_token": "t0"}))
    return folder


def write_tiny_drafter(path: Path, target: Path, layers_from: Path, draft_vocab: list[int]) -> Path:
    """A drafter file for the tiny `target`: the first layer of the model at `layers_from` over draft_vocab."""
    from tandem.loaders import load_checkpoint
    from tandem.loaders.drafter_file import DrafterFile, save_drafter_file, weights_fingerprint

    _, target_weights = load_checkpoint(target)
    _, source = load_checkpoint(layers_from)
    drafter = DrafterFile(layers=source.layers[:1], norm=source.norm, draft_vocab=torch.tensor(draft_vocab),
                          target=str(target), target_fingerprint=weights_fingerprint(target_weights), training={})
    save_drafter_file(path, drafter, dtype=torch.float32)
    return path
