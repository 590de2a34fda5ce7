"""Rotary position embeddings (HF "rotate half" layout), with Llama 3 scaling."""
from __future__ import annotations

import math

import torch

from tandem.config import ModelConfig, RopeScaling


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, [head_dim // 2], float64 for an exact cos/sin table."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return torch.where(medium, blended, scaled)


class RotaryEmbedding:
    """A cos/sin table for every position up to max_len, indexed per token."""

    def __init__(self, inv_freq: torch.Tensor, max_len: int, dtype: torch.dtype, device: torch.device):
        positions = torch.arange(max_len, dtype=torch.float64)
        angles = torch.outer(positions, inv_freq.to(torch.float64))  # [max_len, head_dim // 2]
        self.cos = angles.cos().to(dtype=dtype, device=device)
        self.sin = angles.sin().to(dtype=dtype, device=device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x: [num_tokens, heads, head_dim] at positions: [num_tokens]."""
        cos = self.cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim // 2]
        sin = self.sin[positions].unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
