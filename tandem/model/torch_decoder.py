"""The PyTorch decoder: the reference the native CPU decoder is tested against, and the CUDA path."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.config import ModelConfig
from tandem.model.attention import attend, write_kv
from tandem.model.batch import ForwardBatch, SequenceChunk
from tandem.model.kv_cache import KVCache
from tandem.model.rope import RotaryEmbedding


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class TorchDecoder:
    """One forward pass = ~20 ATen calls per layer; GQA folds the query heads that share a KV head."""

    def __init__(self, config: ModelConfig, weights, kv_cache: KVCache, rope: RotaryEmbedding):
        """weights: ModelWeights already on the device, in the compute dtype."""
        self.config = config
        self.kv_cache = kv_cache
        self.rope = rope
        self.device = weights.embed.device
        self._layers = [_Layer(w.attn_norm, w.qkv, w.qkv_bias, w.o, w.mlp_norm, w.gate_up, w.down)
                        for w in weights.layers]
        self._embed = weights.embed
        self._final_norm = weights.norm
        self._lm_head = weights.lm_head
        self._q_size = config.num_heads * config.head_dim
        self._kv_size = config.num_kv_heads * config.head_dim

    def build_batch(self, chunks: list[SequenceChunk]) -> ForwardBatch:
        return ForwardBatch.build(chunks, self.config.queries_per_kv, self.device)

    def forward(self, batch: ForwardBatch, want_hidden: bool = False) -> torch.Tensor:
        hidden = F.embedding(batch.input_ids, self._embed)  # [T, hidden]
        for index, layer in enumerate(self._layers):
            hidden = self._layer(index, layer, hidden, batch)
        last = self._norm(hidden[batch.logits_indices], self._final_norm)  # [num_logits, hidden]
        return last if want_hidden else self.logits(last)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self._lm_head).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        return F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype) * weight

    def _layer(self, index: int, w: _Layer, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cfg = self.config
        num_tokens = hidden.shape[0]
        x = self._norm(hidden, w.attn_norm)
        qkv = F.linear(x, w.qkv, w.qkv_bias)  # [T, (heads + 2 * kv_heads) * head_dim]
        qk = qkv[:, : self._q_size + self._kv_size].view(num_tokens, -1, cfg.head_dim)
        qk = self.rope.apply(qk, batch.positions)  # [T, heads + kv_heads, head_dim]
        q = qk[:, : cfg.num_heads]
        k = qk[:, cfg.num_heads :]
        v = qkv[:, self._q_size + self._kv_size :].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        k_cache, v_cache = self.kv_cache.k[index], self.kv_cache.v[index]
        write_kv(k_cache, v_cache, k, v, batch.positions, batch.attn)
        attn = attend(q, k_cache, v_cache, batch.attn)  # [T, heads * head_dim]
        hidden = hidden + F.linear(attn, w.o)
        x = self._norm(hidden, w.mlp_norm)
        gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, w.down)
