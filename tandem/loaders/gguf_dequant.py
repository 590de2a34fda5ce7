"""GGUF tensor bytes to float32: Q8_0, Q4_0 and Q4_1 in a few whole-array numpy passes.

gguf.quants.dequantize is the reference (tests compare bit for bit); it works through 16-row
groups with temporaries at every step, several times slower on a whole model. The arithmetic here
is the same float32 operations in the same order, so the results are identical.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

_BLOCK = 32  # weights per Q8_0/Q4_0/Q4_1 block


def dequantize(data: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """`data`: uint8 [..., row_bytes] as stored; returns a new float32 [..., row_weights] array."""
    fast = _BLOCK_DEQUANTIZERS.get(ggml_type)
    if fast is None:
        return np.array(gguf_dequantize(data, ggml_type), dtype=np.float32)  # copied: the file is read-only
    block_bytes = GGML_QUANT_SIZES[ggml_type][1]
    return fast(data.reshape(-1, block_bytes)).reshape(*data.shape[:-1], -1)


def _scale(blocks: np.ndarray, at: int) -> np.ndarray:
    # blocks: [N, block_bytes] -> [N, 1], the float16 stored at byte `at` of each block
    return blocks[:, at : at + 2].view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    # packed: [N, 16] -> [N, 32]; low nibbles are weights 0-15 of a block, high nibbles 16-31
    out = np.empty((packed.shape[0], _BLOCK), dtype=np.float32)
    out[:, : _BLOCK // 2] = packed & 0x0F
    out[:, _BLOCK // 2 :] = packed >> 4
    return out


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    out *= _scale(blocks, 0)
    return out


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    out = _nibbles(blocks[:, 2:])
    out -= 8
    out *= _scale(blocks, 0)
    return out


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    out = _nibbles(blocks[:, 4:])
    out *= _scale(blocks, 0)
    out += _scale(blocks, 2)
    return out


_BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
}
