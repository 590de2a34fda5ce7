"""Drafter-invariant verification (Gumbel-max coupling; Daliri et al.).

Target and drafter draw with the same noise, keyed by (seed, position, TARGET_SALT): the target's
token at a position is t = argmax(p * race weights) = argmax(log p + G), exactly what `sample`
draws without speculation, and the drafter proposes argmax(q * the same weights) (it calls
`sample(q, seeds, positions)` with the default salt). Verification accepts while d == t and emits
t at the first mismatch, or as the bonus token. The output is therefore bit-identical to sampling
from the target alone with the same seed, whatever the drafter, and the wire carries ids only.

Greedy requests need no flag: their p is one-hot (see `processed_probs`), so t = argmax p.
Batch layout and output as in `tandem_kernels.ragged`.
"""
from __future__ import annotations

import torch

from tandem_kernels._triton import jit, next_power_of_2, require_triton, tl
from tandem_kernels.random import TARGET_SALT_C
from tandem_kernels.ragged import VerifyBatch, VerifyResult, emit_tokens, launch_per_request, num_leading, ragged_layout
from tandem_kernels.sampling import BLOCK_V, sample_reference, tl_race_argmax


def verify_invariant(verify: VerifyBatch) -> VerifyResult:
    """Verify the batch's drafts against the target's own keyed draws."""
    verify.check()
    if verify.target_probs.is_cuda:
        return verify_invariant_triton(verify)
    return verify_invariant_reference(verify)


def verify_invariant_reference(verify: VerifyBatch) -> VerifyResult:
    """PyTorch reference of `verify_invariant`: the target's draw at every row, then leading matches."""
    target_probs, draft_tokens, seeds, positions = verify.target_probs, verify.draft_tokens, verify.seeds, verify.positions
    layout = ragged_layout(verify.cu_num_draft_tokens)
    batch = verify.cu_num_draft_tokens.shape[0]
    requests = torch.arange(batch, device=target_probs.device)
    row_request = torch.repeat_interleave(requests, layout.num_drafts + 1)  # [T]
    row_local = torch.arange(row_request.shape[0], device=target_probs.device) - (layout.starts + requests)[row_request]
    drawn = sample_reference(target_probs, seeds[row_request], positions[row_request] + row_local)  # [T]
    num_accepted = num_leading(draft_tokens == drawn[layout.rows], layout)
    return emit_tokens(draft_tokens, layout, num_accepted, drawn[layout.starts + requests + num_accepted])


def verify_invariant_triton(verify: VerifyBatch) -> VerifyResult:
    """Launch `_verify_invariant_kernel`, one program per request."""
    require_triton()
    return launch_per_request(_verify_invariant_kernel, verify, BLOCK=min(BLOCK_V, next_power_of_2(verify.vocab)))


@jit(do_not_specialize=["vocab", "out_stride"])
def _verify_invariant_kernel(
    tokens_ptr, num_accepted_ptr, probs_ptr, draft_ptr, cu_ptr, seeds_ptr, positions_ptr,
    vocab, out_stride, BLOCK: tl.constexpr,
):  # fmt: skip
    """One request: the target's keyed draw at each row until it differs from the draft."""
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b - 1, mask=b > 0, other=0)
    num_drafts = (tl.load(cu_ptr + b) - start).to(tl.int32)
    seed = tl.load(seeds_ptr + b)
    position = tl.load(positions_ptr + b)
    out_ptr = tokens_ptr + b.to(tl.int64) * out_stride
    num_accepted = tl.full((), 0, tl.int32)
    stopped = tl.full((), 0, tl.int32)
    for j in range(0, num_drafts + 1):
        if stopped == 0:
            row_ptr = probs_ptr + (start + b + j) * vocab
            drawn = tl_race_argmax(row_ptr, vocab, seed, position + j, TARGET_SALT_C, BLOCK)
            tl.store(out_ptr + j, drawn.to(tl.int64))
            draft = tl.load(draft_ptr + start + j, mask=j < num_drafts, other=-1)
            if (j < num_drafts) & (draft == drawn):
                num_accepted += 1
            else:
                stopped = 1
    tl.store(num_accepted_ptr + b, num_accepted)
