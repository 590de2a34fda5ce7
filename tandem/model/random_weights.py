"""Random-weight models of real shapes, for tests and GPU benchmarks where checkpoints can't travel."""
from __future__ import annotations

import itertools

import gguf
import numpy as np
import torch

from tandem.config import ModelConfig, RopeScaling
from tandem.model.block_matrix import LEGACY_TYPES, BlockMatrix
from tandem.model.llama import LayerWeights, ModelWeights

_LLAMA3_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)

SHAPES = {
    "tiny": ModelConfig("llama", 256, 64, 128, 2, 4, 2, 16, 1e-5, 10000.0, 512, True, False),
    "tiny-qwen2": ModelConfig("qwen2", 256, 64, 128, 2, 4, 2, 16, 1e-6, 10000.0, 512, False, True),
    "smollm2-135m": ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0, 8192, True, False),
    "llama-3.2-1b": ModelConfig("llama", 128256, 2048, 8192, 16, 32, 8, 64, 1e-5, 500000.0, 131072, True,
                                False, _LLAMA3_SCALING),
    "llama-3.1-8b": ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0, 131072, False,
                                False, _LLAMA3_SCALING),
}


def random_weights(
    config: ModelConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> ModelWeights:
    """Weights drawn at scale 1/sqrt(fan_in), so activations stay O(1) through every layer."""
    gen = torch.Generator(device=device).manual_seed(seed)
    c = config

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, device=device, dtype=dtype) / cols**0.5

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(c.hidden_size, generator=gen, device=device, dtype=dtype)

    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    layers = [
        LayerWeights(
            attn_norm=norm(),
            qkv=mat(qkv_rows, c.hidden_size),
            qkv_bias=(0.1 * torch.randn(qkv_rows, generator=gen, device=device, dtype=dtype)
                      if c.attention_bias else None),
            o=mat(c.hidden_size, c.num_heads * c.head_dim),
            mlp_norm=norm(),
            gate_up=mat(2 * c.intermediate_size, c.hidden_size),
            down=mat(c.hidden_size, c.intermediate_size),
        )
        for _ in range(c.num_layers)
    ]
    embed = torch.randn(c.vocab_size, c.hidden_size, generator=gen, device=device, dtype=dtype)
    lm_head = embed if c.tie_word_embeddings else mat(c.vocab_size, c.hidden_size)
    return ModelWeights(embed=embed, layers=layers, norm=norm(), lm_head=lm_head)


def random_k_blocks(rows: int, cols: int, ggml_type: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant superblocks, uint8 [rows, row bytes] (gguf has no K quantizer): random bytes,
    with d (and dmin) small random fp16 values, so that the weights are of a model's size."""
    block_bytes = gguf.GGML_QUANT_SIZES[ggml_type][1]
    data = rng.integers(0, 256, (rows, cols // 256, block_bytes), dtype=np.uint8)
    high = 2e-4 if ggml_type == gguf.GGMLQuantizationType.Q6_K else 2e-3  # Q6_K's scales are int8
    for at in [208] if ggml_type == gguf.GGMLQuantizationType.Q6_K else [0, 2]:  # d (and dmin)
        data[..., at:at + 2] = rng.uniform(high / 20, high, data.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return data.reshape(rows, -1)


def random_blocks(rows: int, cols: int, ggml_type: gguf.GGMLQuantizationType, seed: int) -> BlockMatrix:
    """A random [rows, cols] matrix in blocks of ggml_type: standard normal weights quantized as
    llama.cpp does (the legacy types), or random_k_blocks (K-quants)."""
    if ggml_type in LEGACY_TYPES:
        return BlockMatrix.quantized(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)), ggml_type)
    return BlockMatrix.stored(random_k_blocks(rows, cols, ggml_type, np.random.default_rng(seed)), ggml_type)


def random_block_weights(config: ModelConfig, ggml_type: gguf.GGMLQuantizationType, seed: int = 0) -> ModelWeights:
    """random_weights with every matrix (embedding and head included) in random blocks of ggml_type,
    for speed measurements of each type on a model's shapes."""
    seeds = itertools.count(seed)
    return random_weights(config, seed, dtype=torch.bfloat16).map_matrices(
        lambda matrix: random_blocks(*matrix.shape, ggml_type, next(seeds)))
