"""Lossless rejection sampling of drafts against the target, over a flattened ragged batch.

Terms (as in vLLM's rejection sampler):
- accepted tokens: the leading drafts that pass verification;
- recovered token: the token emitted in place of the first rejected draft;
- bonus token: the token emitted after all k drafts were accepted.
Each request emits num_accepted + 1 tokens: its accepted drafts, then one recovered or bonus token.

The batch layout (cu_num_draft_tokens, positions) is described in `tandem_kernels.ragged`.

Rules (docs/design/lossless.md), with p the target row and q' the compressed draft distribution:
- greedy: accept while d == argmax p; then emit argmax p.
- random: accept d when u < p(d) / q'(d), with u keyed by ACCEPT_SALT (tested as u * q'(d) < p(d),
  exact in float64). On the first rejection, emit a draw from max(0, p - q') (TARGET_SALT race,
  q' sparse); if that is zero everywhere in float32, from p. After k acceptances, emit a draw
  from p. A draft with q'(d) = 0 could not have been drawn from q', so it is rejected and the
  token is drawn from p. Whatever a drafter sends, no token outside the support of p is emitted.
"""
from __future__ import annotations

import torch

from tandem_kernels._triton import constexpr, jit, next_power_of_2, require_triton, tl
from tandem_kernels.checks import check_tensor
from tandem_kernels.compression import ONE, CompressedProbs, decode, to_dense
from tandem_kernels.random import TARGET_SALT, TARGET_SALT_C, accept_uniforms, race_weights, tl_accept_uniform, tl_race_weights
from tandem_kernels.ragged import (
    RaggedLayout,
    VerifyBatch,
    VerifyResult,
    emit_tokens,
    launch_per_request,
    num_leading,
    ragged_layout,
)
from tandem_kernels.sampling import BLOCK_V, tl_argmax

BLOCK_K = 16
_INV_ONE = constexpr(1.0 / ONE)


def rejection_sample(verify: VerifyBatch, draft_probs: CompressedProbs, is_greedy: torch.Tensor) -> VerifyResult:
    """Verify the batch's drafts against q' [D, K]; is_greedy [B]: rows of greedy requests in q' are ignored."""
    verify.check()
    device, num_draft = verify.target_probs.device, verify.draft_tokens.shape[0]
    check_tensor("draft_probs.ids", draft_probs.ids, torch.int32, (num_draft, None), device)
    check_tensor("draft_probs.fixed", draft_probs.fixed, torch.uint16, (num_draft, draft_probs.k), device)
    check_tensor("is_greedy", is_greedy, torch.bool, (verify.cu_num_draft_tokens.shape[0],), device)
    if verify.target_probs.is_cuda:
        return rejection_sample_triton(verify, draft_probs, is_greedy)
    return rejection_sample_reference(verify, draft_probs, is_greedy)


def rejection_sample_reference(verify: VerifyBatch, draft_probs: CompressedProbs, is_greedy: torch.Tensor
                               ) -> VerifyResult:
    """PyTorch reference of `rejection_sample`, vectorized over the whole batch."""
    target_probs, draft_tokens, seeds, positions = verify.target_probs, verify.draft_tokens, verify.seeds, verify.positions
    layout = ragged_layout(verify.cu_num_draft_tokens)
    batch, vocab = verify.cu_num_draft_tokens.shape[0], verify.vocab
    q_draft = (decode(draft_probs) * (draft_probs.ids == draft_tokens[:, None])).sum(dim=1)  # [D] q'(d)
    accepted = _accepted(verify, q_draft, layout, is_greedy)
    num_accepted = num_leading(accepted, layout)  # [B]
    requests = torch.arange(batch, device=target_probs.device)
    p = target_probs[layout.starts + requests + num_accepted]  # [B, V] row of the last emitted token
    draft_index = layout.starts + num_accepted  # [B] the rejected draft, or one past the request's last
    q_rejected = torch.cat([q_draft, q_draft.new_zeros(1)])[draft_index]  # [B] 0 when none was rejected
    residual = ~is_greedy & (num_accepted < layout.num_drafts) & (q_rejected > 0)
    last = p.argmax(dim=1)  # [B]; the draw below replaces it for sampled requests
    sampled = (~is_greedy).nonzero().squeeze(1)  # the full-vocabulary race only where it is needed
    if sampled.numel():
        q = _rejected_q(draft_probs, draft_index[sampled], residual[sampled], vocab)  # [S, V]
        index = torch.arange(vocab, device=p.device)
        weights = race_weights(seeds[sampled], (positions + num_accepted)[sampled], TARGET_SALT, index)
        key_p = p[sampled] * weights
        key_r = (p[sampled] - q).clamp(min=0) * weights
        last[sampled] = torch.where(key_r.max(dim=1).values > 0, key_r.argmax(dim=1), key_p.argmax(dim=1))
    return emit_tokens(draft_tokens, layout, num_accepted, last)


def _accepted(verify: VerifyBatch, q_draft: torch.Tensor, layout: RaggedLayout, is_greedy: torch.Tensor) -> torch.Tensor:
    """Whether each draft [D] passes its own test, ignoring earlier rejections."""
    target_probs, draft_tokens, seeds, positions = verify.target_probs, verify.draft_tokens, verify.seeds, verify.positions
    greedy_ok = draft_tokens == target_probs.argmax(dim=1)[layout.rows]
    p_draft = target_probs[layout.rows, draft_tokens].to(torch.float64)  # [D] p(d)
    u = accept_uniforms(seeds[layout.request], positions[layout.request] + layout.local)
    random_ok = (q_draft > 0) & (u * q_draft.to(torch.float64) < p_draft)
    return torch.where(is_greedy[layout.request], greedy_ok, random_ok)


def _rejected_q(
    draft_probs: CompressedProbs, draft_index: torch.Tensor, keep: torch.Tensor, vocab: int
) -> torch.Tensor:
    """Dense q' [B, V] of draft draft_index[b] where keep[b], zeros elsewhere."""
    if draft_probs.num_tokens == 0:
        return torch.zeros(keep.shape[0], vocab, device=keep.device)
    draft_index = draft_index.clamp(max=draft_probs.num_tokens - 1)
    rows = CompressedProbs(draft_probs.ids[draft_index], draft_probs.fixed[draft_index])
    return to_dense(rows, vocab) * keep[:, None]


def rejection_sample_triton(verify: VerifyBatch, draft_probs: CompressedProbs, is_greedy: torch.Tensor
                            ) -> VerifyResult:
    """Launch `_rejection_kernel`, one program per request."""
    require_triton()
    return launch_per_request(_rejection_kernel, verify, (draft_probs.ids, draft_probs.fixed, is_greedy),
                              (draft_probs.k,), BLOCK=min(BLOCK_V, next_power_of_2(verify.vocab)), BLOCK_K=BLOCK_K)


@jit(do_not_specialize=["vocab", "out_stride", "num_entries"])
def _rejection_kernel(
    tokens_ptr, num_accepted_ptr, probs_ptr, draft_ptr, cu_ptr, q_ids_ptr, q_fixed_ptr,
    greedy_ptr, seeds_ptr, positions_ptr, vocab, out_stride, num_entries,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One request: accept drafts in order, then emit the recovered or bonus token."""
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b - 1, mask=b > 0, other=0)
    num_drafts = (tl.load(cu_ptr + b) - start).to(tl.int32)
    greedy = tl.load(greedy_ptr + b) != 0
    seed = tl.load(seeds_ptr + b)
    position = tl.load(positions_ptr + b)
    out_ptr = tokens_ptr + b.to(tl.int64) * out_stride
    num_accepted = tl.full((), 0, tl.int32)
    rejected = tl.full((), 0, tl.int32)
    for j in range(0, num_drafts):
        if rejected == 0:
            draft = tl.load(draft_ptr + start + j)
            row_ptr = probs_ptr + (start + b + j) * vocab
            if greedy:
                ok = draft == tl_argmax(row_ptr, vocab, BLOCK)
            else:
                entries = (start + j) * num_entries
                q = tl_lookup(q_ids_ptr + entries, q_fixed_ptr + entries, num_entries, draft, BLOCK_K)
                u = tl_accept_uniform(seed, position + j)
                ok = (q > 0) & (u * q.to(tl.float64) < tl.load(row_ptr + draft).to(tl.float64))
            if ok:
                tl.store(out_ptr + j, draft)
                num_accepted += 1
            else:
                rejected = 1
    row_ptr = probs_ptr + (start + b + num_accepted) * vocab
    if greedy:
        last = tl_argmax(row_ptr, vocab, BLOCK)
    else:
        entries = (start + num_accepted) * num_entries
        draft = tl.load(draft_ptr + start + num_accepted, mask=rejected != 0, other=0)
        q = tl_lookup(q_ids_ptr + entries, q_fixed_ptr + entries, num_entries * rejected, draft, BLOCK_K)
        residual_entries = tl.where(q > 0, num_entries, 0)
        last = tl_residual_race(
            row_ptr, vocab, seed, position + num_accepted,
            q_ids_ptr + entries, q_fixed_ptr + entries, residual_entries, BLOCK, BLOCK_K,
        )  # fmt: skip
    tl.store(out_ptr + num_accepted, last.to(tl.int64))
    tl.store(num_accepted_ptr + b, num_accepted)


@jit()
def tl_lookup(ids_ptr, fixed_ptr, num_entries, token, BLOCK_K: tl.constexpr):
    """q'(token) from one row of sparse entries (0.0 when absent), exact float32."""
    total = tl.full((), 0, tl.int32)
    for s in range(0, num_entries, BLOCK_K):
        e = s + tl.arange(0, BLOCK_K)
        inside = e < num_entries
        ids = tl.load(ids_ptr + e, mask=inside, other=-1)
        fixed = tl.load(fixed_ptr + e, mask=inside, other=0).to(tl.int32)
        total += tl.sum(tl.where(ids == token, fixed, 0), 0)
    return total.to(tl.float32) * _INV_ONE


@jit()
def tl_residual_race(
    row_ptr, vocab, seed, position, ids_ptr, fixed_ptr, num_entries,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Draw from max(0, p - q') by a TARGET_SALT race, or from p if that is all zero."""
    best_p = tl.full((), -1.0, tl.float32)
    best_r = tl.full((), -1.0, tl.float32)
    index_p = tl.full((), 0, tl.int32)
    index_r = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        p = tl.load(row_ptr + offs, mask=inside, other=0.0)
        q = tl_dense_block(ids_ptr, fixed_ptr, num_entries, offs, BLOCK, BLOCK_K)
        weights = tl_race_weights(seed, position, TARGET_SALT_C, offs.to(tl.uint32))
        key_p = tl.where(inside, p * weights, -1.0)
        key_r = tl.where(inside, tl.maximum(p - q, 0.0) * weights, -1.0)
        block_p, block_index_p = tl.max(key_p, 0, return_indices=True, return_indices_tie_break_left=True)
        block_r, block_index_r = tl.max(key_r, 0, return_indices=True, return_indices_tie_break_left=True)
        index_p = tl.where(block_p > best_p, start + block_index_p, index_p)
        best_p = tl.maximum(block_p, best_p)
        index_r = tl.where(block_r > best_r, start + block_index_r, index_r)
        best_r = tl.maximum(block_r, best_r)
    return tl.where(best_r > 0, index_r, index_p)


@jit()
def tl_dense_block(ids_ptr, fixed_ptr, num_entries, offs, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """q' over the vocabulary block offs [BLOCK] from sparse entries, exact float32."""
    total = tl.zeros((BLOCK,), tl.int32)
    for s in range(0, num_entries, BLOCK_K):
        e = s + tl.arange(0, BLOCK_K)
        inside = e < num_entries
        ids = tl.load(ids_ptr + e, mask=inside, other=-1)
        fixed = tl.load(fixed_ptr + e, mask=inside, other=0).to(tl.int32)
        total += tl.sum(tl.where(ids[:, None] == offs[None, :], fixed[:, None], 0), 0)
    return total.to(tl.float32) * _INV_ONE
