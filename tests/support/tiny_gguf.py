"""Small GGUF files: tokenizer metadata and just enough of a llama header for tokenizer tests, and a
tiny model in K-quants."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tandem.model.random_weights import random_k_blocks


def write_tokenizer_gguf(path: Path, model: str, tokens: list[str], scores: list[float] | None = None,
                types: list[int] | None = None, pre: str | None = None, merges: list[str] | None = None) -> Path:
    """A GGUF with tokenizer metadata, and just enough llama hyperparameters for transformers to open it."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if scores is not None:
        writer.add_token_scores(scores)
    if types is not None:
        writer.add_token_types(types)
    if merges is not None:
        writer.add_token_merges(merges)
    for add in (writer.add_context_length, writer.add_embedding_length, writer.add_block_count,
                writer.add_feed_forward_length, writer.add_head_count, writer.add_head_count_kv):
        add(8)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_bos_token_id(1 if len(tokens) > 1 else 0)
    writer.add_eos_token_id(2 if len(tokens) > 2 else 0)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


K_QUANT_ROLES = {  # a Q4_K_M-like mix, and Q5_K for the attention output
    "attn_q": gguf.GGMLQuantizationType.Q4_K, "attn_k": gguf.GGMLQuantizationType.Q4_K,
    "attn_v": gguf.GGMLQuantizationType.Q6_K, "attn_output": gguf.GGMLQuantizationType.Q5_K,
    "ffn_gate": gguf.GGMLQuantizationType.Q4_K, "ffn_up": gguf.GGMLQuantizationType.Q4_K,
    "ffn_down": gguf.GGMLQuantizationType.Q6_K,
}


def write_k_quant_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer llama GGUF (hidden 256, 4 heads of 64, 2 KV heads, 512 MLP, 300 tokens, tied
    embedding) whose matrices are random K-quant superblocks (K_QUANT_ROLES, Q6_K embedding)."""
    rng = np.random.default_rng(seed)
    hidden, inter, heads, kv_heads, vocab = 256, 512, 4, 2, 300
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(2)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * 64, hidden), "attn_v": (kv_heads * 64, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}

    def add(name: str, rows: int, cols: int, ggml_type: gguf.GGMLQuantizationType) -> None:
        writer.add_tensor(name, random_k_blocks(rows, cols, ggml_type, rng), raw_dtype=ggml_type)

    add("token_embd.weight", vocab, hidden, gguf.GGMLQuantizationType.Q6_K)
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    for layer in range(2):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        for role, ggml_type in K_QUANT_ROLES.items():
            add(f"blk.{layer}.{role}.weight", *shapes[role], ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
