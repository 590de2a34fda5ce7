"""One forward call's batch: prefill chunks, decode steps and draft verification, mixed."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.model.kv_cache import KVCache

# Chunked prefill, on both services: the tokens one step (a target step, a drafter's catch-up
# forward) runs at most by default, and the prompt tokens it runs at the least. 512 is vLLM's
# first chunked-prefill default; on CPUs a step of 2048 prompt tokens takes seconds.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
MIN_PREFILL_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SequenceChunk:
    """New tokens of one sequence, written to its KV slot from position `start` on."""

    slot: int
    start: int
    token_ids: list[int]
    num_logits: int = 1  # logits for this many trailing positions: 1 to decode, k+1 to verify

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(slots=True)
class AttentionMetadata:
    """Index tensors that every layer's attention shares, built once per forward.

    Keys and values are read and written at pool positions (kv_cache.py): a slot's position p
    sits at block_tables[slot, p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE.
    """

    single: bool  # the batch holds one sequence
    context_len: int  # the longest context in the batch
    max_query_len: int
    mask: torch.Tensor | None  # [G*T, L] single, [B, 1, G*maxq, maxL] batched; None = all visible
    kv_start: int | None  # single, keys [0, L) one run of the pool from here: K/V are views, no gathers
    kv_index: torch.Tensor | None  # otherwise the pool position of each key: [L] single, [B, maxL] batched
    write_index: torch.Tensor | None  # [T]: the pool position of each new token; None when kv_start is set
    query_index: torch.Tensor | None  # [B, maxq] -> token index (padding points at a real token)
    token_to_padded: torch.Tensor | None  # [T] -> flat index into [B * maxq]


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    logits_indices: torch.Tensor  # [num_logits]
    attn: AttentionMetadata
    num_tokens: int

    @classmethod
    def build(cls, chunks: list[SequenceChunk], queries_per_kv: int, kv_cache: KVCache) -> "ForwardBatch":
        """Chunks as LlamaModel.build_batch validated them, their blocks reserved."""
        ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        for c in chunks:
            ids.extend(c.token_ids)
            positions.extend(range(c.start, c.end))
            logits_indices.extend(range(len(ids) - c.num_logits, len(ids)))
        attn = (
            _single_metadata(chunks[0], queries_per_kv, kv_cache)
            if len(chunks) == 1
            else _batched_metadata(chunks, queries_per_kv, kv_cache)
        )
        device = kv_cache.block_tables.device
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
            attn=attn,
            num_tokens=len(ids),
        )


def _causal_mask(query_positions: torch.Tensor, context_len: int) -> torch.Tensor:
    """[..., q] positions -> [..., q, context_len] bool: a query sees keys at or before it."""
    keys = torch.arange(context_len, device=query_positions.device)
    return keys <= query_positions.unsqueeze(-1)


def _single_metadata(chunk: SequenceChunk, queries_per_kv: int, kv_cache: KVCache) -> AttentionMetadata:
    device = kv_cache.block_tables.device
    num_new = len(chunk.token_ids)
    mask = None
    if num_new > 1:
        positions = torch.arange(chunk.start, chunk.end, device=device)
        mask = _causal_mask(positions, chunk.end).repeat(queries_per_kv, 1)  # [G*T, L]
    kv_start = kv_cache.contiguous_start(chunk.slot, chunk.end)
    kv_index = write_index = None
    if kv_start is None:
        kv_index = kv_cache.pool_index([chunk.slot], chunk.end)[0]  # [L]
        write_index = kv_index[chunk.start :]
    return AttentionMetadata(
        single=True,
        context_len=chunk.end,
        max_query_len=num_new,
        mask=mask,
        kv_start=kv_start,
        kv_index=kv_index,
        write_index=write_index,
        query_index=None,
        token_to_padded=None,
    )


def _batched_metadata(chunks: list[SequenceChunk], queries_per_kv: int, kv_cache: KVCache) -> AttentionMetadata:
    max_q = max(len(c.token_ids) for c in chunks)
    context_len = max(c.end for c in chunks)
    query_index = torch.zeros(len(chunks), max_q, dtype=torch.long)
    query_pos = torch.zeros(len(chunks), max_q, dtype=torch.long)  # padding sees key 0 only
    token_to_padded: list[int] = []
    offset = 0
    for b, c in enumerate(chunks):
        n = len(c.token_ids)
        query_index[b, :n] = torch.arange(offset, offset + n)
        query_index[b, n:] = offset
        query_pos[b, :n] = torch.arange(c.start, c.end)
        token_to_padded.extend(range(b * max_q, b * max_q + n))
        offset += n
    device = kv_cache.block_tables.device
    # Keys past a chunk's end read whatever their table entries point at: they are masked.
    kv_index = kv_cache.pool_index([c.slot for c in chunks], context_len)  # [B, L]
    query_pos = query_pos.to(device)
    padded = torch.tensor(token_to_padded, dtype=torch.long, device=device)  # [T]
    mask = _causal_mask(query_pos, context_len)  # [B, maxq, L]
    mask = mask.repeat(1, queries_per_kv, 1).unsqueeze(1)  # [B, 1, G*maxq, L]
    return AttentionMetadata(
        single=False,
        context_len=context_len,
        max_query_len=max_q,
        mask=mask,
        kv_start=None,
        kv_index=kv_index,
        write_index=kv_index[padded // max_q, query_pos.view(-1)[padded]],  # [T]: each new token's pool position
        query_index=query_index.to(device),
        token_to_padded=padded,
    )

