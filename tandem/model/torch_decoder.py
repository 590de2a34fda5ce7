"""The PyTorch decoder: the reference the native CPU decoder is tested against, and the CUDA path."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.config import ModelConfig
from tandem.model.attention import attend, write_kv
from tandem.model.batch import ForwardBatch, SequenceChunk
from tandem.model.kv_cache import PAGE_SIZE, KVCache
from tandem.model.rope import RotaryEmbedding
from tandem.model.slot_attention import slot_attention
from tandem.model.static_steps import StaticStepRunner, UniformBatch


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
    """One forward pass = ~20 ATen calls per layer; GQA folds the query heads that share a KV head.

    With `static_steps`, decode and verify steps of uniform batches run through forward_uniform,
    replayed as CUDA graphs on CUDA (static_steps.py); prefills and mixed batches stay dynamic.
    """

    def __init__(self, config: ModelConfig, weights, kv_cache: KVCache, rope: RotaryEmbedding,
                 static_steps: bool = False):
        """weights: ModelWeights already on the device, in the compute dtype; static_steps needs a
        KV cache with a spare slot."""
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
        self.static_steps = StaticStepRunner(self, kv_cache) if static_steps else None

    def build_batch(self, chunks: list[SequenceChunk]) -> ForwardBatch | UniformBatch:
        if self.static_steps is not None and self.static_steps.accepts(chunks):
            return UniformBatch(chunks, len(chunks[0].token_ids))
        return ForwardBatch.build(chunks, self.config.queries_per_kv, self.kv_cache)

    def forward(self, batch: ForwardBatch | UniformBatch, want_hidden: bool = False,
                capture_layers: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As NativeDecoder.forward. A uniform step that captures runs the dynamic path."""
        if isinstance(batch, UniformBatch):
            if not want_hidden and not capture_layers:
                return self.static_steps.run(batch)
            batch = ForwardBatch.build(batch.chunks, self.config.queries_per_kv, self.kv_cache)
        hidden = F.embedding(batch.input_ids, self._embed)  # [T, hidden]
        captured = []
        for index, layer in enumerate(self._layers):
            if index in capture_layers:
                captured.append(hidden.float())
            hidden = self._layer(index, layer, hidden, batch)
        last = self._norm(hidden[batch.logits_indices], self._final_norm)  # [num_logits, hidden]
        result = last if want_hidden else self.logits(last)
        return (result, torch.stack(captured, dim=1)) if capture_layers else result  # [T, layers, hidden]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self._lm_head).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        return F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype) * weight

    def forward_uniform(
        self,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        slot_ids: torch.Tensor,  # [B]
    ) -> torch.Tensor:
        """float32 logits [B * T, head_rows] of B sequences with T new tokens each, at every token.

        Every shape follows from (B, T) alone, and nothing reads a tensor back to the host, so a
        CUDA graph of it replays for any positions and slots written into the same input tensors.
        """
        batch, num_new = input_ids.shape
        cfg = self.config
        flat_positions = positions.reshape(-1)  # [B*T]
        tables = self.kv_cache.block_tables
        pages = tables[slot_ids[:, None], positions // PAGE_SIZE].long()  # [B, T]
        pool_positions = (pages * PAGE_SIZE + positions % PAGE_SIZE).reshape(-1)  # [B*T]
        hidden = F.embedding(input_ids.reshape(-1), self._embed)  # [B*T, hidden]
        for index, layer in enumerate(self._layers):
            q, k, v = self._attention_inputs(layer, hidden, flat_positions)
            k_cache, v_cache = self.kv_cache.k[index], self.kv_cache.v[index]
            k_cache[:, pool_positions] = k.transpose(0, 1)
            v_cache[:, pool_positions] = v.transpose(0, 1)
            queries = q.view(batch, num_new, cfg.num_heads, cfg.head_dim)
            attn = slot_attention(queries, k_cache, v_cache, tables, slot_ids, positions)  # [B, T, heads, head_dim]
            hidden = self._layer_output(layer, hidden, attn.view(batch * num_new, -1))
        return self.logits(self._norm(hidden, self._final_norm))

    def _layer(self, index: int, w: _Layer, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self._attention_inputs(w, hidden, batch.positions)
        k_cache, v_cache = self.kv_cache.k[index], self.kv_cache.v[index]
        write_kv(k_cache, v_cache, k, v, batch.attn)
        attn = attend(q, k_cache, v_cache, batch.attn)  # [T, heads * head_dim]
        return self._layer_output(w, hidden, attn)

    def _attention_inputs(
        self, w: _Layer, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim] of hidden [T, hidden], q and k rotated."""
        cfg = self.config
        num_tokens = hidden.shape[0]
        x = self._norm(hidden, w.attn_norm)
        qkv = F.linear(x, w.qkv, w.qkv_bias)  # [T, (heads + 2 * kv_heads) * head_dim]
        qk = qkv[:, : self._q_size + self._kv_size].view(num_tokens, -1, cfg.head_dim)
        qk = self.rope.apply(qk, positions)  # [T, heads + kv_heads, head_dim]
        v = qkv[:, self._q_size + self._kv_size :].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        return qk[:, : cfg.num_heads], qk[:, cfg.num_heads :], v

    def _layer_output(self, w: _Layer, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after the O projection and the MLP; attn [T, heads * head_dim]."""
        hidden = hidden + F.linear(attn, w.o)
        x = self._norm(hidden, w.mlp_norm)
        gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, w.down)
