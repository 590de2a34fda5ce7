"""The native CPU decoder library (csrc/): which build this CPU runs, compiling it, and its C types.

The C sources are compiled by gcc on first use into a per-user cache, once per instruction set:
AMX (bf16 matrix tiles), AVX-512 with BF16 dot products, AVX-512 with VNNI (integer dot
products), plain AVX-512, or AVX2 with FMA, chosen at run time from the CPU's flags, best first; a build that fails to compile or to
start falls back to the next. Where none fits, or gcc is missing, `load()` returns None and
models run on the PyTorch path. `TANDEM_NATIVE=0` turns the library off; `TANDEM_NATIVE_ISA` picks a lower build
than the CPU allows (the tests run every build this CPU can).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("decoder.c", "blocks.h", "block_kernels.h", "gemm.h", "pool.h", "vec.h")
PANEL = 16  # output columns per packed panel (gemm.h)
KEY_BLOCK = 16  # positions per block of the K cache (decoder.c)
WEIGHTS_F32, WEIGHTS_BF16, WEIGHTS_BLOCKS, WEIGHTS_BLOCKS_X8 = 0, 1, 2, 3  # how a model's matrices are stored (gemm.h)
KV_F32, KV_BF16, KV_F16 = 0, 1, 2  # the KV cache's element type (decoder.c)


@dataclass(frozen=True, slots=True)
class Isa:
    name: str
    cpu_flags: frozenset[str]  # what /proc/cpuinfo must list
    gcc_flags: tuple[str, ...]


_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
# Best first.
ISAS = (
    Isa("amx", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni", "avx2", "fma",
                          "amx_tile", "amx_bf16"}), (*_AVX512, "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16")),
    Isa("avx512_bf16", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni", "avx2",
                                  "fma"}), (*_AVX512, "-mavx512bf16", "-mavx512vnni")),
    Isa("avx512_vnni", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma"}),
        (*_AVX512, "-mavx512vnni")),
    Isa("avx512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"}), _AVX512),
    Isa("avx2", frozenset({"avx2", "fma", "f16c"}), _AVX2),
)
_COMMON_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-Wno-psabi", "-pthread")


# ---- the C structs (decoder.c, gemm.h) ---------------------------------------------------------

class PackedMatrix(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("rows", ctypes.c_int), ("cols", ctypes.c_int), ("panels", ctypes.c_int),
                ("groups", ctypes.c_int)]


class CLayer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("qkv", PackedMatrix), ("qkv_bias", ctypes.c_void_p),
                ("o", PackedMatrix), ("mlp_norm", ctypes.c_void_p), ("gate_up", PackedMatrix),
                ("down", PackedMatrix), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class CModel(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int), ("intermediate", ctypes.c_int), ("num_layers", ctypes.c_int),
                ("num_heads", ctypes.c_int), ("num_kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
                ("max_len", ctypes.c_int), ("pool_positions", ctypes.c_int64), ("block_tables", ctypes.c_void_p),
                ("weights_kind", ctypes.c_int), ("kv_type", ctypes.c_int),
                ("eps", ctypes.c_float), ("rope_cos", ctypes.c_void_p), ("rope_sin", ctypes.c_void_p),
                ("embed", ctypes.c_void_p), ("final_norm", ctypes.c_void_p), ("lm_head", PackedMatrix),
                ("layers", ctypes.POINTER(CLayer))]


class CBatch(ctypes.Structure):
    _fields_ = [("num_tokens", ctypes.c_int), ("token_ids", ctypes.c_void_p), ("positions", ctypes.c_void_p),
                ("num_chunks", ctypes.c_int), ("chunk_slots", ctypes.c_void_p), ("chunk_starts", ctypes.c_void_p),
                ("num_out", ctypes.c_int), ("out_tokens", ctypes.c_void_p), ("want_hidden", ctypes.c_int),
                ("out", ctypes.c_void_p), ("num_capture", ctypes.c_int), ("capture_layers", ctypes.c_void_p),
                ("captured", ctypes.c_void_p)]


class Library:
    """The loaded build: `forward` and `gemm` release the GIL while they run (ctypes does)."""

    def __init__(self, isa: Isa, path: Path):
        self.isa = isa
        lib = ctypes.CDLL(str(path))
        if lib.tandem_init() != 0:
            raise OSError(f"the {isa.name} build can't run here (the kernel refused its registers)")
        self._forward = lib.tandem_forward
        self._forward.argtypes = [ctypes.POINTER(CModel), ctypes.POINTER(CBatch), ctypes.c_int]
        self._forward.restype = ctypes.c_int
        self._gemm = lib.tandem_gemm
        self._gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(PackedMatrix), ctypes.c_int,
                               ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        self._gemm.restype = ctypes.c_int
        self._argmax = lib.tandem_argmax
        self._argmax.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        self._argmax.restype = None
        self.features = lib.tandem_features()
        self.group_rows = lib.tandem_group_rows()  # rows per BlockGroup: the block kernels' vector lanes

    def forward(self, model: CModel, batch: CBatch) -> None:
        if self._forward(ctypes.byref(model), ctypes.byref(batch), torch.get_num_threads()) < 0:
            raise MemoryError("the native decoder could not allocate its work buffers")

    def gemm(self, x: torch.Tensor, matrix: PackedMatrix, kind: int) -> torch.Tensor:
        """x [M, K] (bf16 for bf16 weights, else fp32), contiguous -> fp32 [M, panels * 16]; kind: WEIGHTS_*."""
        y = torch.empty(x.shape[0], matrix.panels * PANEL, dtype=torch.float32)
        if self._gemm(x.data_ptr(), x.shape[0], ctypes.byref(matrix), kind, y.data_ptr(), y.shape[1],
                      torch.get_num_threads()) < 0:
            raise MemoryError("the native decoder could not allocate its quantized input")
        return y


    def argmax(self, x: torch.Tensor) -> list[int]:
        """torch.argmax(x, dim=1).tolist() for fp32 x [rows, cols] with unit column stride, ~20x faster."""
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
        return out.tolist()


# ---- packing ------------------------------------------------------------------------------------

def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> [ceil(N/16), K, 16]; bf16 -> [ceil(N/16), K/2, 16, 2] (K even). Zero rows pad N."""
    n, k = weight.shape
    pad = -n % PANEL
    if pad:
        weight = torch.cat([weight, weight.new_zeros(pad, k)])
    if weight.dtype == torch.bfloat16:
        return weight.view(-1, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return weight.view(-1, PANEL, k).transpose(1, 2).contiguous()


def packed_matrix(packed: torch.Tensor, rows: int) -> PackedMatrix:
    cols = packed.shape[1] * (2 if packed.dim() == 4 else 1)
    return PackedMatrix(packed.data_ptr(), rows, cols, packed.shape[0])


def block_matrix(groups: np.ndarray, rows: int, cols: int) -> PackedMatrix:
    """A matrix of GGUF block rows in groups: the table of BlockMatrix.groups."""
    return PackedMatrix(groups.ctypes.data, rows, cols, -(-rows // PANEL), groups.shape[0])


# ---- building and loading -----------------------------------------------------------------------

def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runnable_isas() -> list[Isa]:
    """The builds this CPU can run, best first."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags()
    return [isa for isa in ISAS if isa.cpu_flags <= flags]


@functools.cache
def load(isa_name: str | None = None) -> Library | None:
    """The best build for this CPU (or the named one), or None where none can run or be built."""
    if os.environ.get("TANDEM_NATIVE", "1") == "0":
        return None
    isa_name = isa_name or os.environ.get("TANDEM_NATIVE_ISA") or None
    for isa in runnable_isas():
        if isa_name in (None, isa.name):
            try:
                return Library(isa, _build(isa))
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("native CPU decoder: no %s build (%s)", isa.name, exc)
    return None


def _build(isa: Isa) -> Path:
    flags = (*_COMMON_FLAGS, *isa.gcc_flags)
    digest = hashlib.sha256(" ".join(flags).encode())
    for name in SOURCES:
        digest.update((SOURCE_DIR / name).read_bytes())
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem"
    target = cache / f"native_{isa.name}_{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(["gcc", *flags, str(SOURCE_DIR / "decoder.c"), "-o", str(built), "-lm"],
                       check=True, capture_output=True, timeout=300)
        os.replace(built, target)  # atomic: two services may build at once
    return target
