"""GGUF files: config from the metadata, tensors dequantized or kept in blocks, llama.cpp's Q/K row permutation undone."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tandem.config import ModelConfig, UnsupportedModelError
from tandem.loaders.errors import CheckpointError
from tandem.loaders.assemble import assemble_weights
from tandem.loaders.gguf_dequant import dequantize
from tandem.loaders.gguf_reader import GGUFFile, GGUFTensorInfo
from tandem.model.block_matrix import BLOCK_TYPES, BlockMatrix
from tandem.model.llama import Matrix, ModelWeights
from tandem.model.rope import rope_inv_freq

_SUPPORTED_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
}

_GGUF_NAMES = {
    "embed": "token_embd.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "q_bias": "blk.{i}.attn_q.bias",
    "k_bias": "blk.{i}.attn_k.bias",
    "v_bias": "blk.{i}.attn_v.bias",
    "o": "blk.{i}.attn_output.weight",
    "mlp_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
}


_MATRIX_ROLES = ("embed", "lm_head", "q", "k", "v", "o", "gate", "up", "down")


def load_gguf(path: Path, keep_blocks: bool = False) -> tuple[ModelConfig, ModelWeights]:
    """keep_blocks: matrices stored in one of BLOCK_TYPES stay in their blocks (views of the file)."""
    file = GGUFFile(path)
    tensors = file.tensors
    config = config_from_gguf(file.metadata, has_output="output.weight" in tensors)
    # llama.cpp permutes Q and K rows for its interleaved RoPE on "llama"; Qwen2 is left as is.
    permuted = config.architecture == "llama"

    def get(role: str, layer: int | None) -> Matrix | None:
        tensor = tensors.get(_GGUF_NAMES[role].format(i=layer))
        if tensor is None:
            return None
        blocks = keep_blocks and role in _MATRIX_ROLES and tensor.ggml_type in BLOCK_TYPES
        weight = file.tensor_data(tensor.name) if blocks else _dequantize(file, tensor)
        if permuted and role in ("q", "q_bias"):
            weight = _unpermute(weight, config.num_heads)
        elif permuted and role in ("k", "k_bias"):
            weight = _unpermute(weight, config.num_kv_heads)
        return BlockMatrix.stored(weight, tensor.ggml_type) if blocks else torch.from_numpy(weight)

    inv_freq = None
    if "rope_freqs.weight" in tensors:  # Llama 3 scaling, stored as per-frequency divisors
        divisors = torch.from_numpy(_dequantize(file, tensors["rope_freqs.weight"]))
        inv_freq = rope_inv_freq(config) / divisors.double()
    return config, assemble_weights(config, get, inv_freq)


def config_from_gguf(metadata: dict[str, Any], has_output: bool) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; supported: llama, qwen2")

    def meta(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}")
        if value is None and default is None:
            raise CheckpointError(f"GGUF metadata lacks {arch}.{key}")
        return default if value is None else value

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    vocab = metadata.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(metadata["tokenizer.ggml.tokens"])
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings=not has_output,
        attention_bias=arch == "qwen2",
    )


def _dequantize(file: GGUFFile, tensor: GGUFTensorInfo) -> np.ndarray:
    if tensor.ggml_type not in _SUPPORTED_TYPES:
        raise CheckpointError(
            f"tensor {tensor.name} has GGUF type {tensor.ggml_type.name}; "
            f"supported: {', '.join(sorted(t.name for t in _SUPPORTED_TYPES))}"
        )
    return dequantize(file.tensor_data(tensor.name), tensor.ggml_type)


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverts llama.cpp's convert-time permutation of Q/K rows (pairs back into halves); rows may
    be floats or stored blocks."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)
