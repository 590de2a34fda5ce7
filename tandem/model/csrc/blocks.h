/* GGUF's block-quantized weights, multiplied in their blocks: Q4_0, Q4_1 and Q8_0 rows of
   32-weight blocks, each with an fp16 scale (and, for Q4_1, an fp16 minimum), and the K-quants
   Q4_K, Q5_K and Q6_K (superblocks of 256, below).

   Activations are quantized per block of 32 too, to int16 with an fp32 scale and the scaled sum
   of the values. A block's dot product is then exact integer arithmetic (vpmaddwd), scaled once:
     Q8_0:  dw * dx * sum(qw * qx)
     Q4_0:  dw * dx * sum(qw * qx) - 8 * dw * sx      (weights dw * (qw - 8))
     Q4_1:  dw * dx * sum(qw * qx) + mw * sx          (weights dw * qw + mw)
   with sx = dx * sum(qx). Why int16 and not llama.cpp's int8 (vpmaddubsw, twice the products per
   instruction): measured on SmolLM2-135M Q4_1, 12 held-out prompts, 64 greedy tokens, against
   HF transformers on the same file: int8 activations gave the same text on 2 of 12, int16 on
   11 of 12 (bf16 weights and activations: 8). On a Zen 1 core int8 decoded in 8.4 ms and
   verified 5 tokens in 17.6; int16 8.5 and 19.8. Int8 is an option (XBlock8, below;
   --block-activations int8): four bytes per vpdpbusd, for a KL divergence about 15 times bf16's.

   Rows are interleaved in groups of GROUP_ROWS (BlockGroup), so that a vector's lanes are that
   many output rows: 8 in an AVX2 vector, 16 in an AVX-512 one. A block's integer products need
   no horizontal sums, and its float work (one conversion, one multiply-add) is shared by the
   group. Each output element sums its blocks in order, in its own lane, whatever the number of
   activation rows, their tiling, the thread split or the vector width: a row's result does not
   depend on its batch, and AVX2 and AVX-512 builds give the same bits. A fused matrix (q|k|v)
   may mix types: each group has its own. The kernels are in block_kernels.h; AVX-512 VNNI's
   vpdpwssd does a multiply-add pair in one instruction where the build has it. */
#ifndef TANDEM_BLOCKS_H
#define TANDEM_BLOCKS_H

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define QBLOCK 32            /* weights per block */
#define XMAX 32767.0f        /* an activation block's largest magnitude, quantized */
#define BLOCK_TILE_ROWS 8    /* activation rows per tile: 8 int32 (Q6_K 16) and 8 float accumulators */
#define BLOCK_ROW_CHUNK 48   /* activation rows per pass over a matrix: 48 x K / 32 blocks of 72 (int8: 52) bytes */
#if defined(__AVX512F__)
#define GROUP_ROWS 16        /* weight rows per group: a vector's int32 lanes */
#else
#define GROUP_ROWS 8
#endif

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8 };  /* GGML's type numbers (K-quants below) */

/* One block of an activation row: x ~ d * q, s = d * sum(q). */
typedef struct {
    float d, s;
    int16_t q[QBLOCK];
} XBlock;

/* GROUP_ROWS (G) weight rows of one type, interleaved block by block (tandem/model/block_matrix.py
   packs them): for each block, the rows' G fp16 scales, for Q4_1 their G fp16 minimums, then
   the values in chunks of 4G bytes, each holding four bytes of every row:
     Q8_0: chunk c = weights 4c .. 4c + 3 of each row (8 chunks);
     Q4:   chunk c = bytes 4c .. 4c + 3 of each row's 16 (4 chunks): low nibbles are weights
           4c .., high nibbles 16 + 4c .. .
   The same bytes as the file's, reordered. A group of fewer rows (a part's last) is zero-padded. */
typedef struct {
    const uint8_t* data;
    int64_t type;
    int64_t first_row;  /* of the matrix */
    int64_t count;      /* rows that are real, 1 .. GROUP_ROWS */
} BlockGroup;

static inline float fp16_at(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* x [n] (n a multiple of 32) -> n / 32 blocks of int16; rounding to nearest even. */
static void quantize_row(const float* x, int n, XBlock* out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < n / QBLOCK; b++) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * QBLOCK + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        float d = top / XMAX, inv = top > 0.0f ? XMAX / top : 0.0f;
        __m256i q[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
            total = _mm256_add_epi32(total, q[i]);
        }
        for (int i = 0; i < 2; i++)
            _mm256_storeu_si256((__m256i*)out[b].q + i,  /* the permute undoes the pack's lane interleave */
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * i], q[2 * i + 1]), 0xd8));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        out[b].d = d;
        out[b].s = d * (float)_mm_cvtsi128_si32(t);
    }
}

/* One block of an activation row in int8 (WEIGHTS_BLOCKS_X8): x ~ d * q, s = d * sum(q), and the
   integer corrections that make the byte products exact sums of q times the weights: `q8_offset`
   (-128 * sum(q)) for Q8_0's weights moved to unsigned bytes, `q6_offset` (-32 times the sums
   of q's halves) for Q6_K's unsigned values. */
typedef struct {
    float d, s;
    int32_t q8_offset, q6_offset[2];
    int8_t q[QBLOCK];
} XBlock8;

#define XMAX8 127.0f
_Static_assert(offsetof(XBlock, s) == sizeof(float) && offsetof(XBlock8, s) == sizeof(float),
               "the kernels read a block's d and s as two neighbouring floats");

/* Bytes of one activation block: XBlock8 (x8) or XBlock. */
static inline int64_t xblock_bytes(int x8) { return x8 ? sizeof(XBlock8) : sizeof(XBlock); }

/* x [n] (n a multiple of 32) -> n / 32 blocks of int8; rounding to nearest even. */
static void quantize_row8(const float* x, int n, XBlock8* out) {
    for (int b = 0; b < n / QBLOCK; b++) {
        const float* v = x + b * QBLOCK;
        float top = 0.0f;
        for (int i = 0; i < QBLOCK; i++) top = fabsf(v[i]) > top ? fabsf(v[i]) : top;
        float d = top / XMAX8, inv = top > 0.0f ? XMAX8 / top : 0.0f;
        int32_t halves[2] = {0, 0};
        for (int i = 0; i < QBLOCK; i++) {
            int32_t q = (int32_t)nearbyintf(v[i] * inv);
            out[b].q[i] = (int8_t)q;
            halves[i / 16] += q;
        }
        out[b].d = d;
        out[b].s = d * (float)(halves[0] + halves[1]);
        out[b].q8_offset = -128 * (halves[0] + halves[1]);
        out[b].q6_offset[0] = -32 * halves[0];
        out[b].q6_offset[1] = -32 * halves[1];
    }
}

/* Bytes per block of one row, and where a group's block has its values. */
static inline int block_bytes(int type) { return type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : 34; }
static inline int values_at(int type) { return (type == GGML_Q4_1 ? 4 : 2) * GROUP_ROWS; }

/* A vpshufb pattern taking bytes (at, at + 1) of each 32-bit lane into the low (high = 0) or high
   (high = 1) byte of its two int16, zeros in the other. */
static inline __m256i widening(int at, int high) {
    int8_t pattern[32];
    for (int lane = 0; lane < 8; lane++)
        for (int k = 0; k < 2; k++) {
            int8_t byte = (int8_t)(lane % 4 * 4 + at + k);
            pattern[4 * lane + 2 * k] = high ? (int8_t)0x80 : byte;
            pattern[4 * lane + 2 * k + 1] = high ? byte : (int8_t)0x80;
        }
    return _mm256_loadu_si256((const __m256i*)pattern);
}

/* ---- K-quants: Q4_K, Q5_K, Q6_K superblocks of 256 weights ------------------------------------

   Decoded at load to their integers and interleaved per group of rows and superblock
   (tandem/model/k_quants.py): the rows' fp16 d (and dmin), their scales (and minimums) by
   sub-block, then eight windows of 32 weights, one per activation block: the
   weights' low nibbles in the chunk layout of Q4 blocks, and the bits above them in planes whose
   byte (row, t) holds, for Q5_K, bit 4 of weight 4k + t at bit k, and for Q6_K (two planes, k < 4
   and k >= 4) bits 4-5 of weight 4k + t at bits 2(k % 4). The same bits as the file's, and about
   its size (Q4_K +2.8%, Q5_K +2.3% for the unpacked six-bit scales; Q6_K the same).
   Weights: Q4_K and Q5_K d * sc * q - dmin * m per sub-block of 32; Q6_K d * sc * (q - 32) per
   sub-block of 16, two to a window. */
enum { GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };

static inline int is_k_quant(int64_t type) { return type >= GGML_Q4_K && type <= GGML_Q6_K; }
/* Per row of a group: bytes per superblock, per header (d, dmin, scales, minimums), per window. */
static inline int64_t super_bytes(int type) { return (type == GGML_Q4_K ? 148 : type == GGML_Q5_K ? 180 : 210) * GROUP_ROWS; }
static inline int header_bytes(int type) { return (type == GGML_Q6_K ? 18 : 20) * GROUP_ROWS; }
static inline int window_bytes(int type) { return (type == GGML_Q4_K ? 16 : type == GGML_Q5_K ? 20 : 24) * GROUP_ROWS; }

/* Weight v (0..255) of superblock s of row `lane` of a K-quant group, as gguf.quants.dequantize
   computes it. */
__attribute__((optimize("fp-contract=off"))) static float k_weight(const uint8_t* group, int type, int lane, int s,
                                                                   int v) {
    const int G = GROUP_ROWS;
    const uint8_t* super = group + s * super_bytes(type);
    int w = v / 32, j = v % 32, k = j / 4, t = j % 4;
    const uint8_t* window = super + header_bytes(type) + w * window_bytes(type);
    uint8_t byte = window[(j % 16 / 4) * 4 * G + lane * 4 + t];
    int q = j < 16 ? byte & 0x0f : byte >> 4;
    if (type == GGML_Q5_K) q |= (window[16 * G + lane * 4 + t] >> k & 1) << 4;
    if (type == GGML_Q6_K) q |= (window[(k < 4 ? 16 : 20) * G + lane * 4 + t] >> (2 * (k % 4)) & 3) << 4;
    float d = fp16_at(super + 2 * lane);
    if (type == GGML_Q6_K) {
        float scale = d * (float)((const int8_t*)(super + 2 * G))[(v / 16) * G + lane];
        return scale * (float)(q - 32);
    }
    float scale = d * (float)super[4 * G + w * G + lane];
    float min = fp16_at(super + 2 * G + 2 * lane) * (float)super[12 * G + w * G + lane];
    return scale * (float)q - min;
}

/* Fetching a group's weights ahead of the products. With a few activation rows a block's products
   take longer than memory's latency is hidden for: out-of-order execution reaches about one block
   ahead, and a block of 16 rows spans 5 to 9 cache lines, so the stream stalls unless every line
   is fetched PREFETCH_BLOCKS blocks ahead (K-quants: that many blocks' superblocks). Measured on
   Zen 4, 5 rows, Q4_1: 57 -> 79 GMAC/s at K = 2048 and 8192, level at K = 576. One row (a decode)
   streams faster with one line 4 blocks ahead and the hardware's prefetcher, and two rows at
   K = 576 lost 12-20% with whole blocks 2, 4 or 8 ahead. */
#define PREFETCH_BLOCKS 8
#define WHOLE_PREFETCH_ROWS 3

static inline __attribute__((always_inline)) void prefetch_span(const uint8_t* p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at);
}

/* For the kernel of `rows` rows at a group's block of `size` bytes (all rows). */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t* block, int64_t size, const int rows) {
    if (rows >= WHOLE_PREFETCH_ROWS) prefetch_span(block + PREFETCH_BLOCKS * size, size);
    else __builtin_prefetch(block + 4 * size);
}

/* A kernel for `rows` activation rows: (group, blocks, x (XBlock or XBlock8), ldx, y, ldy). */
typedef void (*group_dot_fn)(const uint8_t*, int, const void*, int64_t, float*, int64_t);

#if GROUP_ROWS == 16
#define VI __m512i
#define VF __m512
#define OP(name) _mm512_##name
#define SI(name) _mm512_##name##_si512
#define CHUNK(p) _mm512_loadu_si512((const void*)(p))
#define HALF(p) _mm256_loadu_si256((const __m256i*)(p))
#define EIGHT(p) _mm_loadu_si128((const __m128i*)(p))
#define CVT_PH _mm512_cvtph_ps
#define CVT_U8 _mm512_cvtepu8_epi32
#define CVT_I8 _mm512_cvtepi8_epi32
#define WIDE(v) _mm512_broadcast_i64x4(v)
#define SIGN8(x, w) _mm512_mask_sub_epi8((x), _mm512_movepi8_mask(w), _mm512_setzero_si512(), (x))
#else
#define VI __m256i
#define VF __m256
#define OP(name) _mm256_##name
#define SI(name) _mm256_##name##_si256
#define CHUNK(p) _mm256_loadu_si256((const __m256i*)(p))
#define HALF(p) _mm_loadu_si128((const __m128i*)(p))
#define EIGHT(p) _mm_loadl_epi64((const __m128i*)(p))
#define CVT_PH _mm256_cvtph_ps
#define CVT_U8 _mm256_cvtepu8_epi32
#define CVT_I8 _mm256_cvtepi8_epi32
#define WIDE(v) (v)
#define SIGN8(x, w) _mm256_sign_epi8((x), (w))
#endif
#include "block_kernels.h"

/* One group's rows for all M activation rows (x: [M, nblocks] XBlock, or XBlock8 if x8), in even
   tiles of at most BLOCK_TILE_ROWS: the group's blocks are read from memory once and stay in L1
   while the tiles pass. */
static void group_rows(const BlockGroup* g, const void* x, int x8, int M, int nblocks, float* y, int ldy) {
    const group_dot_fn* kernels = group_dots(g->type, x8);
    int tiles = (M + BLOCK_TILE_ROWS - 1) / BLOCK_TILE_ROWS;
    float out[BLOCK_TILE_ROWS][GROUP_ROWS];
    for (int t = 0, m = 0; t < tiles; t++) {
        int tile = (M - m) / (tiles - t);
        float* ym = y + (int64_t)m * ldy + g->first_row;
        const void* xm = (const uint8_t*)x + (int64_t)m * nblocks * xblock_bytes(x8);
        if (g->count == GROUP_ROWS) {
            kernels[tile](g->data, nblocks, xm, nblocks, ym, ldy);
        } else {
            kernels[tile](g->data, nblocks, xm, nblocks, out[0], GROUP_ROWS);
            for (int r = 0; r < tile; r++) memcpy(ym + (int64_t)r * ldy, out[r], sizeof(float) * g->count);
        }
        m += tile;
    }
}

/* Output columns [n0, n1) of y for all M activation rows (x: [M, K / 32] blocks): the groups whose
   first row is in the range (a group is computed whole by the thread that has its first row, so
   threads write disjoint rows). A prefill's rows go in chunks whose blocks stay in L2 while every
   group passes over them. */
static void gemm_blocks_range(const void* x, int x8, int M, int K, const BlockGroup* groups, int num_groups, int n0,
                              int n1, float* y, int ldy) {
    int nblocks = K / QBLOCK;
    for (int m = 0; m < M; m += BLOCK_ROW_CHUNK) {
        int rows = M - m < BLOCK_ROW_CHUNK ? M - m : BLOCK_ROW_CHUNK;
        const void* xm = (const uint8_t*)x + (int64_t)m * nblocks * xblock_bytes(x8);
        for (int i = 0; i < num_groups; i++)
            if (groups[i].first_row >= n0 && groups[i].first_row < n1)
                group_rows(groups + i, xm, x8, rows, nblocks, y + (int64_t)m * ldy, ldy);
    }
}

/* Row n of a matrix of groups back to fp32, as gguf.quants.dequantize computes it (a product, then
   a sum: no fused multiply-add). */
__attribute__((optimize("fp-contract=off"))) static void dequantize_row(const BlockGroup* groups, int num_groups,
                                                                        int64_t n, int cols, float* out) {
    int lo = 0, hi = num_groups - 1;
    while (lo < hi) {  /* the last group whose first row is <= n */
        int mid = (lo + hi + 1) / 2;
        if (groups[mid].first_row <= n) lo = mid;
        else hi = mid - 1;
    }
    const BlockGroup* g = groups + lo;
    int lane = (int)(n - g->first_row), type = (int)g->type;
    if (is_k_quant(type)) {
        for (int v = 0; v < cols; v++) out[v] = k_weight(g->data, type, lane, v / 256, v % 256);
        return;
    }
    const int G = GROUP_ROWS;
    int64_t size = G * block_bytes(type);
    for (int b = 0; b < cols / QBLOCK; b++) {
        const uint8_t* block = g->data + b * size;
        const uint8_t* values = block + values_at(type);
        float d = fp16_at(block + 2 * lane);
        float* o = out + b * QBLOCK;
        if (type == GGML_Q8_0) {
            for (int i = 0; i < QBLOCK; i++) o[i] = (float)(int8_t)values[(i / 4) * 4 * G + lane * 4 + i % 4] * d;
            continue;
        }
        float offset = type == GGML_Q4_1 ? 0.0f : -8.0f, min = type == GGML_Q4_1 ? fp16_at(block + 2 * G + 2 * lane) : 0.0f;
        for (int i = 0; i < QBLOCK / 2; i++) {
            uint8_t byte = values[(i / 4) * 4 * G + lane * 4 + i % 4];
            o[i] = ((float)(byte & 0x0f) + offset) * d + min;
            o[i + QBLOCK / 2] = ((float)(byte >> 4) + offset) * d + min;
        }
    }
}

#endif
