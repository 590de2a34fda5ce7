"""Counter-based randomness keyed by (seed, position, salt), bit-identical in PyTorch and Triton.

A draw depends on nothing but its key, never on generator state or on the batch, so a seeded
request gives the same tokens whatever it is batched with, and both services can share noise.
`position` is the 0-based index, in the whole sequence (prompt included), of the token drawn.

The bits come from a 4-round Feistel network over the 64-bit counter (position, index) whose
round function is the `lowbias32` integer hash (Wellons) keyed by (seed, salt). Feistel rounds
make the counter-to-bits map a bijection, so no two positions of one stream ever share a noise
vector. Integer math is exact on every device (the PyTorch side emulates uint32 with int64), so
bits and uniforms are bit-identical everywhere; see `race_weights` for the one float step.

Salts keep these streams apart (docs/design/lossless.md):
- TARGET_SALT: the target's token draws (plain sampling, recovered and bonus tokens). The
  drafter-invariant mode shares this noise with the drafter on purpose.
- ACCEPT_SALT: the target's acceptance uniform u.
- DRAFT_SALT: the drafter's draws in rejection mode, independent of u and the target's draws. The
  drafter hashes the prefix its drafts continue into their seed (draft_service/drafters/model.py).
"""
from __future__ import annotations

import secrets

import numpy as np
import torch

from tandem_kernels._triton import constexpr, jit, tl

TARGET_SALT = 0x5441_5247  # "TARG"
ACCEPT_SALT = 0x4143_4350  # "ACCP"
DRAFT_SALT = 0x4452_4654  # "DRFT"
# Kernels may only read module-level constants wrapped as constexpr.
TARGET_SALT_C = constexpr(TARGET_SALT)
ACCEPT_SALT_C = constexpr(ACCEPT_SALT)

_MASK32 = 0xFFFF_FFFF
_MUL1 = 0x21F0_AAAD
_MUL2 = 0xD35A_2D97
_GOLDEN = 0x9E37_79B9
_FEISTEL_ROUNDS = 4


def fresh_seed() -> int:
    """A random seed for a request that did not bring one (non-negative int64)."""
    return secrets.randbits(63)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on uint32 values held in int64: a bijective hash with strong avalanche."""
    # An int64 product wraps modulo 2**64 on every torch backend; its low 32 bits are exact.
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 15)


def stream_keys(seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """Per-draw key [B] (uint32 in int64) from seeds [B] and positions [B], both int64."""
    key = _mix((seeds & _MASK32) ^ salt)
    key = _mix(key ^ ((seeds >> 32) & _MASK32))
    return _mix(key ^ ((positions >> 32) & _MASK32))


def random_bits(
    seeds: torch.Tensor, positions: torch.Tensor, salt: int, index: torch.Tensor
) -> torch.Tensor:
    """uint32 bits (in int64) [B, n] for seeds/positions [B] and index [n] or [B, n]."""
    key = stream_keys(seeds, positions, salt)[:, None]  # [B, 1]
    left = (positions & _MASK32)[:, None].expand(-1, index.shape[-1])  # [B, n]
    if seeds.device.type == "cpu":
        return torch.from_numpy(_feistel_numpy(key.numpy(), left.numpy(), index.numpy())).to(torch.int64)
    right = index.to(torch.int64).expand_as(left)
    for r in range(_FEISTEL_ROUNDS):
        round_key = (key + r * _GOLDEN) & _MASK32
        left, right = right, left ^ _mix(right ^ round_key)
    return right


def _feistel_numpy(key: np.ndarray, left: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The same Feistel network in native uint32, in place: the CPU reference's hot path
    (a full-vocabulary race per sampled row) runs several times faster than int64 emulation."""
    left = np.ascontiguousarray(np.broadcast_to(left, left.shape).astype(np.uint32))
    right = np.ascontiguousarray(np.broadcast_to(index, left.shape).astype(np.uint32))
    mixed = np.empty_like(right)
    with np.errstate(over="ignore"):
        for r in range(_FEISTEL_ROUNDS):
            round_key = ((key + r * _GOLDEN) & _MASK32).astype(np.uint32)  # [B, 1]
            np.bitwise_xor(right, round_key, out=mixed)
            mixed ^= mixed >> np.uint32(16)
            mixed *= np.uint32(_MUL1)
            mixed ^= mixed >> np.uint32(15)
            mixed *= np.uint32(_MUL2)
            mixed ^= mixed >> np.uint32(15)
            mixed ^= left
            left, right, mixed = right, mixed, left
    return right


def accept_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The target's acceptance uniform u in (0, 1) [B], float64 on a 2**-32 grid."""
    index = torch.zeros(1, dtype=torch.int64, device=seeds.device)
    bits = random_bits(seeds, positions, ACCEPT_SALT, index)[:, 0]
    # u has 33 significant bits and q' (a multiple of 2**-15 up to 1) 16: u * q' is exact in
    # float64, so `u * q' < p` is the exact test u < p / q'.
    return (bits.to(torch.float64) + 0.5) * 2.0**-32


def race_weights(
    seeds: torch.Tensor, positions: torch.Tensor, salt: int, index: torch.Tensor
) -> torch.Tensor:
    """1 / E with E ~ Exp(1), float32 [B, n]: argmax(p * weights) is a draw from p."""
    bits = random_bits(seeds, positions, salt, index)
    u = (bits.to(torch.float64) + 0.5) * 2.0**-32  # [B, n] in (0, 1)
    # Libraries' float64 logs may differ in the last ulp; rounding once to float32 hides that
    # in all but about 2**-28 of the weights (and then only a near-tie could change a draw).
    return (-1.0 / torch.log(u)).to(torch.float32)


@jit()
def tl_mix(x):
    """Triton twin of `_mix` on uint32 (whose products wrap modulo 2**32); same constants."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0xD35A2D97
    return x ^ (x >> 15)


@jit()
def tl_random_bits(seed, position, salt: tl.constexpr, index):
    """Triton twin of `random_bits` for one int64 seed/position and a uint32 index (scalar or block)."""
    key = tl_mix(seed.to(tl.uint32) ^ salt)
    key = tl_mix(key ^ (seed >> 32).to(tl.uint32))
    key = tl_mix(key ^ (position >> 32).to(tl.uint32))
    left = position.to(tl.uint32)
    right = index
    for r in tl.static_range(4):
        round_key = key + ((r * 0x9E3779B9) & 0xFFFFFFFF)
        left, right = right, left ^ tl_mix(right ^ round_key)
    return right


@jit()
def tl_accept_uniform(seed, position):
    """Triton twin of `accept_uniforms` for one request position (float64 scalar)."""
    bits = tl_random_bits(seed, position, ACCEPT_SALT_C, tl.full((), 0, tl.uint32))
    return (bits.to(tl.float64) + 0.5) * 2.3283064365386963e-10


@jit()
def tl_race_weights(seed, position, salt: tl.constexpr, index):
    """Triton twin of `race_weights` for one seed/position over a block of uint32 indices."""
    bits = tl_random_bits(seed, position, salt, index)
    u = (bits.to(tl.float64) + 0.5) * 2.3283064365386963e-10
    return (-1.0 / tl.log(u)).to(tl.float32)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed` (n > 1): seed + index, as vLLM seeds its samples."""
    return (seed + index) & ((1 << 63) - 1)
