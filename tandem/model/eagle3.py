"""An EAGLE-3 draft head: one decoder layer that reads the target's features beside each token.

The row for the token at position p reads that token's embedding and a feature of position p - 1:
the target's own (its residual stream entering a low, a middle and a high layer, fused by `fc`)
where the target has sent it, else the head's own output at p - 1, as EAGLE does past the last
committed token. The two halves are normed apart and concatenated, so the attention projections
take 2 * hidden inputs; the residual stream starts from the feature. The row's output hidden state
is the predicted feature of position p, and its normed projection on the reduced draft vocabulary
gives the logits of the token at p + 1.

Per KV slot the head keeps the feature of every position it holds (`FeatureCache.features`): the
target's, fused, where known, else the predicted one. `exact_rows` counts the slot's leading rows
that were computed from target features only; a drafter recomputes the rest once the target's
features for them arrive.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.config import ModelConfig
from tandem.model.attention import attend, write_kv
from tandem.model.batch import ForwardBatch, SequenceChunk
from tandem.model.kv_cache import KVCache
from tandem.model.rope import RotaryEmbedding, rope_inv_freq


def default_feature_layers(target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers of a target, as vLLM and SGLang pick them."""
    return tuple(sorted({min(2, target_layers - 1), target_layers // 2, max(0, target_layers - 3)}))


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    layer: ModelConfig  # the draft layer's shapes (num_layers 1); vocab_size is the target's
    target_hidden_size: int
    feature_layers: tuple[int, ...]  # target layers whose input residual stream it reads, ascending
    draft_vocab_size: int


@dataclass(slots=True)
class Eagle3Weights:
    fc: torch.Tensor  # [hidden, len(feature_layers) * target_hidden]
    embed: torch.Tensor  # [vocab, hidden]
    input_norm: torch.Tensor  # [hidden], on the embedding
    hidden_norm: torch.Tensor  # [hidden], on the feature
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, 2 * hidden]
    o: torch.Tensor  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [draft_vocab, hidden]
    draft_ids: torch.Tensor  # [draft_vocab] int64: the target token of each head row

    def to(self, dtype: torch.dtype, device: torch.device) -> "Eagle3Weights":
        moved = {name: getattr(self, name).to(device=device, dtype=dtype).contiguous()
                 for name in self.__slots__ if name != "draft_ids"}
        return Eagle3Weights(**moved, draft_ids=self.draft_ids.to(device))


class FeatureCache(KVCache):
    """The head's KV slots, and per slot the feature of every position (copied along with K and V).
    A freed slot keeps its features with its KV, for the drafter's prefix cache; its next owner's
    catch-up reloads them past the prefix it shares."""

    def __init__(self, config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(config, num_slots, max_len, dtype, device)
        self.features = torch.zeros(num_slots, max_len, config.hidden_size, dtype=dtype, device=device)
        self.target_len = [0] * num_slots  # positions [0, target_len) hold the target's features
        self.exact_rows = [0] * num_slots  # leading rows computed from the target's features only

    def copy_positions(self, source: int, dest: int, start: int, end: int) -> None:
        super().copy_positions(source, dest, start, end)
        self.features[dest, start:end] = self.features[source, start:end]
        self.target_len[dest] = _joined(self.target_len[dest], self.target_len[source], start, end)
        self.exact_rows[dest] = _joined(self.exact_rows[dest], self.exact_rows[source], start, end)


def _joined(dest_len: int, source_len: int, start: int, end: int) -> int:
    """The leading run of positions in dest after positions [start, end) were copied in from source:
    dest's own up to start, if unbroken there, then the source's as far as its run reaches inside the copy."""
    return max(start, min(source_len, end)) if dest_len >= start else dest_len


class Eagle3Model:
    """Runs the head over mixed chunks of its slots, as LlamaModel runs a model (ModelDrafter drives both)."""

    def __init__(self, config: Eagle3Config, weights: Eagle3Weights, *, dtype: torch.dtype,
                 device: torch.device | str, num_slots: int, max_model_len: int):
        device = torch.device(device)
        self.config = config.layer
        self.eagle = config
        self.device = device
        self.dtype = dtype
        self.w = weights.to(dtype, device)
        self.kv_cache = FeatureCache(config.layer, num_slots, max_model_len, dtype, device)
        self.rope = RotaryEmbedding(rope_inv_freq(config.layer), max_model_len, dtype, device)
        self.draft_vocab = self.w.draft_ids

    @property
    def max_len(self) -> int:
        return self.kv_cache.max_len

    @torch.inference_mode()
    def load_features(self, slot: int, first: int, rows: torch.Tensor) -> None:
        """The target's features [R, layers, target_hidden] of positions first.., fused into the slot.

        Rows computed from features that these replace are no longer exact."""
        cache = self.kv_cache
        if first > cache.target_len[slot]:
            raise ValueError(f"features from position {first} would leave a gap after {cache.target_len[slot]}")
        end = first + len(rows)
        fused = F.linear(rows.flatten(1).to(self.dtype), self.w.fc)  # [R, hidden]; R may be 0
        cache.features[slot, first:end] = fused
        cache.target_len[slot] = end
        cache.exact_rows[slot] = min(cache.exact_rows[slot], first + 1)

    def run(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        """float32 logits [num_logits, draft_vocab] at the positions the chunks ask for."""
        for c in chunks:
            if not c.token_ids or c.end > self.max_len:
                raise ValueError(f"a chunk of {len(c.token_ids)} tokens ending at {c.end}: the head holds "
                                 f"{self.max_len} positions")
        for c in chunks:
            self.kv_cache.reserve(c.slot, c.end)
        return self._forward(chunks)

    @torch.inference_mode()
    def _forward(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        cfg, w, cache = self.config, self.w, self.kv_cache
        batch = ForwardBatch.build(chunks, cfg.queries_per_kv, cache)
        slots = torch.tensor([c.slot for c in chunks for _ in c.token_ids], device=self.device)  # [T]
        previous = (batch.positions - 1).clamp_min(0)  # [T]
        feature = cache.features[slots, previous]  # [T, hidden]
        feature = feature * (batch.positions > 0).unsqueeze(1).to(feature.dtype)
        embedded = F.embedding(batch.input_ids, w.embed)  # [T, hidden]
        x = torch.cat([self._norm(embedded, w.input_norm), self._norm(feature, w.hidden_norm)], dim=1)
        qkv = F.linear(x, w.qkv)  # [T, (heads + 2 * kv_heads) * head_dim]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qk = self.rope.apply(qkv[:, : q_size + kv_size].view(len(slots), -1, cfg.head_dim), batch.positions)
        v = qkv[:, q_size + kv_size :].view(len(slots), cfg.num_kv_heads, cfg.head_dim)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        write_kv(cache.k[0], cache.v[0], k, v, batch.attn)
        hidden = feature + F.linear(attend(q, cache.k[0], cache.v[0], batch.attn), w.o)
        gate, up = F.linear(self._norm(hidden, w.post_norm), w.gate_up).chunk(2, dim=-1)
        hidden = hidden + F.linear(F.silu(gate) * up, w.down)  # [T, hidden]: the predicted features
        self._keep_predicted(chunks, slots, batch.positions, hidden)
        return F.linear(self._norm(hidden[batch.logits_indices], w.norm), w.lm_head).float()

    def _keep_predicted(self, chunks: list[SequenceChunk], slots: torch.Tensor, positions: torch.Tensor,
                        hidden: torch.Tensor) -> None:
        """Predicted features go where the target's are not known; exact_rows grows over rows that read
        the target's features only."""
        cache = self.kv_cache
        target_len = torch.tensor(cache.target_len, device=self.device)[slots]  # [T]
        predicted = positions >= target_len
        cache.features[slots[predicted], positions[predicted]] = hidden[predicted]
        for c in chunks:
            if c.start <= cache.exact_rows[c.slot]:
                cache.exact_rows[c.slot] = min(c.end, cache.target_len[c.slot] + 1)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), weight.shape, None, self.config.rms_norm_eps).to(x.dtype) * weight
