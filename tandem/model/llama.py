"""One Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) written for serving."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.config import ModelConfig
from tandem.model.attention import attend, write_kv
from tandem.model.batch import ForwardBatch, SequenceChunk
from tandem.model.kv_cache import KVCache
from tandem.model.linear import DenseLinear, Linear, LinearBackend, make_linear
from tandem.model.rope import RotaryEmbedding, rope_inv_freq


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    o: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied
    rope_inv_freq: torch.Tensor | None = None  # set when the checkpoint stores its own frequencies

    def to(self, dtype: torch.dtype, device: torch.device) -> "ModelWeights":
        def conv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        tied = self.lm_head is self.embed
        embed = conv(self.embed)
        return ModelWeights(
            embed=embed,
            layers=[
                LayerWeights(*(conv(getattr(layer, f)) for f in LayerWeights.__slots__))
                for layer in self.layers
            ],
            norm=conv(self.norm),
            lm_head=embed if tied else conv(self.lm_head),
            rope_inv_freq=self.rope_inv_freq,
        )


@dataclass(slots=True)
class Layer:
    """One decoder layer ready to run: its linears hold weights in the device's layout."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    o: Linear  # heads * head_dim -> hidden
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden

    @classmethod
    def build(cls, w: LayerWeights, backend: LinearBackend) -> "Layer":
        return cls(
            attn_norm=w.attn_norm,
            qkv=make_linear(w.qkv, w.qkv_bias, backend),
            o=make_linear(w.o, None, backend),
            mlp_norm=w.mlp_norm,
            gate_up=make_linear(w.gate_up, None, backend),
            down=make_linear(w.down, None, backend),
        )


class LlamaModel:
    """Runs mixed batches of prefill, decode and verify chunks against a slot KV cache.

    `linear_backend="torch"` keeps plain F.linear on CPU too: the reference for benchmarks.
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, kv_cache: KVCache,
                 linear_backend: LinearBackend = "auto"):
        self.config = config
        self.kv_cache = kv_cache
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self._layers = [Layer.build(w, linear_backend) for w in weights.layers]
        self._final_norm = weights.norm
        self._lm_head = make_linear(weights.lm_head, None, linear_backend)
        tied = weights.lm_head is weights.embed
        self._embed = self._lm_head if tied else DenseLinear(weights.embed, None)
        inv_freq = weights.rope_inv_freq if weights.rope_inv_freq is not None else rope_inv_freq(config)
        self.rope = RotaryEmbedding(inv_freq, kv_cache.max_len, self.dtype, self.device)
        self._q_size = config.num_heads * config.head_dim
        self._kv_size = config.num_kv_heads * config.head_dim

    @property
    def max_len(self) -> int:
        return self.kv_cache.max_len

    def build_batch(self, chunks: list[SequenceChunk]) -> ForwardBatch:
        for c in chunks:
            if c.end > self.max_len:
                raise ValueError(f"sequence would reach {c.end} tokens; the cache holds {self.max_len}")
        return ForwardBatch.build(chunks, self.config.queries_per_kv, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Returns float32 logits [num_logits, head_rows] at the positions the chunks asked for.

        head_rows is the vocabulary, or a drafter's reduced draft vocabulary.
        """
        return self.logits(self.final_hidden(batch))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, head_rows] of normed hidden states [rows, hidden]."""
        return self._lm_head(hidden).float()

    @torch.inference_mode()
    def final_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The normed last hidden state [num_logits, hidden] that the lm_head reads."""
        hidden = self._embed.rows(batch.input_ids)  # [T, hidden]
        for index, layer in enumerate(self._layers):
            hidden = self._layer(index, layer, hidden, batch)
        last = hidden[batch.logits_indices]  # [num_logits, hidden]
        return self._norm(last, self._final_norm)

    def run(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        return self.forward(self.build_batch(chunks))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        return F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype) * weight

    def _layer(self, index: int, w: Layer, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cfg = self.config
        num_tokens = hidden.shape[0]
        x = self._norm(hidden, w.attn_norm)
        qkv = w.qkv(x)  # [T, (heads + 2 * kv_heads) * head_dim]
        qk = qkv[:, : self._q_size + self._kv_size].view(num_tokens, -1, cfg.head_dim)
        qk = self.rope.apply(qk, batch.positions)  # [T, heads + kv_heads, head_dim]
        q = qk[:, : cfg.num_heads]
        k = qk[:, cfg.num_heads :]
        v = qkv[:, self._q_size + self._kv_size :].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        k_cache, v_cache = self.kv_cache.k[index], self.kv_cache.v[index]
        write_kv(k_cache, v_cache, k, v, batch.positions, batch.attn)
        attn = attend(q, k_cache, v_cache, batch.attn)  # [T, heads * head_dim]
        hidden = hidden + w.o(attn)
        x = self._norm(hidden, w.mlp_norm)
        gate, up = w.gate_up(x).chunk(2, dim=-1)
        return hidden + w.down(F.silu(gate) * up)


def build_model(
    config: ModelConfig,
    weights: ModelWeights,
    *,
    dtype: torch.dtype,
    device: torch.device,
    num_slots: int,
    max_model_len: int,
    linear_backend: LinearBackend = "auto",
) -> LlamaModel:
    weights = weights.to(dtype, device)
    cache = KVCache(config, num_slots=num_slots, max_len=max_model_len, dtype=dtype, device=device)
    return LlamaModel(config, weights, cache, linear_backend)
