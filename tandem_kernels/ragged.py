"""The flattened ragged batch that verification works on, and its output.

Request b has k_b >= 0 drafts, flattened in request order. `cu_num_draft_tokens[b]` is the
inclusive cumulative count (as in vLLM), so request b owns drafts [cu[b-1], cu[b]) and target
rows [cu[b-1] + b, cu[b] + b]: one row per draft position plus the bonus position. positions[b]
is the absolute sequence position of the first token the request emits (that of its first draft),
so row j is keyed by positions[b] + j, and a seeded request gets the same tokens in any batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem_kernels.checks import KernelInputError, check_tensor


@dataclass(frozen=True)
class VerifyResult:
    """tokens [B, max_k + 1] int64 (accepted drafts then the recovered or bonus token, -1 after);
    num_accepted [B] int32."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor


@dataclass(frozen=True)
class RaggedLayout:
    """Index maps of a flattened ragged batch, all int64 on the batch's device."""

    num_drafts: torch.Tensor  # [B] k_b
    starts: torch.Tensor  # [B] index of the request's first draft
    request: torch.Tensor  # [D] request of each draft
    local: torch.Tensor  # [D] j, the draft's index within its request
    rows: torch.Tensor  # [D] target row of each draft
    max_drafts: int


def num_drafts_per_request(cu_num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """k_b [B] from the inclusive cumulative counts."""
    return torch.diff(cu_num_draft_tokens, prepend=cu_num_draft_tokens.new_zeros(1))


def empty_verify_result(cu_num_draft_tokens: torch.Tensor) -> VerifyResult:
    """The outputs a verification kernel fills: tokens [B, max_k + 1] at -1, num_accepted [B]."""
    batch, device = cu_num_draft_tokens.shape[0], cu_num_draft_tokens.device
    max_drafts = int(num_drafts_per_request(cu_num_draft_tokens).max()) if batch else 0
    tokens = torch.full((batch, max_drafts + 1), -1, dtype=torch.int64, device=device)
    return VerifyResult(tokens, torch.empty(batch, dtype=torch.int32, device=device))


def launch_per_request(kernel, verify: VerifyBatch, between: tuple = (), after: tuple = (), **meta) -> VerifyResult:
    """Run a verification Triton kernel, one program per request. Its arguments: the outputs (tokens,
    num_accepted), target_probs, draft_tokens, cu_num_draft_tokens, `between`, seeds, positions, the
    vocabulary, the outputs' row stride, `after`; `meta`: its constexprs."""
    result = empty_verify_result(verify.cu_num_draft_tokens)
    batch = verify.cu_num_draft_tokens.shape[0]
    if batch:
        kernel[(batch,)](
            result.tokens, result.num_accepted, verify.target_probs, verify.draft_tokens, verify.cu_num_draft_tokens,
            *between, verify.seeds, verify.positions, verify.vocab, result.tokens.shape[1], *after, **meta,
        )  # fmt: skip
    return result


def ragged_layout(cu_num_draft_tokens: torch.Tensor) -> RaggedLayout:
    """Index maps for requests owning drafts [cu[b-1], cu[b]) and target rows shifted by b."""
    cu = cu_num_draft_tokens
    num_drafts = num_drafts_per_request(cu)
    starts = cu - num_drafts
    request = torch.repeat_interleave(torch.arange(cu.shape[0], device=cu.device), num_drafts)
    draft_index = torch.arange(request.shape[0], device=cu.device)
    max_drafts = int(num_drafts.max()) if cu.shape[0] else 0
    return RaggedLayout(num_drafts, starts, request, draft_index - starts[request], draft_index + request, max_drafts)


def num_leading(flags: torch.Tensor, layout: RaggedLayout) -> torch.Tensor:
    """Per request [B], how many of its leading per-draft flags [D] are true."""
    batch = layout.num_drafts.shape[0]
    padded = torch.ones(batch, layout.max_drafts, dtype=torch.int64, device=flags.device)
    padded[layout.request, layout.local] = flags.to(torch.int64)
    return torch.minimum(padded.cumprod(dim=1).sum(dim=1), layout.num_drafts)


@dataclass(frozen=True, slots=True)
class VerifyBatch:
    """What every verification kernel reads: the target's rows and the drafts of B requests."""

    target_probs: torch.Tensor  # [T, V] float32, T = D + B: a row per draft, then the bonus row
    draft_tokens: torch.Tensor  # [D] int64
    cu_num_draft_tokens: torch.Tensor  # [B] int64, inclusive cumulative drafts per request
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64, the position of each request's first verified row

    @property
    def vocab(self) -> int:
        return self.target_probs.shape[1]

    def check(self) -> None:
        """Shapes, dtypes and consistency, and draft ids inside the vocabulary."""
        device = self.target_probs.device
        check_tensor("target_probs", self.target_probs, torch.float32, (None, None), device)
        check_tensor("cu_num_draft_tokens", self.cu_num_draft_tokens, torch.int64, (None,), device)
        if bool((num_drafts_per_request(self.cu_num_draft_tokens) < 0).any()):
            raise KernelInputError("cu_num_draft_tokens: must be non-decreasing from >= 0")
        batch, (num_tokens, vocab) = self.cu_num_draft_tokens.shape[0], self.target_probs.shape
        num_draft = int(self.cu_num_draft_tokens[-1]) if batch else 0
        check_tensor("draft_tokens", self.draft_tokens, torch.int64, (num_draft,), device)
        check_tensor("seeds", self.seeds, torch.int64, (batch,), device)
        check_tensor("positions", self.positions, torch.int64, (batch,), device)
        if num_tokens != num_draft + batch:
            raise KernelInputError(
                f"target_probs: expected {num_draft + batch} rows (drafts + one per request), got {num_tokens}"
            )
        if vocab == 0:
            raise KernelInputError("target_probs: the vocabulary is empty")
        if bool(((self.draft_tokens < 0) | (self.draft_tokens >= vocab)).any()):
            raise KernelInputError(f"draft_tokens: ids must be in [0, {vocab})")


def emit_tokens(
    draft_tokens: torch.Tensor, layout: RaggedLayout, num_accepted: torch.Tensor, last: torch.Tensor
) -> VerifyResult:
    """Lay out accepted drafts, then the last token, padded with -1."""
    batch = num_accepted.shape[0]
    tokens = torch.full((batch, layout.max_drafts + 1), -1, dtype=torch.int64, device=last.device)
    keep = layout.local < num_accepted[layout.request]
    tokens[layout.request[keep], layout.local[keep]] = draft_tokens[keep]
    tokens[torch.arange(batch, device=last.device), num_accepted] = last
    return VerifyResult(tokens, num_accepted.to(torch.int32))
