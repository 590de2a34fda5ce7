"""A small-M matrix multiply for x86 CPUs with AVX2 and FMA, built with gcc on first use.

Decoding, verifying k+1 draft tokens and batched decoding all multiply a few rows of
activations by every weight of the model, so a step costs what streaming the weights from
memory costs, if the kernel reads each weight once whatever the number of rows. MKL's sgemm
does not do that below M ~ 32 (measured here: M=8 costs 2-4x M=1) and ATen's bf16 matmul
without AVX512-BF16 costs M times M=1. This kernel packs weights in panels of 16 output
columns, [N / 16, K, 16], reads each panel once from memory, and keeps a K-block of it in L1
while tiles of up to six rows use it. For one or two rows it streams two panels far apart at
once: a single stream keeps too few cache misses in flight (measured 1.3-1.5x). bf16 weights
are widened to fp32 in registers; activations and accumulation are fp32.

The library is compiled by `gcc` into a per-user cache and loaded with ctypes (which drops the
GIL during the call). Where that fails, `load()` returns None and callers fall back to
F.linear.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PANEL = 16  # output columns per panel: two AVX2 vectors of fp32

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

#define NR 16                       /* output columns per panel */
#define KC 256                      /* K per block: panel blocks stay in L1 across row tiles */
#define PF 1024                     /* prefetch distance, bytes */
#define ROWBLOCK_BYTES (192 * 1024) /* rows of x per pass: they stay in L2 across panels */
#define DUAL_MAX_ROWS 2             /* up to here, two panels far apart are read at once */

typedef struct { __m256 lo, hi; } wpair;

static inline __attribute__((always_inline)) wpair load_f32(const char* p, int64_t k) {
    const float* w = (const float*)p + k * NR;
    _mm_prefetch((const char*)w + PF, _MM_HINT_T0);
    return (wpair){_mm256_loadu_ps(w), _mm256_loadu_ps(w + 8)};
}

/* A bf16 panel row holds columns j and j + 8 in one 32-bit word, low and high half. */
static inline __attribute__((always_inline)) wpair load_bf16(const char* p, int64_t k) {
    const uint16_t* w = (const uint16_t*)p + k * NR;
    _mm_prefetch((const char*)w + PF, _MM_HINT_T0);
    __m256i v = _mm256_loadu_si256((const __m256i*)w);
    __m256i hi = _mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000));
    return (wpair){_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), _mm256_castsi256_ps(hi)};
}

/* y[MR rows, NP panels] (+)= x[MR, k0:k1] @ panels[k0:k1]. Panel j starts j * pstep bytes
   after the first and owns y's columns from j * ystep on; y's rows are ldy apart. */
#define DEFINE_TILE(LOADW, NP, MR)                                                           \
static inline __attribute__((always_inline)) void tile_##LOADW##_##NP##_##MR(                \
    const float* x, int K, const char* panel, int64_t pstep, int ystep, int k0, int k1,      \
    float* y, int ldy) {                                                                     \
    __m256 acc[MR][2 * NP];                                                                  \
    for (int r = 0; r < MR; r++)                                                             \
        for (int j = 0; j < 2 * NP; j++)                                                     \
            acc[r][j] = k0 ? _mm256_loadu_ps(y + (int64_t)r * ldy + j / 2 * ystep + j % 2 * 8) \
                           : _mm256_setzero_ps();                                            \
    for (int k = k0; k < k1; k++) {                                                          \
        __m256 w[2 * NP];                                                                    \
        for (int j = 0; j < NP; j++) {                                                       \
            wpair pair = LOADW(panel + j * pstep, k);                                        \
            w[2 * j] = pair.lo;                                                              \
            w[2 * j + 1] = pair.hi;                                                          \
        }                                                                                    \
        for (int r = 0; r < MR; r++) {                                                       \
            __m256 xb = _mm256_broadcast_ss(x + (int64_t)r * K + k);                         \
            for (int j = 0; j < 2 * NP; j++) acc[r][j] = _mm256_fmadd_ps(xb, w[j], acc[r][j]); \
        }                                                                                    \
    }                                                                                        \
    for (int r = 0; r < MR; r++)                                                             \
        for (int j = 0; j < 2 * NP; j++)                                                     \
            _mm256_storeu_ps(y + (int64_t)r * ldy + j / 2 * ystep + j % 2 * 8, acc[r][j]);   \
}

/* NP panels from `panel` on, against all M rows: rows split evenly into tiles of at most
   6 rows for one panel (12 accumulators, 2 weights, 1 broadcast) or 2 for two (8 + 4 + 1),
   the K loop blocked so that each tile finds the panels in L1. */
#define DEFINE_PANELS(LOADW, NP, C1, C2, C3, C4, C5, C6)                                     \
static void panels_##LOADW##_##NP(const float* x, int M, int K, const char* panel,           \
                                  int64_t pstep, int ystep, float* y, int ldy) {              \
    int most = NP == 1 ? 6 : 2, tiles = (M + most - 1) / most;                               \
    for (int k0 = 0; k0 < K; k0 += KC) {                                                     \
        int k1 = k0 + KC < K ? k0 + KC : K;                                                  \
        for (int t = 0, m = 0; t < tiles; t++) {                                             \
            int mr = (M - m) / (tiles - t);                                                  \
            const float* xm = x + (int64_t)m * K;                                            \
            float* ym = y + (int64_t)m * ldy;                                                \
            m += mr;                                                                         \
            switch (mr) {                                                                    \
                case 1: C1; break; case 2: C2; break; case 3: C3; break;                     \
                case 4: C4; break; case 5: C5; break; default: C6; break;                    \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
}
#define TILE_CALL(LOADW, NP, MR) tile_##LOADW##_##NP##_##MR(xm, K, panel, pstep, ystep, k0, k1, ym, ldy)

#define DEFINE_GEMM(NAME, LOADW, ELEM)                                                       \
DEFINE_TILE(LOADW, 1, 1) DEFINE_TILE(LOADW, 1, 2) DEFINE_TILE(LOADW, 1, 3)                   \
DEFINE_TILE(LOADW, 1, 4) DEFINE_TILE(LOADW, 1, 5) DEFINE_TILE(LOADW, 1, 6)                   \
DEFINE_TILE(LOADW, 2, 1) DEFINE_TILE(LOADW, 2, 2)                                            \
DEFINE_PANELS(LOADW, 1, TILE_CALL(LOADW, 1, 1), TILE_CALL(LOADW, 1, 2), TILE_CALL(LOADW, 1, 3), \
              TILE_CALL(LOADW, 1, 4), TILE_CALL(LOADW, 1, 5), TILE_CALL(LOADW, 1, 6))        \
DEFINE_PANELS(LOADW, 2, TILE_CALL(LOADW, 2, 1), TILE_CALL(LOADW, 2, 2), , , , )               \
static void NAME##_rows(const float* x, int M, int K, const char* w, int N, int ldy, float* y) { \
    int panels = N / NR, p = 0;                                                              \
    int64_t bytes = (int64_t)K * NR * ELEM;                                                  \
    if (M <= DUAL_MAX_ROWS) { /* panels p and p + half together: two memory streams */       \
        int half = panels / 2;                                                               \
        for (; p < half; p++)                                                                \
            panels_##LOADW##_2(x, M, K, w + p * bytes, half * bytes, half * NR, y + p * NR, ldy); \
        p = 2 * half;                                                                        \
    }                                                                                        \
    for (; p < panels; p++)                                                                  \
        panels_##LOADW##_1(x, M, K, w + p * bytes, 0, 0, y + p * NR, ldy);                   \
}                                                                                            \
/* y[M, ldy]: this call fills columns [0, N) of each row; N a multiple of 16. */             \
void NAME(const float* x, int M, int K, const char* w, int N, int ldy, float* y) {           \
    int rows = (int)(ROWBLOCK_BYTES / ((int64_t)K * 4)) / 6 * 6;                              \
    if (rows < 6) rows = 6;                                                                  \
    for (int m = 0; m < M; m += rows)                                                        \
        NAME##_rows(x + (int64_t)m * K, M - m < rows ? M - m : rows, K, w, N, ldy, y + (int64_t)m * ldy); \
}

DEFINE_GEMM(tandem_gemm_f32, load_f32, 4)
DEFINE_GEMM(tandem_gemm_bf16, load_bf16, 2)
"""

_FLAGS = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC"]
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


class Gemm:
    """The loaded library: `gemm(x, packed)` over weights packed by `pack`.

    With torch.get_num_threads() > 1 the panels are split among that many threads (ctypes
    releases the GIL), so that a service given more cores uses them, as MKL would.
    """

    def __init__(self, lib: ctypes.CDLL):
        self._pool: ThreadPoolExecutor | None = None
        self._pool_workers = 0
        c_int, c_ptr = ctypes.c_int, ctypes.c_void_p
        args = [c_ptr, c_int, c_int, c_ptr, c_int, c_int, c_ptr]
        self._fns = {}
        for dtype, name in ((torch.float32, "tandem_gemm_f32"), (torch.bfloat16, "tandem_gemm_bf16")):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, None
            self._fns[dtype] = fn

    def __call__(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """x: [M, K] fp32 contiguous, packed: [N / 16, K, 16] -> [M, N] fp32."""
        m, k = x.shape
        panels = packed.shape[0]
        n = panels * PANEL
        y = torch.empty(m, n, dtype=torch.float32)
        fn = self._fns[packed.dtype]

        def run(p0: int, p1: int) -> None:  # panels [p0, p1)
            fn(x.data_ptr(), m, k, packed[p0].data_ptr(), (p1 - p0) * PANEL, n, y[:, p0 * PANEL].data_ptr())

        parts = min(torch.get_num_threads(), panels)
        bounds = [panels * i // parts for i in range(parts + 1)]
        others = [self._executor(parts).submit(run, bounds[i], bounds[i + 1]) for i in range(1, parts)]
        run(bounds[0], bounds[1])
        for future in others:
            future.result()
        return y

    def _executor(self, parts: int) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_workers < parts - 1:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(max_workers=parts - 1, thread_name_prefix="cpu-gemm")
            self._pool_workers = parts - 1
        return self._pool


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 or bf16 -> [ceil(N / 16), K, 16], zero rows padding N."""
    n, k = weight.shape
    pad = -n % PANEL
    if pad:
        weight = torch.cat([weight, weight.new_zeros(pad, k)])
    panels = weight.view(-1, PANEL, k).transpose(1, 2)  # [P, K, 16]
    if weight.dtype == torch.bfloat16:  # columns (j, j + 8) share a 32-bit word
        panels = panels.reshape(-1, k, 2, PANEL // 2).transpose(-1, -2).reshape(-1, k, PANEL)
    return panels.contiguous()


def packed_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows [T] of the weight that `pack` turned into `packed`: [T, K]."""
    column = rows % PANEL
    if packed.dtype == torch.bfloat16:  # column j + 8h sits at slot 2j + h
        column = column % (PANEL // 2) * 2 + column // (PANEL // 2)
    return packed[rows // PANEL, :, column]


def supports(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in _WEIGHT_DTYPES and weight.dim() == 2


@functools.cache
def load() -> Gemm | None:
    """The compiled kernel, or None where this CPU, this platform or the compiler can't have it."""
    if os.environ.get("TANDEM_CPU_GEMM", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    try:
        return Gemm(ctypes.CDLL(str(_build())))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("CPU gemm kernel unavailable, using F.linear: %s", exc)
        return None


def _build() -> Path:
    digest = hashlib.sha256((_SOURCE + " ".join(_FLAGS)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tandem"
    target = cache / f"cpu_gemm_{digest}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        source = Path(tmp) / "cpu_gemm.c"
        source.write_text(_SOURCE)
        built = Path(tmp) / target.name
        subprocess.run(["gcc", *_FLAGS, str(source), "-o", str(built)], check=True, capture_output=True,
                       timeout=120)
        os.replace(built, target)  # atomic: two services may build at once
    return target
