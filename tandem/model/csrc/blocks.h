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
   verified 5 tokens in 17.6; int16 8.5 and 19.8.

   Rows are interleaved in groups of eight (BlockGroup), so that a vector's lanes are eight output
   rows: a block's integer products need no horizontal sums, and its float work (one conversion,
   one multiply-add) is shared by the eight. Each output element sums its blocks in order, in its
   own lane, whatever the number of activation rows, their tiling or the thread split: a row's
   result does not depend on its batch. A fused matrix (q|k|v) may mix types: each group has its
   own. AVX2 only: every build of the decoder has it. */
#ifndef TANDEM_BLOCKS_H
#define TANDEM_BLOCKS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define QBLOCK 32            /* weights per block */
#define XMAX 32767.0f        /* an activation block's largest magnitude, quantized */
#define BLOCK_TILE_ROWS 8    /* activation rows per tile: 6 int32 and 6 float accumulators */
#define BLOCK_ROW_CHUNK 48   /* activation rows per pass over a matrix: 48 x K / 32 blocks of 72 bytes */

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8 };  /* GGML's type numbers (K-quants below) */

/* One block of an activation row: x ~ d * q, s = d * sum(q). */
typedef struct {
    float d, s;
    int16_t q[QBLOCK];
} XBlock;

/* Eight weight rows of one type, interleaved block by block (tandem/model/block_matrix.py packs
   them): for each block, the rows' eight fp16 scales, for Q4_1 their eight fp16 minimums, then
   the values in 32-byte chunks, each holding four bytes of every row:
     Q8_0: chunk c = weights 4c .. 4c + 3 of each row (8 chunks);
     Q4:   chunk c = bytes 4c .. 4c + 3 of each row's 16 (4 chunks): low nibbles are weights
           4c .., high nibbles 16 + 4c .. .
   The same bytes as the file's, reordered. A group of fewer rows (a part's last) is zero-padded. */
typedef struct {
    const uint8_t* data;
    int64_t type;
    int64_t first_row;  /* of the matrix */
    int64_t count;      /* rows that are real, 1 .. 8 */
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

/* Block sizes in bytes. */
static inline int block_bytes(int type) { return type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : 34; }

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

/* sums[r] += the eight rows' int16 weight pairs v[i] times x[r]'s pair `first + i`, for count pairs. */
static inline __attribute__((always_inline)) void pair_products(const __m256i* v, int count, int first,
                                                               const XBlock* x, int64_t ldx, int rows, __m256i* sums) {
    for (int i = 0; i < count; i++)
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x[r * ldx].q + 2 * (first + i), 4);
            sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(v[i], _mm256_set1_epi32(pair)));
        }
}

/* y[r * ldy + i] = row i . x[r] for a group's eight weight rows (lane i of each vector is row i)
   and `rows` activation rows, blocks ldx apart. Per block, the weights are widened to int16 once,
   as 16 vectors of the eight rows' pairs (2j, 2j + 1); each pair of x is broadcast and multiplied
   by one of them in a vpmaddwd, summing into int32 lanes, so the rows need no horizontal sums and
   one multiply-add scales all eight. */
static inline __attribute__((always_inline)) void group_dot(
    const uint8_t* group, int nblocks, const XBlock* x, int64_t ldx, float* y, int64_t ldy, const int rows,
    const int type) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    /* per 32-bit lane: bytes (0, 1) or (2, 3) into the low halves of two int16, or, for signed
       bytes, into the high halves (then shifted down with their sign) */
    const __m256i first = widening(0, 0), second = widening(2, 0);
    const __m256i first_high = widening(0, 1), second_high = widening(2, 1);
    const int64_t size = 8 * block_bytes(type);
    __m256 acc[BLOCK_TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nblocks; b++) {
        const uint8_t* block = group + b * size;
        __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)block)), cw = dw;
        const uint8_t* qs = block + (type == GGML_Q4_1 ? 32 : 16);
        __m256i sums[BLOCK_TILE_ROWS];
        for (int r = 0; r < rows; r++) sums[r] = _mm256_setzero_si256();
        if (type == GGML_Q8_0) {
            for (int c = 0; c < 8; c++) {  /* weights 4c .. 4c + 3 */
                __m256i w = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
                __m256i v[2] = {_mm256_srai_epi16(_mm256_shuffle_epi8(w, first_high), 8),
                                _mm256_srai_epi16(_mm256_shuffle_epi8(w, second_high), 8)};
                pair_products(v, 2, 2 * c, x + b, ldx, rows, sums);
            }
        } else {
            cw = type == GGML_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(block + 16)))
                                   : _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
            for (int c = 0; c < 4; c++) {  /* weights 4c .. 4c + 3 (low nibbles) and 16 + 4c .. (high) */
                __m256i packed = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
                __m256i lo = _mm256_and_si256(packed, low), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                __m256i v[2] = {_mm256_shuffle_epi8(lo, first), _mm256_shuffle_epi8(lo, second)};
                pair_products(v, 2, 2 * c, x + b, ldx, rows, sums);
                v[0] = _mm256_shuffle_epi8(hi, first), v[1] = _mm256_shuffle_epi8(hi, second);
                pair_products(v, 2, 8 + 2 * c, x + b, ldx, rows, sums);
            }
        }
        __builtin_prefetch(block + 4 * size);
        for (int r = 0; r < rows; r++) {
            const XBlock* xb = x + r * ldx + b;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(dw, _mm256_set1_ps(xb->d)), acc[r]);
            if (type != GGML_Q8_0) acc[r] = _mm256_fmadd_ps(cw, _mm256_set1_ps(xb->s), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

/* ---- K-quants: Q4_K, Q5_K, Q6_K superblocks of 256 weights ------------------------------------

   Decoded at load to their integers and interleaved per group of eight rows and superblock
   (tandem/model/block_matrix.py, interleaved_k): the rows' fp16 d (and dmin), their scales (and
   minimums) by sub-block, then eight windows of 32 weights, one per activation block: the
   weights' low nibbles in the chunk layout of Q4 blocks, and the bits above them in planes whose
   byte (row, t) holds, for Q5_K, bit 4 of weight 4k + t at bit k, and for Q6_K (two planes, k < 4
   and k >= 4) bits 4-5 of weight 4k + t at bits 2(k % 4). The same bits as the file's, and about
   its size (Q4_K +2.8%, Q5_K +2.3% for the unpacked six-bit scales; Q6_K the same).
   Weights: Q4_K and Q5_K d * sc * q - dmin * m per sub-block of 32; Q6_K d * sc * (q - 32) per
   sub-block of 16, two to a window. */
enum { GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };

static inline int is_k_quant(int64_t type) { return type >= GGML_Q4_K && type <= GGML_Q6_K; }
static inline int64_t super_bytes(int type) { return type == GGML_Q4_K ? 1184 : type == GGML_Q5_K ? 1440 : 1680; }
static inline int window_bytes(int type) { return type == GGML_Q4_K ? 128 : type == GGML_Q5_K ? 160 : 192; }
static inline int header_bytes(int type) { return type == GGML_Q6_K ? 144 : 160; }

/* Set k's bits above the nibble, moved to bit 4 (Q5_K) or bits 4-5 (Q6_K) of each byte. Shifts of
   16-bit lanes: the mask keeps only bits that came from the same byte. */
static inline __m256i high_bits(__m256i plane, const int k, const int type) {
    int shift = type == GGML_Q5_K ? 4 - k : 4 - 2 * (k % 4);
    __m256i moved = shift >= 0 ? _mm256_slli_epi16(plane, shift) : _mm256_srli_epi16(plane, -shift);
    return _mm256_and_si256(moved, _mm256_set1_epi8(type == GGML_Q5_K ? 0x10 : 0x30));
}

/* As group_dot, for a group of K-quant superblocks (nblocks / 8 of them). */
static inline __attribute__((always_inline)) void group_dot_k(
    const uint8_t* group, int nblocks, const XBlock* x, int64_t ldx, float* y, int64_t ldy, const int rows,
    const int type) {
    const __m256i low = _mm256_set1_epi8(0x0f), first = widening(0, 0), second = widening(2, 0);
    const __m256i offset = _mm256_set1_epi16(type == GGML_Q6_K ? 32 : 0);
    __m256 acc[BLOCK_TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int s = 0; s < nblocks / 8; s++) {
        const uint8_t* super = group + s * super_bytes(type);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)super));
        __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(super + 16)));
        for (int w = 0; w < 8; w++) {
            const uint8_t* window = super + header_bytes(type) + w * window_bytes(type);
            const XBlock* xw = x + s * 8 + w;
            __m256i sums[2][BLOCK_TILE_ROWS];  /* Q6_K: weights 0-15 and 16-31 of the window apart */
            for (int r = 0; r < rows; r++) sums[0][r] = sums[1][r] = _mm256_setzero_si256();
            __m256i plane = _mm256_loadu_si256((const __m256i*)(window + 128)), upper = plane;
            if (type == GGML_Q6_K) upper = _mm256_loadu_si256((const __m256i*)(window + 160));
            for (int c = 0; c < 4; c++) {
                __m256i packed = _mm256_loadu_si256((const __m256i*)(window + 32 * c));
                __m256i lo = _mm256_and_si256(packed, low), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                if (type != GGML_Q4_K) {
                    lo = _mm256_or_si256(lo, high_bits(plane, c, type));
                    hi = _mm256_or_si256(hi, high_bits(upper, c + 4, type));
                }
                __m256i v[2] = {_mm256_sub_epi16(_mm256_shuffle_epi8(lo, first), offset),
                                _mm256_sub_epi16(_mm256_shuffle_epi8(lo, second), offset)};
                pair_products(v, 2, 2 * c, xw, ldx, rows, sums[0]);
                v[0] = _mm256_sub_epi16(_mm256_shuffle_epi8(hi, first), offset);
                v[1] = _mm256_sub_epi16(_mm256_shuffle_epi8(hi, second), offset);
                pair_products(v, 2, 8 + 2 * c, xw, ldx, rows, sums[type == GGML_Q6_K]);
            }
            if (type == GGML_Q6_K) {
                const int8_t* sc = (const int8_t*)(super + 16) + 16 * w;  /* sub-blocks 2w, 2w + 1 */
                __m256 a = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)sc))));
                __m256 b = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(sc + 8)))));
                for (int r = 0; r < rows; r++) {
                    __m256 dx = _mm256_set1_ps(xw[r * ldx].d);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[0][r]), _mm256_mul_ps(a, dx), acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[1][r]), _mm256_mul_ps(b, dx), acc[r]);
                }
            } else {
                const uint8_t* sc = super + 32 + 8 * w;
                __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)sc))));
                __m256 min = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(sc + 64)))));
                for (int r = 0; r < rows; r++) {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[0][r]), _mm256_mul_ps(scale, _mm256_set1_ps(xw[r * ldx].d)), acc[r]);
                    acc[r] = _mm256_fnmadd_ps(min, _mm256_set1_ps(xw[r * ldx].s), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

/* Weight v (0..255) of superblock s of row `lane` of a K-quant group, as gguf.quants.dequantize
   computes it. */
__attribute__((optimize("fp-contract=off"))) static float k_weight(const uint8_t* group, int type, int lane, int s,
                                                                   int v) {
    const uint8_t* super = group + s * super_bytes(type);
    int w = v / 32, j = v % 32, k = j / 4, t = j % 4;
    const uint8_t* window = super + header_bytes(type) + w * window_bytes(type);
    uint8_t byte = window[(j % 16 / 4) * 32 + lane * 4 + t];
    int q = j < 16 ? byte & 0x0f : byte >> 4;
    if (type == GGML_Q5_K) q |= (window[128 + lane * 4 + t] >> k & 1) << 4;
    if (type == GGML_Q6_K) q |= (window[(k < 4 ? 128 : 160) + lane * 4 + t] >> (2 * (k % 4)) & 3) << 4;
    float d = fp16_at(super + 2 * lane);
    if (type == GGML_Q6_K) {
        float scale = d * (float)((const int8_t*)(super + 16))[(v / 16) * 8 + lane];
        return scale * (float)(q - 32);
    }
    float scale = d * (float)super[32 + w * 8 + lane], min = fp16_at(super + 16 + 2 * lane) * (float)super[96 + w * 8 + lane];
    return scale * (float)q - min;
}

typedef void (*group_dot_fn)(const uint8_t*, int, const XBlock*, int64_t, float*, int64_t);
#define GROUP_DOT(KERNEL, TYPE, ROWS)                                                              \
    static void KERNEL##_##TYPE##_##ROWS(const uint8_t* g, int nb, const XBlock* x, int64_t ldx,  \
                                         float* y, int64_t ldy) {                                 \
        KERNEL(g, nb, x, ldx, y, ldy, ROWS, GGML_##TYPE);                                          \
    }
#define GROUP_DOTS(KERNEL, TYPE)                                                                   \
    GROUP_DOT(KERNEL, TYPE, 1) GROUP_DOT(KERNEL, TYPE, 2) GROUP_DOT(KERNEL, TYPE, 3)                \
    GROUP_DOT(KERNEL, TYPE, 4) GROUP_DOT(KERNEL, TYPE, 5) GROUP_DOT(KERNEL, TYPE, 6)                \
    GROUP_DOT(KERNEL, TYPE, 7) GROUP_DOT(KERNEL, TYPE, 8)                                           \
    static const group_dot_fn group_dots_##TYPE[BLOCK_TILE_ROWS + 1] = {                            \
        NULL, KERNEL##_##TYPE##_1, KERNEL##_##TYPE##_2, KERNEL##_##TYPE##_3, KERNEL##_##TYPE##_4,  \
        KERNEL##_##TYPE##_5, KERNEL##_##TYPE##_6, KERNEL##_##TYPE##_7, KERNEL##_##TYPE##_8};
GROUP_DOTS(group_dot, Q4_0)
GROUP_DOTS(group_dot, Q4_1)
GROUP_DOTS(group_dot, Q8_0)
GROUP_DOTS(group_dot_k, Q4_K)
GROUP_DOTS(group_dot_k, Q5_K)
GROUP_DOTS(group_dot_k, Q6_K)

static inline const group_dot_fn* group_dots(int64_t type) {
    switch (type) {
        case GGML_Q4_0: return group_dots_Q4_0;
        case GGML_Q4_1: return group_dots_Q4_1;
        case GGML_Q8_0: return group_dots_Q8_0;
        case GGML_Q4_K: return group_dots_Q4_K;
        case GGML_Q5_K: return group_dots_Q5_K;
        default: return group_dots_Q6_K;
    }
}

/* One group's rows for all M activation rows (x: [M, nblocks]), in even tiles of at most
   BLOCK_TILE_ROWS: the group's blocks are read from memory once and stay in L1 while the tiles pass. */
static void group_rows(const BlockGroup* g, const XBlock* x, int M, int nblocks, float* y, int ldy) {
    int tiles = (M + BLOCK_TILE_ROWS - 1) / BLOCK_TILE_ROWS;
    float out[BLOCK_TILE_ROWS][8];
    for (int t = 0, m = 0; t < tiles; t++) {
        int tile = (M - m) / (tiles - t);
        float* ym = y + (int64_t)m * ldy + g->first_row;
        const XBlock* xm = x + (int64_t)m * nblocks;
        if (g->count == 8) {
            group_dots(g->type)[tile](g->data, nblocks, xm, nblocks, ym, ldy);
        } else {
            group_dots(g->type)[tile](g->data, nblocks, xm, nblocks, out[0], 8);
            for (int r = 0; r < tile; r++) memcpy(ym + (int64_t)r * ldy, out[r], sizeof(float) * g->count);
        }
        m += tile;
    }
}

/* Output columns [n0, n1) of y for all M activation rows (x: [M, K / 32] blocks): the groups whose
   first row is in the range (groups begin at multiples of 8 within their part, so a thread's
   range, in whole panels, never splits one). A prefill's rows go in chunks whose blocks stay in
   L2 while every group passes over them. */
static void gemm_blocks_range(const XBlock* x, int M, int K, const BlockGroup* groups, int num_groups, int n0,
                              int n1, float* y, int ldy) {
    int nblocks = K / QBLOCK;
    for (int m = 0; m < M; m += BLOCK_ROW_CHUNK) {
        int rows = M - m < BLOCK_ROW_CHUNK ? M - m : BLOCK_ROW_CHUNK;
        for (int i = 0; i < num_groups; i++)
            if (groups[i].first_row >= n0 && groups[i].first_row < n1)
                group_rows(groups + i, x + (int64_t)m * nblocks, rows, nblocks, y + (int64_t)m * ldy, ldy);
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
    int64_t size = 8 * block_bytes(type);
    for (int b = 0; b < cols / QBLOCK; b++) {
        const uint8_t* block = g->data + b * size;
        float d = fp16_at(block + 2 * lane);
        float* o = out + b * QBLOCK;
        if (type == GGML_Q8_0) {
            for (int i = 0; i < QBLOCK; i++) o[i] = (float)(int8_t)block[16 + (i / 4) * 32 + lane * 4 + i % 4] * d;
            continue;
        }
        const uint8_t* qs = block + (type == GGML_Q4_1 ? 32 : 16);
        float offset = type == GGML_Q4_1 ? 0.0f : -8.0f, min = type == GGML_Q4_1 ? fp16_at(block + 16 + 2 * lane) : 0.0f;
        for (int i = 0; i < QBLOCK / 2; i++) {
            uint8_t byte = qs[(i / 4) * 32 + lane * 4 + i % 4];
            o[i] = ((float)(byte & 0x0f) + offset) * d + min;
            o[i + QBLOCK / 2] = ((float)(byte >> 4) + offset) * d + min;
        }
    }
}

#endif
