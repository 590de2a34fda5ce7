"""Weight matrices kept in GGUF's quantized blocks, as the file stores them (csrc/blocks.h reads them)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from tandem.loaders.gguf_dequant import dequantize
from tandem.model import k_quants

# The block types the native decoder multiplies in their blocks.
LEGACY_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
BLOCK_TYPES = (*LEGACY_TYPES, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
BLOCK_SIZE = 32  # weights per block of the legacy types, and per activation block


@dataclass(frozen=True, slots=True)
class BlockPart:
    """Consecutive rows in one type: uint8 [rows, bytes per row], as stored (often a view of the file)."""

    data: np.ndarray
    ggml_type: GGMLQuantizationType


@dataclass(frozen=True, slots=True)
class BlockMatrix:
    """[rows, cols] weights in blocks; the parts' rows one after another (a fused q|k|v may mix types)."""

    parts: tuple[BlockPart, ...]
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.data.shape[0] for part in self.parts), self.cols

    @property
    def nbytes(self) -> int:
        return sum(part.data.nbytes for part in self.parts)

    @classmethod
    def stored(cls, data: np.ndarray, ggml_type: GGMLQuantizationType) -> "BlockMatrix":
        """`data`: uint8 [rows, bytes per row] of one of BLOCK_TYPES."""
        block, size = GGML_QUANT_SIZES[ggml_type]
        return cls((BlockPart(data, ggml_type),), data.shape[1] // size * block)

    @classmethod
    def quantized(cls, weight: torch.Tensor, ggml_type: GGMLQuantizationType) -> "BlockMatrix":
        """Float [rows, cols] (cols a multiple of 32) quantized to one of LEGACY_TYPES, as llama.cpp's
        quantize does."""
        return cls.stored(quantize(weight.float().numpy(), ggml_type), ggml_type)

    @classmethod
    def cat(cls, matrices: list["BlockMatrix"]) -> "BlockMatrix":
        if len({m.cols for m in matrices}) != 1:
            raise ValueError(f"can't stack block matrices of widths {[m.cols for m in matrices]}")
        return cls(tuple(part for m in matrices for part in m.parts), matrices[0].cols)

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols]."""
        rows = [dequantize(part.data, part.ggml_type) for part in self.parts]
        return torch.from_numpy(np.concatenate(rows) if len(rows) > 1 else rows[0])

    def groups(self, group_rows: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """The rows interleaved in groups of group_rows (the native build's vector lanes: 8 for AVX2,
        16 for AVX-512), as csrc/blocks.h's BlockGroup reads them: the group table, int64
        [groups, 4] (address, GGML type, first row, rows), and the arrays it points into."""
        tables, packed, first = [], [], 0
        for part in self.parts:
            data = (_interleaved(part, self.cols, group_rows) if part.ggml_type in LEGACY_TYPES
                    else k_quants.interleaved(part.data, part.ggml_type, self.cols, group_rows))  # [groups, bytes]
            rows = part.data.shape[0]
            table = np.empty((data.shape[0], 4), dtype=np.int64)
            table[:, 0] = data.ctypes.data + np.arange(data.shape[0], dtype=np.int64) * data.shape[1]
            table[:, 1] = int(part.ggml_type)
            table[:, 2] = first + np.arange(0, rows, group_rows)
            table[:, 3] = np.minimum(group_rows, rows - np.arange(0, rows, group_rows))
            tables.append(table)
            packed.append(data)
            first += rows
        return np.concatenate(tables), packed


def _interleaved(part: BlockPart, cols: int, group_rows: int) -> np.ndarray:
    """[rows, row bytes] -> [ceil(rows / G), blocks * G * block bytes] for G = group_rows: per block,
    the G rows' scales, (Q4_1) minimums, then chunks of four bytes from each row."""
    block_bytes = GGML_QUANT_SIZES[part.ggml_type][1]
    rows, blocks = part.data.shape[0], cols // BLOCK_SIZE
    padded = np.zeros((-(-rows // group_rows) * group_rows, blocks, block_bytes), dtype=np.uint8)
    padded[:rows] = part.data.reshape(rows, blocks, block_bytes)
    # [groups, blocks, G rows, block bytes]
    grouped = padded.reshape(-1, group_rows, blocks, block_bytes).transpose(0, 2, 1, 3)
    head = 4 if part.ggml_type == GGMLQuantizationType.Q4_1 else 2  # scale (and minimum) bytes
    fields = [grouped[..., at:at + 2].reshape(*grouped.shape[:2], -1) for at in range(0, head, 2)]
    values = grouped[..., head:]  # [groups, blocks, G rows, value bytes]
    chunks = values.reshape(*values.shape[:3], -1, 4).transpose(0, 1, 3, 2, 4)  # [.., chunk, row, 4]
    fields.append(chunks.reshape(*grouped.shape[:2], -1))
    return np.ascontiguousarray(np.concatenate(fields, axis=2).reshape(grouped.shape[0], -1))
