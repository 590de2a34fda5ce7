"""Token bitmasks of constrained decoding: bit t of a row allows token t; logits of the others become -inf.

A row of the bitmask is int32 [ceil(V / 32)], token t at bit t % 32 of word t // 32, the layout that
llguidance and xgrammar fill. Only the constrained rows of a batch are masked, named by `rows`.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from tandem_kernels._triton import jit, next_power_of_2, require_triton, tl

BLOCK_V = 1024


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [R, W] int32 as bool [R, vocab_size]; tokens past 32 * W are not allowed."""
    if bitmask.device.type == "cpu" and sys.byteorder == "little":  # numpy unpacks 3-4x faster than shifts
        unpacked = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(unpacked.view(np.bool_))  # [R, 32 * W]
    else:
        bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)  # [R, 32 * W]
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])], dim=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is clear. logits [N, V], bitmask [R, W], rows [R]."""
    if rows.numel() == 0:
        return
    if logits.is_cuda:
        apply_token_bitmask_triton(logits, bitmask, rows)
    else:
        apply_token_bitmask_reference(logits, bitmask, rows)


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    apply_forbidden(logits, ~allowed_tokens(bitmask, logits.shape[1]).to(logits.device), rows.tolist())


def apply_forbidden(logits: torch.Tensor, forbidden: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[i], t] = -inf where forbidden[i, t]; forbidden [R, V] bool.

    Row by row: a step masks few rows, and gathering them would copy each twice. The CPU target
    unpacks `forbidden` on its mask thread during the forward pass, leaving only this after it."""
    for i, row in enumerate(rows):
        logits[row].masked_fill_(forbidden[i], float("-inf"))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Launch `_bitmask_kernel`: one program per (masked row, block of the vocabulary)."""
    require_triton()
    vocab = logits.shape[1]
    block = min(BLOCK_V, next_power_of_2(vocab))
    bitmask = bitmask.to(logits.device, non_blocking=True).contiguous()
    rows = rows.to(logits.device, torch.int64)
    grid = (rows.shape[0], -(-vocab // block))
    _bitmask_kernel[grid](logits, logits.stride(0), bitmask, bitmask.shape[1], rows, vocab, BLOCK=block)


@jit()
def _bitmask_kernel(logits_ptr, logits_stride, bitmask_ptr, words, rows_ptr, vocab, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    row = tl.load(rows_ptr + r)
    word = tl.load(bitmask_ptr + r * words + tokens // 32, mask=in_vocab & (tokens // 32 < words), other=0)
    allowed = ((word >> (tokens % 32)) & 1) != 0
    tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"), mask=in_vocab & ~allowed)
