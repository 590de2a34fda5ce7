"""K-quant superblocks (Q4_K, Q5_K, Q6_K) decoded to their integers and interleaved in groups of rows
(8 or 16: the native build's vector lanes), as csrc/blocks.h's K-quant kernels read them."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

SUPER = 256  # weights per K-quant superblock


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at:at + 2].copy().view(np.uint16)[..., 0]  # [..] raw fp16 bits


def _scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums, uint8 [.., 8] each."""
    s = packed.astype(np.uint8)
    sc = np.empty((*s.shape[:-1], 8), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def decode(blocks: np.ndarray, ggml_type: GGMLQuantizationType) -> dict[str, np.ndarray]:
    """blocks: uint8 [rows, superblocks, block bytes] -> q [rows, superblocks, 256] (0..15, 0..31 or
    0..63) with d (and dmin) as fp16 bits [rows, superblocks] and scales (and minimums) per sub-block."""
    if ggml_type == GGMLQuantizationType.Q6_K:
        ql, qh = blocks[..., :128], blocks[..., 128:192]
        q = np.empty((*blocks.shape[:-1], SUPER), np.uint8)
        for half in range(2):
            low, high, out = ql[..., 64 * half:64 * half + 64], qh[..., 32 * half:32 * half + 32], 128 * half
            q[..., out:out + 32] = (low[..., :32] & 0xF) | (((high >> 0) & 3) << 4)
            q[..., out + 32:out + 64] = (low[..., 32:] & 0xF) | (((high >> 2) & 3) << 4)
            q[..., out + 64:out + 96] = (low[..., :32] >> 4) | (((high >> 4) & 3) << 4)
            q[..., out + 96:out + 128] = (low[..., 32:] >> 4) | (((high >> 6) & 3) << 4)
        return {"q": q, "d": _f16(blocks, 208), "scales": blocks[..., 192:208].copy()}
    sc, mn = _scales_mins(blocks[..., 4:16])
    qs = blocks[..., 48:176] if ggml_type == GGMLQuantizationType.Q5_K else blocks[..., 16:144]
    q = np.empty((*blocks.shape[:-1], SUPER), np.uint8)
    for i in range(4):
        q[..., 64 * i:64 * i + 32] = qs[..., 32 * i:32 * i + 32] & 0xF
        q[..., 64 * i + 32:64 * i + 64] = qs[..., 32 * i:32 * i + 32] >> 4
        if ggml_type == GGMLQuantizationType.Q5_K:
            qh = blocks[..., 16:48]
            q[..., 64 * i:64 * i + 32] |= ((qh >> (2 * i)) & 1) << 4
            q[..., 64 * i + 32:64 * i + 64] |= ((qh >> (2 * i + 1)) & 1) << 4
    return {"q": q, "d": _f16(blocks, 0), "dmin": _f16(blocks, 2), "scales": sc, "mins": mn}


def interleaved(data: np.ndarray, ggml_type: GGMLQuantizationType, cols: int, group_rows: int) -> np.ndarray:
    """[rows, row bytes] -> [ceil(rows / G), superblocks * group bytes] for G = group_rows: per
    superblock, the G rows' d (and dmin) as fp16, their scales (and minimums) by sub-block, then
    eight windows of 32 weights, each its nibbles in four chunks (four bytes of every row; low nibbles are
    weights 4c .., high nibbles 16 + 4c ..) and the bits above them in planes of one byte per
    (row, t): Q5_K's bit k is bit 4 of weight 4k + t; Q6_K's two planes (k < 4, k >= 4) hold
    bits 4-5 of weight 4k + t at bits 2(k % 4)."""
    rows, supers = data.shape[0], cols // SUPER
    padded = np.zeros((-(-rows // group_rows) * group_rows, data.shape[1]), np.uint8)
    padded[:rows] = data
    fields = decode(padded.reshape(padded.shape[0], supers, -1), ggml_type)

    def by_group(a: np.ndarray) -> np.ndarray:  # [rows, supers, ...] -> [groups, supers, G rows, ...]
        return np.ascontiguousarray(a.reshape(-1, group_rows, *a.shape[1:]).swapaxes(1, 2))

    groups = padded.shape[0] // group_rows
    header = [by_group(fields["d"]).view(np.uint8).reshape(groups, supers, -1)]
    if ggml_type == GGMLQuantizationType.Q6_K:
        header.append(by_group(fields["scales"]).swapaxes(2, 3).reshape(groups, supers, -1))
    else:
        header.append(by_group(fields["dmin"]).view(np.uint8).reshape(groups, supers, -1))
        for name in ("scales", "mins"):
            header.append(by_group(fields[name]).swapaxes(2, 3).reshape(groups, supers, -1))
    q = by_group(fields["q"]).reshape(groups, supers, group_rows, 8, 32).transpose(0, 1, 3, 2, 4)  # [g, s, w, r, 32]
    nibbles = (q[..., :16] & 0xF) | ((q[..., 16:] & 0xF) << 4)  # [g, s, w, r, 16]
    windows = [nibbles.reshape(*nibbles.shape[:4], 4, 4).transpose(0, 1, 2, 4, 3, 5).reshape(groups, supers, 8, -1)]
    sets = q.reshape(*q.shape[:4], 8, 4) >> 4  # [g, s, w, r, set k, t]: weight 4k + t's bits above the nibble
    if ggml_type == GGMLQuantizationType.Q5_K:
        windows.append(np.bitwise_or.reduce(sets << np.arange(8, dtype=np.uint8)[:, None], axis=4).reshape(groups, supers, 8, -1))
    elif ggml_type == GGMLQuantizationType.Q6_K:
        shifts = (2 * np.arange(4, dtype=np.uint8))[:, None]
        for part in (sets[..., :4, :], sets[..., 4:, :]):
            windows.append(np.bitwise_or.reduce(part << shifts, axis=4).reshape(groups, supers, 8, -1))
    body = np.concatenate(windows, axis=3).reshape(groups, supers, -1)
    return np.ascontiguousarray(np.concatenate([*header, body], axis=2).reshape(groups, -1))
