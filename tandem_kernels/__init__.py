"""Tensor math of speculative decoding: sampling, draft compression, and lossless verification.

Every kernel has a PyTorch reference: CUDA tensors run the Triton kernel, CPU tensors the
reference. Randomness is keyed by (seed, position, salt), never by generator state.

Drafter, per draft token at absolute position t (rejection mode):
    q = processed_probs(logits, ...); c = encode(q, DEFAULT_TOP_K)
    d = sample_compressed(c, seeds, t)          # drawn from q' = decode(c), never from q
    wire: d and pack(c)
Target, per step (sequences without drafts are requests with k = 0):
    c = unpack(bytes, k, K, vocab)              # InvalidDraftProbs: drop the proposal
    p = processed_probs(logits of the k+1 positions, ...)
    batch = VerifyBatch(p, d, cu_num_draft_tokens, seeds, positions)
    rejection_sample(batch, concat([c, no_probs(k_greedy), ...]), is_greedy)
Drafter-invariant mode: the drafter proposes sample(q, seeds, t) (shared TARGET_SALT noise) and
sends ids only; the target calls verify_invariant(batch).
"""
from tandem_kernels.checks import KernelInputError
from tandem_kernels.compression import (
    DEFAULT_TOP_K,
    ONE,
    CompressedProbs,
    InvalidDraftProbs,
    concat,
    decode,
    encode,
    no_probs,
    pack,
    point_mass,
    sample_compressed,
    to_dense,
    unpack,
    wire_bytes_per_token,
)
from tandem_kernels.gumbel import verify_invariant
from tandem_kernels.random import ACCEPT_SALT, DRAFT_SALT, TARGET_SALT, fresh_seed
from tandem_kernels.ragged import VerifyBatch, VerifyResult
from tandem_kernels.rejection import rejection_sample
from tandem_kernels.sampling import processed_probs, sample

__all__ = [
    "ACCEPT_SALT",
    "DEFAULT_TOP_K",
    "DRAFT_SALT",
    "ONE",
    "TARGET_SALT",
    "CompressedProbs",
    "InvalidDraftProbs",
    "KernelInputError",
    "VerifyBatch",
    "VerifyResult",
    "concat",
    "decode",
    "encode",
    "fresh_seed",
    "no_probs",
    "pack",
    "point_mass",
    "processed_probs",
    "rejection_sample",
    "sample",
    "sample_compressed",
    "to_dense",
    "unpack",
    "verify_invariant",
    "wire_bytes_per_token",
]
