"""Presence, frequency and repetition penalties (vLLM's and OpenAI's definitions), one logits row each.

For a row whose position follows the tokens `seen` (prompt and output) of which `output` were
generated, and a token t with c = count of t in output:
- repetition r (t in seen): logit / r when the logit is positive, else logit * r;
- frequency f: minus f * c;
- presence p: minus p when c > 0.
Only the prompt counts toward repetition; presence and frequency count generated tokens alone.

The work is sparse: only the (row, token) pairs a row has seen change, so the caller lists them
once each (`penalty_entries`), and the kernel touches those entries alone, whatever the vocabulary.
Division is by a reciprocal computed once in PyTorch, and the kernel is compiled without fused
multiply-adds, so that it equals the reference bit for bit on every device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem_kernels._triton import jit, require_triton, tl
from tandem_kernels.checks import KernelInputError, check_tensor

BLOCK = 256


@dataclass(frozen=True, slots=True)
class PenaltyEntries:
    """The distinct (row, token) pairs that penalties change, each with its output count."""

    rows: torch.Tensor  # [U] int64: the logits row
    tokens: torch.Tensor  # [U] int64
    counts: torch.Tensor  # [U] int32: times the token was generated before the row (0: prompt only)


def penalty_entries(rows: torch.Tensor, tokens: torch.Tensor, generated: torch.Tensor, vocab: int) -> PenaltyEntries:
    """Each (row, token) of rows [N], tokens [N] once, counting the occurrences where generated [N] (bool)."""
    keys = rows * vocab + tokens  # [N]
    unique, inverse = torch.unique(keys, return_inverse=True)  # [U], [N]
    counts = torch.zeros(unique.shape[0], dtype=torch.int32, device=keys.device)
    counts.scatter_add_(0, inverse, generated.to(torch.int32))
    return PenaltyEntries(unique // vocab, unique % vocab, counts)


@dataclass(frozen=True, slots=True)
class RowPenalties:
    """Each logits row's penalties, [R] float32 each (0, 0 and 1 leave a row as it is)."""

    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor


def apply_penalties(logits: torch.Tensor, entries: PenaltyEntries, penalties: RowPenalties) -> None:
    """In place on logits [R, V] float32."""
    _check(logits, entries, penalties)
    if entries.rows.numel() == 0:
        return
    inverse = 1.0 / penalties.repetition  # [R]
    if logits.is_cuda:
        apply_penalties_triton(logits, entries, penalties, inverse)
    else:
        apply_penalties_reference(logits, entries, penalties, inverse)


def apply_penalties_reference(logits: torch.Tensor, entries: PenaltyEntries, penalties: RowPenalties,
                              inverse: torch.Tensor) -> None:
    """PyTorch reference of `apply_penalties`; inverse = 1 / repetition, [R]."""
    rows, tokens = entries.rows, entries.tokens
    logit = logits[rows, tokens]  # [U]
    scaled = logit * torch.where(logit > 0, inverse[rows], penalties.repetition[rows])
    counts = entries.counts.to(torch.float32)
    generated = (entries.counts > 0).to(torch.float32)
    logits[rows, tokens] = scaled - penalties.frequency[rows] * counts - penalties.presence[rows] * generated


def apply_penalties_triton(logits: torch.Tensor, entries: PenaltyEntries, penalties: RowPenalties,
                           inverse: torch.Tensor) -> None:
    """Launch `_penalty_kernel`, one program per BLOCK entries."""
    require_triton()
    num = entries.rows.shape[0]
    _penalty_kernel[(-(-num // BLOCK),)](
        logits, entries.rows, entries.tokens, entries.counts, penalties.presence, penalties.frequency,
        penalties.repetition, inverse, num, logits.shape[1], BLOCK=BLOCK, enable_fp_fusion=False)


@jit(do_not_specialize=["num", "vocab"])
def _penalty_kernel(logits_ptr, rows_ptr, tokens_ptr, counts_ptr, presence_ptr, frequency_ptr, repetition_ptr,
                    inverse_ptr, num, vocab, BLOCK: tl.constexpr):
    """logits[row, token] of each entry, penalized as the reference does, in the same order of operations."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < num
    row = tl.load(rows_ptr + offs, mask=inside, other=0)
    token = tl.load(tokens_ptr + offs, mask=inside, other=0)
    count = tl.load(counts_ptr + offs, mask=inside, other=0)
    where = logits_ptr + row * vocab + token
    logit = tl.load(where, mask=inside, other=0.0)
    scale = tl.where(logit > 0, tl.load(inverse_ptr + row, mask=inside, other=1.0),
                     tl.load(repetition_ptr + row, mask=inside, other=1.0))
    scaled = logit * scale
    frequency = tl.load(frequency_ptr + row, mask=inside, other=0.0) * count.to(tl.float32)
    presence = tl.load(presence_ptr + row, mask=inside, other=0.0) * (count > 0).to(tl.float32)
    tl.store(where, scaled - frequency - presence, mask=inside)


def _check(logits: torch.Tensor, entries: PenaltyEntries, penalties: RowPenalties) -> None:
    device = logits.device
    check_tensor("logits", logits, torch.float32, (None, None), device)
    batch, num = logits.shape[0], entries.rows.shape[0]
    check_tensor("entries.rows", entries.rows, torch.int64, (num,), device)
    check_tensor("entries.tokens", entries.tokens, torch.int64, (num,), device)
    check_tensor("entries.counts", entries.counts, torch.int32, (num,), device)
    for name in ("presence", "frequency", "repetition"):
        check_tensor(name, getattr(penalties, name), torch.float32, (batch,), device)
    if not bool((penalties.repetition > 0).all()):
        raise KernelInputError("repetition: must be > 0")
