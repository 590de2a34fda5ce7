"""GGUF files: the header (metadata, tensor infos) unpacked with struct, tensor data as np.memmap slices.

gguf.GGUFReader wraps every header value in numpy views, one per token string of a 49k vocabulary,
which takes seconds; unpacking the same bytes with struct takes a small fraction of that.

Layout (versions 2 and 3): magic, version, tensor count, key/value count, the key/values, the
tensor infos, padding up to `general.alignment`, then the tensor data, each tensor at its offset
from the start of that data section.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from tandem.loaders.errors import CheckpointError

_SUPPORTED_VERSIONS = (2, 3)
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # innermost dimension first, as GGUF lists them
    ggml_type: GGMLQuantizationType
    offset: int  # from the start of the data section

    @property
    def n_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return math.prod(self.shape) // block_size * type_size

    @property
    def row_shape(self) -> tuple[int, ...]:
        """numpy's shape of the raw bytes: outermost dimension first, the last one a row's bytes."""
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return (*reversed(self.shape[1:]), self.shape[0] // block_size * type_size)


class GGUFFile:
    """One GGUF file: `metadata` by key, `tensors` by name, and each tensor's bytes from `tensor_data`."""

    def __init__(self, path: Path):
        self.path = path
        self._map = _map_file(path)
        cursor = _Cursor(memoryview(self._map), _byte_order(self._map, path), 8, path)
        tensor_count, kv_count = cursor.scalar(GGUFValueType.UINT64), cursor.scalar(GGUFValueType.UINT64)
        self.metadata: dict[str, Any] = cursor.metadata(kv_count)
        self.tensors: dict[str, GGUFTensorInfo] = cursor.tensor_infos(tensor_count)
        alignment = _alignment(self.metadata, path)
        self.data_offset = -(-cursor.pos // alignment) * alignment
        self._check_extents()

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's bytes (uint8, shaped as `GGUFTensorInfo.row_shape`), mapped from the file, not read."""
        info = self.tensors[name]
        start = self.data_offset + info.offset
        return self._map[start : start + info.n_bytes].reshape(info.row_shape)

    def _check_extents(self) -> None:
        for info in self.tensors.values():
            end = self.data_offset + info.offset + info.n_bytes
            if end > len(self._map):
                raise CheckpointError(
                    f"{self.path}: truncated GGUF file: tensor {info.name} ends at byte {end}, "
                    f"the file has {len(self._map)}"
                )


def _map_file(path: Path) -> np.ndarray:
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    # numpy cannot map an empty file; an empty array fails the magic check the same way.
    return np.memmap(path, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)


def _byte_order(data: np.ndarray, path: Path) -> str:
    """struct's byte-order character for the file, once its magic and version check out."""
    if len(data) < 8 or data[:4].tobytes() != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file")
    (version,) = struct.unpack_from("<I", data, 4)
    # A big-endian file's version reads as a huge little-endian number.
    order = "<" if version & 0xFFFF else ">"
    (version,) = struct.unpack_from(order + "I", data, 4)
    if version not in _SUPPORTED_VERSIONS:
        raise CheckpointError(f"{path}: GGUF version {version} is not supported; supported: 2, 3")
    return order


def _alignment(metadata: dict[str, Any], path: Path) -> int:
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: general.alignment={alignment!r} is not a power of two")
    return alignment


@lru_cache(maxsize=None)
def _struct(fmt: str) -> struct.Struct:
    return struct.Struct(fmt)


@dataclass(slots=True)
class _Cursor:
    """Reads header values one after another from `pos`."""

    buffer: memoryview
    order: str
    pos: int
    path: Path

    def truncated(self) -> CheckpointError:
        return CheckpointError(f"{self.path}: truncated GGUF header")

    def take(self, size: int) -> memoryview:
        end = self.pos + size
        if end > len(self.buffer):
            raise self.truncated()
        chunk = self.buffer[self.pos : end]
        self.pos = end
        return chunk

    def scalar(self, kind: int) -> Any:
        fmt = _struct(self.order + _SCALAR_FORMATS[kind])
        return fmt.unpack(self.take(fmt.size))[0]

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """Inlined, since a vocabulary is ~100k strings: each a uint64 length, then UTF-8 bytes."""
        length = _struct(self.order + "Q").unpack_from
        buffer, pos, end, out = self.buffer, self.pos, len(self.buffer), []
        try:
            for _ in range(count):
                start = pos + 8
                pos = start + length(buffer, pos)[0]
                if pos > end:
                    raise self.truncated()
                out.append(str(buffer[start:pos], "utf-8"))
        except struct.error as exc:  # the length itself is cut off
            raise self.truncated() from exc
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{self.path}: GGUF string is not UTF-8: {exc}") from exc
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            return self.array()
        if kind not in _SCALAR_FORMATS:
            raise CheckpointError(f"{self.path}: unknown GGUF value type {kind}")
        return self.scalar(kind)

    def array(self) -> list[Any]:
        kind = self.scalar(GGUFValueType.UINT32)
        count = self.scalar(GGUFValueType.UINT64)
        if kind in _SCALAR_FORMATS:
            dtype = np.dtype(self.order + _SCALAR_FORMATS[kind])
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
        if kind == GGUFValueType.STRING:
            return self.strings(count)
        return [self.value(kind) for _ in range(count)]

    def metadata(self, count: int) -> dict[str, Any]:
        items = {}
        for _ in range(count):
            key = self.string()
            items[key] = self.value(self.scalar(GGUFValueType.UINT32))
        return items

    def tensor_infos(self, count: int) -> dict[str, GGUFTensorInfo]:
        infos = {}
        for _ in range(count):
            info = self.tensor_info()
            if info.name in infos:
                raise CheckpointError(f"{self.path}: tensor {info.name} appears twice")
            infos[info.name] = info
        return infos

    def tensor_info(self) -> GGUFTensorInfo:
        name = self.string()
        shape = tuple(self.scalar(GGUFValueType.UINT64) for _ in range(self.scalar(GGUFValueType.UINT32)))
        raw_type = self.scalar(GGUFValueType.UINT32)
        offset = self.scalar(GGUFValueType.UINT64)
        if raw_type not in GGML_QUANT_SIZES:
            raise CheckpointError(f"{self.path}: tensor {name} has unknown GGML type {raw_type}")
        ggml_type = GGMLQuantizationType(raw_type)
        if not shape or shape[0] % GGML_QUANT_SIZES[ggml_type][0]:
            raise CheckpointError(f"{self.path}: tensor {name} has shape {shape}, not whole {ggml_type.name} blocks")
        return GGUFTensorInfo(name, shape, ggml_type, offset)
