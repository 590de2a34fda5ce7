"""Attention over the paged KV cache, read through each sequence's block table (kv_cache.py).

Grouped-query attention runs without repeating K/V: the G query heads that share a KV head
are folded into the query length, [kv_heads, G * T, head_dim], so one SDPA call covers them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.model.batch import AttentionMetadata


def write_kv(
    k_cache: torch.Tensor,  # [kv_heads, pool positions, head_dim]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    if meta.kv_start is not None:
        start = meta.kv_start + meta.context_len - k.shape[0]
        k_cache[:, start : meta.kv_start + meta.context_len] = k.transpose(0, 1)
        v_cache[:, start : meta.kv_start + meta.context_len] = v.transpose(0, 1)
    else:
        k_cache[:, meta.write_index] = k.transpose(0, 1)
        v_cache[:, meta.write_index] = v.transpose(0, 1)


def attend(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Returns [T, heads * head_dim]."""
    if meta.single:
        return _attend_single(q, k_cache, v_cache, meta)
    return _attend_batched(q, k_cache, v_cache, meta)


def _attend_single(q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group = num_heads // kv_heads
    # 4-D operands: 3-D ones send CPU SDPA down its unfused math path, 2x slower here.
    k = _rows_of_one(k_cache, meta).unsqueeze(0)  # [1, kv_heads, L, head_dim]
    v = _rows_of_one(v_cache, meta).unsqueeze(0)
    q = q.view(num_tokens, kv_heads, group, head_dim).permute(1, 2, 0, 3)
    q = q.reshape(1, kv_heads, group * num_tokens, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.mask)  # [1, kv_heads, G*T, head_dim]
    out = out.view(kv_heads, group, num_tokens, head_dim).permute(2, 0, 1, 3)
    return out.reshape(num_tokens, num_heads * head_dim)


def _rows_of_one(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[kv_heads, pool positions, head_dim] -> the sequence's [kv_heads, L, head_dim]."""
    if meta.kv_start is not None:
        return cache[:, meta.kv_start : meta.kv_start + meta.context_len]  # a view
    return cache.index_select(1, meta.kv_index)


def _attend_batched(q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[0]
    group = num_heads // kv_heads
    max_q = meta.max_query_len
    batch = meta.query_index.shape[0]
    k = _gather_rows(k_cache, meta)  # [B, kv_heads, L, head_dim]
    v = _gather_rows(v_cache, meta)
    qp = q[meta.query_index]  # [B, maxq, heads, head_dim]
    qp = qp.view(batch, max_q, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qp = qp.reshape(batch, kv_heads, group * max_q, head_dim)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=meta.mask)  # [B, kv_heads, G*maxq, D]
    out = out.view(batch, kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(batch * max_q, num_heads * head_dim)
    return out[meta.token_to_padded]


def _gather_rows(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[kv_heads, pool positions, head_dim] -> the batch's [B, kv_heads, L, head_dim]."""
    batch, length = meta.kv_index.shape
    rows = cache.index_select(1, meta.kv_index.view(-1))  # 4-5x faster than advanced indexing on CPU
    return rows.view(cache.shape[0], batch, length, cache.shape[2]).transpose(0, 1)
