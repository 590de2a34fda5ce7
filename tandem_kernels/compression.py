"""Compressed draft probabilities: top-K ids with fixed-point probabilities, and their wire codec.

The drafter turns its distribution q into q' = decode(encode(q, K)) and samples its draft from
q' (`sample_compressed`), never from q; the target decodes the same q' from the wire. Since q'
is what the draft was drawn from, rejection sampling stays lossless for any K (docs/design/lossless.md).

Fixed point: one is ONE = 2**15, so a probability is an integer in [0, ONE] that fits a uint16,
and decoding (`fixed * 2**-15`) is exact in float32: bit-identical on every device. Each row's
integers sum to exactly ONE (largest-remainder rounding of the renormalized top-K).

Determinism: ids are the K largest entries of q, ties broken by the lower id; rounding leftovers
go to the largest remainders, ties broken by that same order. With K > V, K becomes V.

Wire format, for N draft tokens and K entries each (5 bytes per entry, 80 per token at K=16):
ids as 3-byte little-endian integers, row-major [N, K], then probabilities as 2-byte
little-endian integers, row-major [N, K]. Vocabularies must be smaller than 2**24.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from tandem_kernels.random import DRAFT_SALT, race_weights

ONE = 1 << 15
# bench/acceptance.py on SmolLM2-135M: the smallest K whose acceptance is within 1% of the
# uncompressed q at every T <= 1 for both drafters measured (1280 bytes per draft token);
# K = 32 (160 bytes) is enough at T <= 0.7, K = 4 (20 bytes) at T <= 0.3.
DEFAULT_TOP_K = 256
MAX_VOCAB = 1 << 24
_ID_BYTES = 3
_PROB_BYTES = 2


class InvalidDraftProbs(ValueError):
    """Compressed probabilities that do not describe a distribution over the vocabulary."""


@dataclass(frozen=True)
class CompressedProbs:
    """q' for N draft tokens: ids [N, K] int32 (distinct per row), fixed [N, K] uint16 (rows sum to ONE)."""

    ids: torch.Tensor
    fixed: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def k(self) -> int:
        return self.ids.shape[1]

    def rows(self, rows: slice) -> CompressedProbs:
        """q' for the draft tokens in rows: views, no copy."""
        return CompressedProbs(self.ids[rows], self.fixed[rows])


def no_probs(num_tokens: int) -> CompressedProbs:
    """q' rows with no entries [num_tokens, 0], for drafts sent as ids only (greedy requests)."""
    ids = torch.zeros(num_tokens, 0, dtype=torch.int32)
    return CompressedProbs(ids, torch.zeros(num_tokens, 0, dtype=torch.uint16))


def point_mass(token_ids: Sequence[int], k: int = 1) -> CompressedProbs:
    """q' = 1 on each token: rows [N, K] as encode writes them, the token first and, for K > 1, the
    ids 0, 1, ... (skipping the token) at probability 0, so that every row's ids stay distinct."""
    others = torch.arange(k, dtype=torch.int32)  # [K]
    ids = torch.empty(len(token_ids), k, dtype=torch.int32)
    fixed = torch.zeros(len(token_ids), k, dtype=torch.int32)
    for row, token in enumerate(token_ids):
        ids[row] = torch.cat([torch.tensor([token], dtype=torch.int32), others[others != token][: k - 1]])
        fixed[row, 0] = ONE
    return CompressedProbs(ids, fixed.to(torch.uint16))


def concat(parts: Sequence[CompressedProbs]) -> CompressedProbs:
    """One batch of q' rows from proposals of any K: shorter rows get zero-probability entries."""
    if not parts:
        return no_probs(0)
    k = max(part.k for part in parts)

    def padded(tensor: torch.Tensor) -> torch.Tensor:  # [n, k], int32
        return torch.nn.functional.pad(tensor.to(torch.int32), (0, k - tensor.shape[1]))

    fixed = torch.cat([padded(part.fixed) for part in parts]).to(torch.uint16)
    return CompressedProbs(torch.cat([padded(part.ids) for part in parts]), fixed)


def wire_bytes_per_token(k: int) -> int:
    """Bytes one draft token's q' takes on the wire at K entries."""
    return k * (_ID_BYTES + _PROB_BYTES)


def encode(q: torch.Tensor, k: int) -> CompressedProbs:
    """Top-min(k, V) ids of q [N, V] (any scale, rows renormalized) with fixed-point probabilities."""
    _check_distribution(q, k)
    k = min(k, q.shape[1])
    # A stable descending sort puts the lower id first among equal probabilities.
    top, order = q.to(torch.float64).sort(dim=1, descending=True, stable=True)
    top, ids = top[:, :k], order[:, :k]  # [N, k]
    scaled = top / top.sum(dim=1, keepdim=True) * ONE
    floor = scaled.floor()
    deficit = ONE - floor.sum(dim=1, keepdim=True)  # [N, 1], in [0, k)
    _, by_remainder = (scaled - floor).sort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(by_remainder).scatter_(
        1, by_remainder, torch.arange(k, device=q.device).expand_as(by_remainder)
    )
    fixed = floor + (rank < deficit).to(torch.float64)
    return CompressedProbs(ids.to(torch.int32), fixed.to(torch.int32).to(torch.uint16))


def _check_distribution(q: torch.Tensor, k: int) -> None:
    """encode's input: a finite, non-negative float [N, V] whose rows have mass, and k >= 1."""
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    if q.dim() != 2 or not q.is_floating_point() or q.shape[1] == 0:
        raise ValueError(f"q: expected a float [N, V] tensor with V >= 1, got {q.dtype} {list(q.shape)}")
    if q.shape[1] > MAX_VOCAB:
        raise ValueError(f"q: vocabulary of {q.shape[1]} exceeds the wire format's {MAX_VOCAB}")
    if not bool(q.isfinite().all()):
        raise ValueError("q: contains NaN or infinite values")
    if bool((q < 0).any()):
        raise ValueError("q: contains negative probabilities")
    if not bool((q.sum(dim=1) > 0).all()):
        raise ValueError("q: a row has no probability mass")


def decode(compressed: CompressedProbs) -> torch.Tensor:
    """q' on its ids [N, K] float32, exact: every device gets the same bits."""
    return compressed.fixed.to(torch.float32) * (1.0 / ONE)


def to_dense(compressed: CompressedProbs, vocab_size: int) -> torch.Tensor:
    """q' scattered over the vocabulary [N, V] float32 (entries of a repeated id add up, as in the kernel)."""
    dense = torch.zeros(compressed.num_tokens, vocab_size, device=compressed.ids.device)
    return dense.scatter_add_(1, compressed.ids.to(torch.int64), decode(compressed))


def sample_compressed(
    compressed: CompressedProbs,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    salt: int = DRAFT_SALT,
) -> torch.Tensor:
    """Draft tokens [N] int64 drawn from q', keyed by (seeds[n], positions[n], salt)."""
    ids = compressed.ids.to(torch.int64)  # [N, K]
    keys = decode(compressed) * race_weights(seeds, positions, salt, ids)  # [N, K]
    # Lowest id among equal keys: the same draw as `sample` over the dense q'.
    best = keys == keys.max(dim=1, keepdim=True).values
    return torch.where(best, ids, torch.iinfo(torch.int64).max).min(dim=1).values


def pack(compressed: CompressedProbs) -> bytes:
    """The wire bytes of q' (format in the module docstring)."""
    ids = compressed.ids.cpu().numpy().astype("<u4")
    if ids.size and int(ids.max()) >= MAX_VOCAB:
        raise ValueError(f"ids: must be < {MAX_VOCAB} to fit {_ID_BYTES} bytes")
    id_bytes = ids.view(np.uint8).reshape(*ids.shape, 4)[..., :_ID_BYTES]
    fixed = compressed.fixed.cpu().numpy().astype("<u2")
    return id_bytes.tobytes() + fixed.tobytes()


def unpack(data: bytes, num_tokens: int, k: int, vocab_size: int) -> CompressedProbs:
    """Parse and validate q' for num_tokens draft tokens; raise InvalidDraftProbs if malformed."""
    _check_header(data, num_tokens, k, vocab_size)
    id_end = num_tokens * k * _ID_BYTES
    raw = np.frombuffer(data, dtype=np.uint8, count=id_end).reshape(num_tokens, k, _ID_BYTES)
    ids = raw[..., 0].astype(np.int32) | (raw[..., 1].astype(np.int32) << 8) | (raw[..., 2].astype(np.int32) << 16)
    fixed = np.frombuffer(data, dtype="<u2", offset=id_end).reshape(num_tokens, k)
    _check_rows(ids, fixed, vocab_size)
    return CompressedProbs(torch.from_numpy(ids), torch.from_numpy(fixed.astype(np.uint16)))


def _check_header(data: bytes, num_tokens: int, k: int, vocab_size: int) -> None:
    """Type, sizes and exact byte length of a q' message."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidDraftProbs(f"expected bytes, got {type(data).__name__}")
    if num_tokens < 0 or k < 1 or k > vocab_size:
        raise InvalidDraftProbs(f"bad sizes: num_tokens={num_tokens}, k={k}, vocab_size={vocab_size}")
    expected = num_tokens * wire_bytes_per_token(k)
    if len(data) != expected:
        raise InvalidDraftProbs(f"expected {expected} bytes for {num_tokens} tokens at K={k}, got {len(data)}")


def _check_rows(ids: np.ndarray, fixed: np.ndarray, vocab_size: int) -> None:
    """Ids inside the vocabulary and distinct per row; probabilities that sum to ONE."""
    if ids.size and int(ids.max()) >= vocab_size:
        raise InvalidDraftProbs(f"token id {int(ids.max())} outside the vocabulary of {vocab_size}")
    if bool((np.diff(np.sort(ids, axis=1), axis=1) == 0).any()):
        raise InvalidDraftProbs("a token id repeats within one draft token's entries")
    sums = fixed.astype(np.int64).sum(axis=1)
    if bool((sums != ONE).any()):
        raise InvalidDraftProbs(f"probabilities must sum to {ONE}, got {int(sums[sums != ONE][0])}")
