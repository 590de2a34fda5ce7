"""Random-weight models of real shapes, for tests and GPU benchmarks where checkpoints can't travel."""
from __future__ import annotations

import torch

from tandem.config import ModelConfig, RopeScaling
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
