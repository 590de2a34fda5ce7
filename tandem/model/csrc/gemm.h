/* y[M, N] = x[M, K] @ W^T for weights packed in panels of 16 output columns, reading each weight
   once from memory whatever M is: decoding, verifying k+1 drafts and small batches all cost what
   streaming the weights costs.

   Layouts (tandem/model/native.py packs them):
     fp32: [N/16, K, 16]        panel p, row k holds W[16p .. 16p+15, k]
     bf16: [N/16, K/2, 16, 2]   panel p, row k/2 holds the pairs (W[n, k], W[n, k+1]) for its 16 n:
                                the operand layout of AVX-512 BF16's vdpbf16ps.
   For bf16 weights x comes as bf16 too, [M, K] (pairs of k in each 32-bit word). With AMX the
   tile unit multiplies (see gemm_amx_range); with avx512_bf16 one vdpbf16ps multiplies a pair;
   elsewhere the pair is widened to two fp32 vectors in registers. Accumulation is fp32. Every output element is summed over k in the same order whatever M, the
   row tiling or the thread split, so a row's result does not depend on what it is batched with. */
#ifndef TANDEM_GEMM_H
#define TANDEM_GEMM_H

#include "blocks.h"
#include "vec.h"
#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
#include <immintrin.h>
#endif

#define PANEL 16
/* Tiles of up to MAX_TILE_ROWS rows and one panel, or up to WIDE_TILE_ROWS rows and WIDE_PANELS
   panels: accumulators, weights and a broadcast must fit the vector registers. */
#if defined(__AVX512F__)
#define WIDE_PANELS 4     /* 6 rows x 4 panels = 24 of 32 zmm */
#define WIDE_TILE_ROWS 6
#define MAX_TILE_ROWS 6
#else                     /* AVX2: a vf is two ymm, 16 ymm in all */
#define WIDE_PANELS 2     /* 2 rows x 2 panels = 8 ymm; two weight streams for decoding */
#define WIDE_TILE_ROWS 2
#define MAX_TILE_ROWS 4   /* 4 rows x 1 panel = 8 ymm */
#endif
#define K_BLOCK 128     /* k (fp32) or k pairs (bf16) per block: a tile's panels stay in L1 */
#define PREFETCH_ROWS 16

static inline vf load_acc(const float* y, int k0) { return k0 ? v_load(y) : v_splat(0.0f); }

/* acc += x * w over one k (fp32) or one k pair (bf16). For bf16, x and w hold pairs of bf16 in
   each 32-bit lane, carried in float vectors as bits only. */
#define FMA_f32(acc, xb, wv) ((acc) += (xb) * (wv))
#if defined(__AVX512BF16__)
#define FMA_bf16(acc, xb, wv) \
    ((acc) = (vf)_mm512_dpbf16_ps((__m512)(acc), (__m512bh)(xb), (__m512bh)(wv)))
#else /* widen each half of the pair to fp32: the high half is a bf16 in place, the low one shifted up */
#define FMA_bf16(acc, xb, wv) do {                                                                \
        const vu high_ = (vu)v_splat_i(-65536);                                                  \
        (acc) += (vf)((vu)(xb) & high_) * (vf)((vu)(wv) & high_);                                \
        (acc) += (vf)((vu)(xb) << 16) * (vf)((vu)(wv) << 16);                                    \
    } while (0)
#endif

/* y[MR rows, NP panels] (+)= x[MR, k0:k1] @ panels[k0:k1]; y's rows are ldy apart, x's ldx.
   A panel row is PANEL / LANES vectors: one zmm, or two ymm. */
#define VECS (PANEL / LANES)
#define DEFINE_TILE(KIND, MR, NP) DEFINE_TILE_(KIND, MR, NP)
#define DEFINE_TILE_(KIND, MR, NP)                                                                \
static inline __attribute__((always_inline)) void tile_##KIND##_##MR##_##NP(                      \
    const float* x, int ldx, const float* w, int64_t pstride, int k0, int k1, float* y, int ldy) { \
    vf acc[MR][NP * VECS];                                                                        \
    for (int r = 0; r < MR; r++)                                                                  \
        for (int j = 0; j < NP * VECS; j++)                                                       \
            acc[r][j] = load_acc(y + (int64_t)r * ldy + j / VECS * PANEL + j % VECS * LANES, k0);  \
    for (int k = k0; k < k1; k++) {                                                               \
        vf wv[NP * VECS];                                                                         \
        for (int j = 0; j < NP; j++) {                                                            \
            const float* p = w + j * pstride + (int64_t)k * PANEL;                                \
            __builtin_prefetch(p + PREFETCH_ROWS * PANEL);                                        \
            for (int h = 0; h < VECS; h++) wv[j * VECS + h] = v_load(p + h * LANES);              \
        }                                                                                         \
        for (int r = 0; r < MR; r++) {                                                            \
            vf xb = v_splat(x[(int64_t)r * ldx + k]);                                             \
            for (int j = 0; j < NP * VECS; j++) FMA_##KIND(acc[r][j], xb, wv[j]);                 \
        }                                                                                         \
    }                                                                                             \
    for (int r = 0; r < MR; r++)                                                                  \
        for (int j = 0; j < NP * VECS; j++)                                                       \
            v_store(y + (int64_t)r * ldy + j / VECS * PANEL + j % VECS * LANES, acc[r][j]);       \
}
#define DEFINE_TILES(KIND, NP)                                                                    \
    DEFINE_TILE(KIND, 1, NP) DEFINE_TILE(KIND, 2, NP) DEFINE_TILE(KIND, 3, NP)                    \
    DEFINE_TILE(KIND, 4, NP) DEFINE_TILE(KIND, 5, NP) DEFINE_TILE(KIND, 6, NP)
DEFINE_TILES(f32, WIDE_PANELS)
#if WIDE_PANELS > 1
DEFINE_TILES(f32, 1)
#endif
#if defined(__AVX512F__) && !defined(__AMX_BF16__)  /* AVX2 widens bf16 pairs its own way, below */
DEFINE_TILES(bf16, WIDE_PANELS)
DEFINE_TILES(bf16, 1)
#endif

#define TILE_SWITCH(KIND, NP, ARGS) TILE_SWITCH_(KIND, NP, ARGS)
#define TILE_SWITCH_(KIND, NP, ARGS)                                                              \
    switch (rows) {                                                                               \
        case 1: tile_##KIND##_1_##NP ARGS; break;                                                 \
        case 2: tile_##KIND##_2_##NP ARGS; break;                                                 \
        case 3: tile_##KIND##_3_##NP ARGS; break;                                                 \
        case 4: tile_##KIND##_4_##NP ARGS; break;                                                 \
        case 5: tile_##KIND##_5_##NP ARGS; break;                                                 \
        default: tile_##KIND##_6_##NP ARGS; break;                                                \
    }

/* The panels [p0, p1) of y for all M rows. `kdepth` is K (fp32) or K/2 (bf16 pairs); x rows are
   kdepth elements apart, y rows ldy floats apart. Rows go in even tiles of at most six; with
   more than one tile the k loop is blocked so that later tiles find the panels in L1. */
#define DEFINE_GEMM_RANGE(KIND)                                                                   \
static void gemm_##KIND##_range(const float* x, int M, int kdepth, const float* w, int p0, int p1, \
                                float* y, int ldy) {                                              \
    int64_t pstride = (int64_t)kdepth * PANEL;                                                    \
    int tiles = (M + MAX_TILE_ROWS - 1) / MAX_TILE_ROWS;                                          \
    int kblock = tiles == 1 ? kdepth : K_BLOCK;                                                   \
    int wide = M <= WIDE_TILE_ROWS || MAX_TILE_ROWS == WIDE_TILE_ROWS;                            \
    for (int p = p0; p < p1;) {                                                                   \
        int np = wide && p1 - p >= WIDE_PANELS ? WIDE_PANELS : 1;                                 \
        const float* wp = w + p * pstride;                                                        \
        for (int k0 = 0; k0 < kdepth; k0 += kblock) {                                             \
            int k1 = k0 + kblock < kdepth ? k0 + kblock : kdepth;                                 \
            for (int t = 0, m = 0; t < tiles; t++) {                                              \
                int rows = (M - m) / (tiles - t);                                                 \
                const float* xm = x + (int64_t)m * kdepth;                                        \
                float* ym = y + (int64_t)m * ldy + p * PANEL;                                     \
                m += rows;                                                                        \
                if (np == WIDE_PANELS) {                                                          \
                    TILE_SWITCH(KIND, WIDE_PANELS, (xm, kdepth, wp, pstride, k0, k1, ym, ldy))     \
                } else {                                                                          \
                    TILE_SWITCH(KIND, 1, (xm, kdepth, wp, pstride, k0, k1, ym, ldy))               \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        p += np;                                                                                  \
    }                                                                                             \
}
DEFINE_GEMM_RANGE(f32)
#if defined(__AVX512F__) && !defined(__AMX_BF16__)
DEFINE_GEMM_RANGE(bf16)
#endif

#if !defined(__AVX512F__)
/* AVX2 has no bf16 arithmetic: a weight pair is widened to two fp32 vectors (the high half by a
   mask, the low one by a shift), and those operations take issue slots from the FMAs, which on
   cores with one 256-bit FMA per cycle (Zen 1) are what a verify step is bound by. So x is
   widened once per call, and each weight vector once per tile for all its rows: tiles of up to
   five rows and one panel (ten accumulators, two widened halves and a broadcast fill the 16
   ymm), or of one or two rows and two panels (two weight streams for decoding). Each output
   element still takes its FMAs in the order of the pair layout (k+1, then k, pair by pair), so
   results do not depend on the tiling. Measured on a Zen 1 core, all of SmolLM2-135M's matrices:
   2 rows 1.24x one row's time (was 1.50x), 5 rows 2.5x (was 3.4x). */
#define PAIR_TILE_ROWS 5
#define PAIR_ROW_BLOCK 10  /* rows of x widened at once, on the stack */

/* y[MR rows, NP panels] (+)= xw[MR, k0:k1] @ panels[k0:k1]; xw holds each pair widened, high half
   first ([rows, 2 * kdepth] fp32, rows ldx apart). */
#define DEFINE_PAIR_TILE(MR, NP)                                                                  \
static inline __attribute__((always_inline)) void pair_tile_##MR##_##NP(                          \
    const float* xw, int ldx, const float* w, int64_t pstride, int k0, int k1, float* y, int ldy) { \
    const vu high = (vu)v_splat_i(-65536);                                                        \
    vf acc[MR][NP * VECS];                                                                        \
    for (int r = 0; r < MR; r++)                                                                  \
        for (int j = 0; j < NP * VECS; j++) acc[r][j] = load_acc(y + (int64_t)r * ldy + j * LANES, k0); \
    for (int k = k0; k < k1; k++) {                                                               \
        vu pairs[NP * VECS];                                                                      \
        vf half[NP * VECS];                                                                       \
        for (int j = 0; j < NP; j++) {                                                            \
            const float* p = w + j * pstride + (int64_t)k * PANEL;                                \
            __builtin_prefetch(p + PREFETCH_ROWS * PANEL);                                        \
            for (int h = 0; h < VECS; h++) pairs[j * VECS + h] = (vu)v_load(p + h * LANES);       \
        }                                                                                         \
        for (int j = 0; j < NP * VECS; j++) half[j] = (vf)(pairs[j] & high);                      \
        for (int r = 0; r < MR; r++) {                                                            \
            vf xb = v_splat(xw[(int64_t)r * ldx + 2 * k]);                                        \
            for (int j = 0; j < NP * VECS; j++) acc[r][j] += xb * half[j];                        \
        }                                                                                         \
        for (int j = 0; j < NP * VECS; j++) half[j] = (vf)(pairs[j] << 16);                       \
        for (int r = 0; r < MR; r++) {                                                            \
            vf xb = v_splat(xw[(int64_t)r * ldx + 2 * k + 1]);                                    \
            for (int j = 0; j < NP * VECS; j++) acc[r][j] += xb * half[j];                        \
        }                                                                                         \
    }                                                                                             \
    for (int r = 0; r < MR; r++)                                                                  \
        for (int j = 0; j < NP * VECS; j++) v_store(y + (int64_t)r * ldy + j * LANES, acc[r][j]); \
}
DEFINE_PAIR_TILE(1, 1) DEFINE_PAIR_TILE(2, 1) DEFINE_PAIR_TILE(3, 1) DEFINE_PAIR_TILE(4, 1)
DEFINE_PAIR_TILE(5, 1) DEFINE_PAIR_TILE(1, 2) DEFINE_PAIR_TILE(2, 2)

/* Rows [0, M <= PAIR_ROW_BLOCK) of widened x, panels [p0, p1): two-panel tiles for one or two
   rows, else even tiles of at most five rows, the k loop blocked when there are several. */
static void pair_rows(const float* xw, int M, int kdepth, const float* w, int p0, int p1, float* y, int ldy) {
    int64_t pstride = (int64_t)kdepth * PANEL;
    int ldx = 2 * kdepth, tiles = (M + PAIR_TILE_ROWS - 1) / PAIR_TILE_ROWS;
    int kblock = tiles == 1 ? kdepth : K_BLOCK;
    for (int p = p0; p < p1;) {
        int np = M <= 2 && p1 - p >= 2 ? 2 : 1;
        const float* wp = w + p * pstride;
        for (int k0 = 0; k0 < kdepth; k0 += kblock) {
            int k1 = k0 + kblock < kdepth ? k0 + kblock : kdepth;
            for (int t = 0, m = 0; t < tiles; t++) {
                int rows = (M - m) / (tiles - t);
                const float* xm = xw + (int64_t)m * ldx;
                float* ym = y + (int64_t)m * ldy + p * PANEL;
                m += rows;
                if (np == 2) {
                    if (rows == 1) pair_tile_1_2(xm, ldx, wp, pstride, k0, k1, ym, ldy);
                    else pair_tile_2_2(xm, ldx, wp, pstride, k0, k1, ym, ldy);
                    continue;
                }
                switch (rows) {
                    case 1: pair_tile_1_1(xm, ldx, wp, pstride, k0, k1, ym, ldy); break;
                    case 2: pair_tile_2_1(xm, ldx, wp, pstride, k0, k1, ym, ldy); break;
                    case 3: pair_tile_3_1(xm, ldx, wp, pstride, k0, k1, ym, ldy); break;
                    case 4: pair_tile_4_1(xm, ldx, wp, pstride, k0, k1, ym, ldy); break;
                    default: pair_tile_5_1(xm, ldx, wp, pstride, k0, k1, ym, ldy); break;
                }
            }
        }
        p += np;
    }
}

/* x is bf16 pairs [M, kdepth] (one 32-bit word each); widened in blocks of rows, high half first. */
static void gemm_bf16_range(const float* x, int M, int kdepth, const float* w, int p0, int p1, float* y, int ldy) {
    for (int m0 = 0; m0 < M; m0 += PAIR_ROW_BLOCK) {
        int rows = M - m0 < PAIR_ROW_BLOCK ? M - m0 : PAIR_ROW_BLOCK;
        float xw[rows * 2 * kdepth];
        const float* src = x + (int64_t)m0 * kdepth;
        for (int64_t i = 0; i < (int64_t)rows * kdepth; i++) {
            uint32_t pair, high, low;
            memcpy(&pair, src + i, 4);
            high = pair & 0xffff0000u, low = pair << 16;
            memcpy(xw + 2 * i, &high, 4);
            memcpy(xw + 2 * i + 1, &low, 4);
        }
        pair_rows(xw, rows, kdepth, w, p0, p1, y + (int64_t)m0 * ldy, ldy);
    }
}
#endif

#if defined(__AMX_BF16__)
/* AMX: bf16 weights go through the tile unit for every M, M = 1 included: at M = 1 it streams
   weights as fast as AVX-512 BF16 does (measured here: 23 ms against 24 ms for all of
   SmolLM2-135M's matrices), at M = 16 it is 2.7x faster, and a row's result does not depend on
   how many rows share the call, which mixing AMX for large M with AVX-512 for small M would
   break (AMX sums each 32-product block its own way).
   Tiles: 0, 1 = C (two panels), 2 = A (x rows, 32 k), 3, 4 = B (two panels, 32 k), and for a K
   that is not a multiple of 32, 5 = A and 6, 7 = B of the remainder. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static void amx_configure(int rows, int tail_k) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 5; t++) {
        cfg.rows[t] = t < 3 ? rows : 16;
        cfg.colsb[t] = 64;
    }
    if (tail_k) {
        cfg.rows[5] = rows, cfg.colsb[5] = tail_k * 2;
        cfg.rows[6] = cfg.rows[7] = tail_k / 2, cfg.colsb[6] = cfg.colsb[7] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* One block of k from k0 into C tiles 0 (panel b0) and 1 (panel b1, when `two`): A in tile a, B in
   tiles b0t and b1t. A macro, not a function: tile numbers must be compile-time immediates. */
#define AMX_K_BLOCK(k0, a, b0t, b1t)                              \
    do {                                                          \
        _tile_loadd(a, x + (k0), K * 2);                          \
        _tile_loadd(b0t, b0 + (int64_t)(k0) * PANEL, 64);         \
        _tile_dpbf16ps(0, a, b0t);                                \
        if (two) {                                                \
            _tile_loadd(b1t, b1 + (int64_t)(k0) * PANEL, 64);     \
            _tile_dpbf16ps(1, a, b1t);                            \
        }                                                         \
    } while (0)

/* Panels [p0, p1) for rows [0, rows <= 16) of x, bf16 [*, K] with rows K apart. */
static void amx_row_tile(const uint16_t* x, int K, const uint16_t* w, int p0, int p1, float* y, int ldy) {
    int64_t pstride = (int64_t)K * PANEL;  /* uint16 per panel */
    int full_k = K / 32 * 32;
    for (int p = p0; p < p1; p += 2) {
        int two = p + 1 < p1;
        const uint16_t* b0 = w + p * pstride;
        const uint16_t* b1 = b0 + (two ? pstride : 0);
        _tile_zero(0);
        _tile_zero(1);
        for (int k = 0; k < full_k; k += 32) AMX_K_BLOCK(k, 2, 3, 4);
        if (full_k < K) AMX_K_BLOCK(full_k, 5, 6, 7);
        _tile_stored(0, y + p * PANEL, ldy * 4);
        if (two) _tile_stored(1, y + (p + 1) * PANEL, ldy * 4);
    }
}

static void gemm_amx_range(const uint16_t* x, int M, int K, const uint16_t* w, int p0, int p1, float* y, int ldy) {
    int tail_k = K % 32, configured = 0;
    for (int m = 0; m < M; m += 16) {
        int rows = M - m < 16 ? M - m : 16;
        if (rows != configured) amx_configure(rows, tail_k);
        configured = rows;
        amx_row_tile(x + (int64_t)m * K, K, w, p0, p1, y + (int64_t)m * ldy, ldy);
    }
    _tile_release();
}
#endif

/* How a model's matrices are stored, and so what their input rows are. */
enum { WEIGHTS_F32 = 0, WEIGHTS_BF16 = 1, WEIGHTS_BLOCKS = 2, WEIGHTS_BLOCKS_X8 = 3 };

/* Block weights, whose inputs are XBlock (int16) or XBlock8 (int8, WEIGHTS_BLOCKS_X8). */
static inline int is_blocks(int kind) { return kind == WEIGHTS_BLOCKS || kind == WEIGHTS_BLOCKS_X8; }

/* One matrix of the model: packed weights (fp32, bf16) or groups of block rows, and its sizes. */
typedef struct {
    const void* data;  /* panels, or BlockGroup [groups] in row order */
    int rows;    /* N, output features */
    int cols;    /* K, input features */
    int panels;  /* ceil(N / 16) */
    int groups;  /* block groups; 0 for panels */
} PackedMatrix;

/* Panels [p0, p1) of y. x is fp32 [M, K] for fp32 weights, bf16 pairs [M, K/2] for bf16 weights,
   XBlock or XBlock8 [M, K / 32] for block rows (whose padding columns past N come out 0). */
static void gemm_range(const void* x, int M, const PackedMatrix* w, int kind, int p0, int p1, float* y, int ldy) {
    if (p0 >= p1) return;
    if (is_blocks(kind)) {
        int n1 = p1 * PANEL < w->rows ? p1 * PANEL : w->rows;
        gemm_blocks_range(x, kind == WEIGHTS_BLOCKS_X8, M, w->cols, (const BlockGroup*)w->data, w->groups,
                          p0 * PANEL, n1, y, ldy);
        for (int m = 0; m < M; m++)
            for (int n = n1; n < p1 * PANEL; n++) y[(int64_t)m * ldy + n] = 0.0f;
        return;
    }
#if defined(__AMX_BF16__)
    if (kind == WEIGHTS_BF16) {
        gemm_amx_range((const uint16_t*)x, M, w->cols, (const uint16_t*)w->data, p0, p1, y, ldy);
        return;
    }
#else
    if (kind == WEIGHTS_BF16) {
        gemm_bf16_range((const float*)x, M, w->cols / 2, (const float*)w->data, p0, p1, y, ldy);
        return;
    }
#endif
    gemm_f32_range((const float*)x, M, w->cols, (const float*)w->data, p0, p1, y, ldy);
}

#endif
