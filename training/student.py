"""The trainable student: the runtime's Llama layers as nn.Parameters, over whole padded sequences.

Its math is the runtime's (tandem.model.llama), written for autograd: causal attention over
[batch, time] instead of a slot KV cache. The embedding and the draft head are the target's,
frozen; only the layers and the final norm train.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import ModelConfig
from tandem.model.llama import LayerWeights
from tandem.model.rope import RotaryEmbedding


class StudentLayer(nn.Module):
    def __init__(self, w: LayerWeights):
        super().__init__()
        for name in ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down"):
            setattr(self, name, nn.Parameter(getattr(w, name).detach().clone().float()))
        self.qkv_bias = None if w.qkv_bias is None else nn.Parameter(w.qkv_bias.detach().clone().float())

    def weights(self) -> LayerWeights:
        def value(p: nn.Parameter | None) -> torch.Tensor | None:
            return None if p is None else p.detach().clone()

        return LayerWeights(attn_norm=value(self.attn_norm), qkv=value(self.qkv), qkv_bias=value(self.qkv_bias),
                            o=value(self.o), mlp_norm=value(self.mlp_norm), gate_up=value(self.gate_up),
                            down=value(self.down))


class Student(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[LayerWeights], norm: torch.Tensor,
                 embed: torch.Tensor, head: torch.Tensor, inv_freq: torch.Tensor, max_len: int,
                 device: torch.device):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(StudentLayer(w) for w in layers)
        self.norm = nn.Parameter(norm.detach().clone().float())
        self.register_buffer("embed", embed.float(), persistent=False)  # [vocab, hidden], frozen
        self.register_buffer("head", head.float(), persistent=False)  # [N, hidden], frozen
        self.to(device)
        self.rope = RotaryEmbedding(inv_freq, max_len, torch.float32, device)

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Normed last hidden states [B, T, hidden] for right-padded input_ids [B, T]."""
        x = F.embedding(input_ids, self.embed)  # [B, T, hidden]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # [T]
        for layer in self.layers:
            x = self._layer(layer, x, positions)
        return F.rms_norm(x, self.norm.shape, self.norm, self.config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [B, T, N]."""
        return self.hidden(input_ids) @ self.head.T

    def _layer(self, w: StudentLayer, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        batch, time, _ = hidden.shape
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        x = F.rms_norm(hidden, w.attn_norm.shape, w.attn_norm, cfg.rms_norm_eps)
        qkv = F.linear(x, w.qkv, w.qkv_bias)  # [B, T, (heads + 2 * kv_heads) * head_dim]
        qk = qkv[..., : q_size + kv_size].view(batch, time, -1, cfg.head_dim)
        qk = self.rope.apply(qk, positions)  # [B, T, heads + kv_heads, head_dim]
        q = qk[:, :, : cfg.num_heads].transpose(1, 2)  # [B, heads, T, head_dim]
        k = qk[:, :, cfg.num_heads :].transpose(1, 2)  # [B, kv_heads, T, head_dim]
        v = qkv[..., q_size + kv_size :].view(batch, time, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        k = k.repeat_interleave(cfg.queries_per_kv, dim=1)  # [B, heads, T, head_dim]
        v = v.repeat_interleave(cfg.queries_per_kv, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, heads, T, head_dim]
        hidden = hidden + F.linear(attn.transpose(1, 2).reshape(batch, time, q_size), w.o)
        x = F.rms_norm(hidden, w.mlp_norm.shape, w.mlp_norm, cfg.rms_norm_eps)
        gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, w.down)

    def layer_weights(self) -> list[LayerWeights]:
        return [layer.weights() for layer in self.layers]

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]
