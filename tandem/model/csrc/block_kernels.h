/* The block kernels (group_dot, group_dot_k) at the build's vector width: blocks.h includes this
   once, with GROUP_ROWS lanes (8: AVX2, 16: AVX-512) and these defined for that width:
     VI, VF                       the integer and float vector types
     OP(name), SI(name)           _mm256_name / _mm512_name; _mm256_name_si256 / _mm512_name_si512
     CHUNK(p), HALF(p), EIGHT(p)  loads of 4, 2 and 1 bytes per lane
     CVT_PH, CVT_U8, CVT_I8       HALF's fp16, EIGHT's uint8 or int8 to float / int32 lanes
     WIDE(v)                      a 256-bit pattern repeated across the vector
   Each lane does the same integer and float operations in the same order at either width, so
   AVX2 and AVX-512 builds give the same bits. */

/* sums[r] += the group's int16 weight pairs v[i] times x[r]'s pair `first + i`, for count pairs. */
static inline __attribute__((always_inline)) void pair_products(const VI* v, int count, int first, const XBlock* x,
                                                               int64_t ldx, int rows, VI* sums) {
    for (int i = 0; i < count; i++)
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x[r * ldx].q + 2 * (first + i), 4);
#if defined(__AVX512VNNI__)  /* one instruction for the multiply-add pair, the same integers */
            sums[r] = OP(dpwssd_epi32)(sums[r], v[i], OP(set1_epi32)(pair));
#else
            sums[r] = OP(add_epi32)(sums[r], OP(madd_epi16)(v[i], OP(set1_epi32)(pair)));
#endif
        }
}

/* vpshufb patterns taking a lane's bytes (0, 1) or (2, 3) into the low halves of two int16 (first,
   second), or, for signed bytes, into the high halves (then shifted down with their sign). */
typedef struct {
    VI first, second, first_high, second_high;
} Widening;

static inline __attribute__((always_inline)) Widening widenings(void) {
    return (Widening){WIDE(widening(0, 0)), WIDE(widening(2, 0)), WIDE(widening(0, 1)), WIDE(widening(2, 1))};
}

/* sums[r] = a legacy block's weights times x[r]'s int16: the weights are widened to int16 once, as
   vectors of the rows' pairs (2j, 2j + 1); each pair of x is broadcast and multiplied by one of
   them, summing into int32 lanes. Q4's integers are the nibbles (their -8 or minimum is the float
   work's). */
static inline __attribute__((always_inline)) void block_sums16(const uint8_t* values, const int type,
                                                              const Widening* wide, const XBlock* x, int64_t ldx,
                                                              const int rows, VI* sums) {
    const int G = GROUP_ROWS;
    for (int r = 0; r < rows; r++) sums[r] = SI(setzero)();
    if (type == GGML_Q8_0) {
        for (int c = 0; c < 8; c++) {  /* weights 4c .. 4c + 3 */
            VI w = CHUNK(values + 4 * G * c);
            VI v[2] = {OP(srai_epi16)(OP(shuffle_epi8)(w, wide->first_high), 8),
                       OP(srai_epi16)(OP(shuffle_epi8)(w, wide->second_high), 8)};
            pair_products(v, 2, 2 * c, x, ldx, rows, sums);
        }
        return;
    }
    const VI low = OP(set1_epi8)(0x0f);
    for (int c = 0; c < 4; c++) {  /* weights 4c .. 4c + 3 (low nibbles) and 16 + 4c .. (high) */
        VI packed = CHUNK(values + 4 * G * c);
        VI lo = SI(and)(packed, low), hi = SI(and)(OP(srli_epi16)(packed, 4), low);
        VI v[2] = {OP(shuffle_epi8)(lo, wide->first), OP(shuffle_epi8)(lo, wide->second)};
        pair_products(v, 2, 2 * c, x, ldx, rows, sums);
        v[0] = OP(shuffle_epi8)(hi, wide->first), v[1] = OP(shuffle_epi8)(hi, wide->second);
        pair_products(v, 2, 8 + 2 * c, x, ldx, rows, sums);
    }
}

/* ---- int8 activations (XBlock8) ------------------------------------------------------------- */

/* sums[r] += each lane's 4 unsigned weight bytes w times x[r]'s bytes at..at + 3 (signed), summed:
   one vpdpbusd with VNNI; else vpmaddubsw (no pair of these products reaches int16's limit while
   w <= 63: Q6_K's values at most; Q8_0's bytes moved to w + 128 come here only with VNNI) and a
   vpmaddwd by ones. The same integers either way. */
static inline __attribute__((always_inline)) void quad_products(VI w, int at, const XBlock8* x, int64_t ldx,
                                                               int rows, VI* sums) {
    for (int r = 0; r < rows; r++) {
        int32_t quad;
        memcpy(&quad, x[r * ldx].q + at, 4);
#if defined(__AVX512VNNI__)
        sums[r] = OP(dpbusd_epi32)(sums[r], w, OP(set1_epi32)(quad));
#else
        VI pairs = OP(maddubs_epi16)(w, OP(set1_epi32)(quad));
        sums[r] = OP(add_epi32)(sums[r], OP(madd_epi16)(pairs, OP(set1_epi16)(1)));
#endif
    }
}

/* A block's 4-bit weights (nibbles 0..15) times x's bytes, one chunk at a time: lo and hi hold weights
   4c .. 4c + 3 and 16 + 4c .. of each lane's row. With VNNI into the int32 sums at once; without,
   vpmaddubsw's int16 pairs are summed as int16 over the whole block (8 * 2 * 15 * 127 = 30480 stays
   under 32767) and widened once by nibble_sums: the same integers, a third fewer instructions. */
static inline __attribute__((always_inline)) void nibble_products(VI lo, VI hi, int c, const XBlock8* x, int64_t ldx,
                                                                 int rows, VI* acc) {
#if defined(__AVX512VNNI__)
    quad_products(lo, 4 * c, x, ldx, rows, acc);
    quad_products(hi, 16 + 4 * c, x, ldx, rows, acc);
#else
    for (int r = 0; r < rows; r++) {
        int32_t low_quad, high_quad;
        memcpy(&low_quad, x[r * ldx].q + 4 * c, 4);
        memcpy(&high_quad, x[r * ldx].q + 16 + 4 * c, 4);
        VI pairs = OP(add_epi16)(OP(maddubs_epi16)(lo, OP(set1_epi32)(low_quad)),
                                 OP(maddubs_epi16)(hi, OP(set1_epi32)(high_quad)));
        acc[r] = OP(add_epi16)(acc[r], pairs);
    }
#endif
}

/* The int32 sums of nibble_products' accumulators (which start at zero). */
static inline __attribute__((always_inline)) void nibble_sums(const VI* acc, int rows, VI* sums) {
    for (int r = 0; r < rows; r++)
#if defined(__AVX512VNNI__)
        sums[r] = acc[r];
#else
        sums[r] = OP(madd_epi16)(acc[r], OP(set1_epi16)(1));
#endif
}

/* As quad_products for signed weight bytes (Q8_0), exact as sums of w times q: with VNNI the
   weights move to unsigned (w + 128) and each row's sum starts at its -128 * sum(q); without, the
   weights' magnitudes multiply x's bytes carrying the weights' signs. */
static inline __attribute__((always_inline)) void signed_quad_products(VI w, int at, const XBlock8* x, int64_t ldx,
                                                                      int rows, VI* sums) {
#if defined(__AVX512VNNI__)
    quad_products(SI(xor)(w, OP(set1_epi8)((char)0x80)), at, x, ldx, rows, sums);
#else
    VI magnitude = OP(abs_epi8)(w), ones = OP(set1_epi16)(1);
    for (int r = 0; r < rows; r++) {
        int32_t quad;
        memcpy(&quad, x[r * ldx].q + at, 4);
        VI signed_x = SIGN8(OP(set1_epi32)(quad), w);
        sums[r] = OP(add_epi32)(sums[r], OP(madd_epi16)(OP(maddubs_epi16)(magnitude, signed_x), ones));
    }
#endif
}

/* block_sums16 for int8 activations: the weights' bytes (Q4's nibbles unmasked, no widening) meet
   four of x's bytes per instruction. */
static inline __attribute__((always_inline)) void block_sums8(const uint8_t* values, const int type,
                                                             const XBlock8* x, int64_t ldx, const int rows,
                                                             VI* sums) {
    const int G = GROUP_ROWS;
    if (type == GGML_Q8_0) {
        for (int r = 0; r < rows; r++)
#if defined(__AVX512VNNI__)
            sums[r] = OP(set1_epi32)(x[r * ldx].q8_offset);
#else
            sums[r] = SI(setzero)();
#endif
        for (int c = 0; c < 8; c++) signed_quad_products(CHUNK(values + 4 * G * c), 4 * c, x, ldx, rows, sums);
        return;
    }
    const VI low = OP(set1_epi8)(0x0f);
    VI nibbles[BLOCK_TILE_ROWS];
    for (int r = 0; r < rows; r++) nibbles[r] = SI(setzero)();
    for (int c = 0; c < 4; c++) {
        VI packed = CHUNK(values + 4 * G * c);
        nibble_products(SI(and)(packed, low), SI(and)(OP(srli_epi16)(packed, 4), low), c, x, ldx, rows, nibbles);
    }
    nibble_sums(nibbles, rows, sums);
}

/* y[r * ldy + i] = row i . x[r] for a group's rows (lane i of each vector is row i) and `rows`
   activation rows (XBlock, or XBlock8 if x8), blocks ldx apart. A block's integer sums need no
   horizontal sums, and one multiply-add per row scales them for all the group's rows. */
static inline __attribute__((always_inline)) void group_dot(const uint8_t* group, int nblocks, const void* x,
                                                           int64_t ldx, float* y, int64_t ldy, const int rows,
                                                           const int type, const int x8) {
    const int G = GROUP_ROWS;
    const int64_t size = G * block_bytes(type), xstride = xblock_bytes(x8) / (int64_t)sizeof(float);
    const float* xd = x;  /* block b of row r: its d at xd[(r * ldx + b) * xstride], its s after it */
    const Widening wide = widenings();
    VF acc[BLOCK_TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = OP(setzero_ps)();
    for (int b = 0; b < nblocks; b++) {
        const uint8_t* block = group + b * size;
        const uint8_t* values = block + values_at(type);
        VF dw = CVT_PH(HALF(block));
        VF cw = type == GGML_Q4_1 ? CVT_PH(HALF(block + 2 * G)) : OP(mul_ps)(dw, OP(set1_ps)(-8.0f));
        VI sums[BLOCK_TILE_ROWS];
        if (x8) block_sums8(values, type, (const XBlock8*)x + b, ldx, rows, sums);
        else block_sums16(values, type, &wide, (const XBlock*)x + b, ldx, rows, sums);
        prefetch_ahead(block, size, rows);
        for (int r = 0; r < rows; r++) {
            const float* xb = xd + (r * ldx + b) * xstride;
            acc[r] = OP(fmadd_ps)(OP(cvtepi32_ps)(sums[r]), OP(mul_ps)(dw, OP(set1_ps)(xb[0])), acc[r]);
            if (type != GGML_Q8_0) acc[r] = OP(fmadd_ps)(cw, OP(set1_ps)(xb[1]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) OP(storeu_ps)(y + r * ldy, acc[r]);
}

/* Set k's bits above the nibble, moved to bit 4 (Q5_K) or bits 4-5 (Q6_K) of each byte. Shifts of
   16-bit lanes: the mask keeps only bits that came from the same byte. */
static inline VI high_bits(VI plane, const int k, const int type) {
    int shift = type == GGML_Q5_K ? 4 - k : 4 - 2 * (k % 4);
    VI moved = shift >= 0 ? OP(slli_epi16)(plane, shift) : OP(srli_epi16)(plane, -shift);
    return SI(and)(moved, OP(set1_epi8)(type == GGML_Q5_K ? 0x10 : 0x30));
}

/* sums[0][r] (and for Q6_K, whose window is two sub-blocks of 16, sums[1][r]) = a K-quant window's
   values times x[r]'s int16, widened as block_sums16 does (Q6_K's -32 taken off each). */
static inline __attribute__((always_inline)) void window_sums16(const uint8_t* window, const int type,
                                                               const Widening* wide, const XBlock* x, int64_t ldx,
                                                               const int rows, VI sums[2][BLOCK_TILE_ROWS]) {
    const int G = GROUP_ROWS;
    const VI low = OP(set1_epi8)(0x0f), offset = OP(set1_epi16)(type == GGML_Q6_K ? 32 : 0);
    for (int r = 0; r < rows; r++) sums[0][r] = sums[1][r] = SI(setzero)();
    VI plane = CHUNK(window + 16 * G), upper = plane;
    if (type == GGML_Q6_K) upper = CHUNK(window + 20 * G);
    for (int c = 0; c < 4; c++) {
        VI packed = CHUNK(window + 4 * G * c);
        VI lo = SI(and)(packed, low), hi = SI(and)(OP(srli_epi16)(packed, 4), low);
        if (type != GGML_Q4_K) {
            lo = SI(or)(lo, high_bits(plane, c, type));
            hi = SI(or)(hi, high_bits(upper, c + 4, type));
        }
        VI v[2] = {OP(sub_epi16)(OP(shuffle_epi8)(lo, wide->first), offset),
                   OP(sub_epi16)(OP(shuffle_epi8)(lo, wide->second), offset)};
        pair_products(v, 2, 2 * c, x, ldx, rows, sums[0]);
        v[0] = OP(sub_epi16)(OP(shuffle_epi8)(hi, wide->first), offset);
        v[1] = OP(sub_epi16)(OP(shuffle_epi8)(hi, wide->second), offset);
        pair_products(v, 2, 8 + 2 * c, x, ldx, rows, sums[type == GGML_Q6_K]);
    }
}

/* window_sums16 for int8 activations: the values as unsigned bytes; Q6_K's sums start at the rows'
   q6_offset, for its -32. */
static inline __attribute__((always_inline)) void window_sums8(const uint8_t* window, const int type,
                                                              const XBlock8* x, int64_t ldx, const int rows,
                                                              VI sums[2][BLOCK_TILE_ROWS]) {
    const int G = GROUP_ROWS;
    const VI low = OP(set1_epi8)(0x0f);
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++)
            sums[h][r] = type == GGML_Q6_K ? OP(set1_epi32)(x[r * ldx].q6_offset[h]) : SI(setzero)();
    if (type == GGML_Q4_K) {  /* sums[1] holds the nibbles' accumulators */
        for (int c = 0; c < 4; c++) {
            VI packed = CHUNK(window + 4 * G * c);
            nibble_products(SI(and)(packed, low), SI(and)(OP(srli_epi16)(packed, 4), low), c, x, ldx, rows, sums[1]);
        }
        nibble_sums(sums[1], rows, sums[0]);
        return;
    }
    VI plane = CHUNK(window + 16 * G), upper = plane;
    if (type == GGML_Q6_K) upper = CHUNK(window + 20 * G);
    for (int c = 0; c < 4; c++) {
        VI packed = CHUNK(window + 4 * G * c);
        VI lo = SI(or)(SI(and)(packed, low), high_bits(plane, c, type));
        VI hi = SI(or)(SI(and)(OP(srli_epi16)(packed, 4), low), high_bits(upper, c + 4, type));
        quad_products(lo, 4 * c, x, ldx, rows, sums[0]);
        quad_products(hi, 16 + 4 * c, x, ldx, rows, sums[type == GGML_Q6_K]);
    }
}

/* acc[r] += a K-quant window's integer sums (sums[0], and for Q6_K sums[1]: its two sub-blocks of
   16) scaled by its sub-block scales (and minus its minimum times x's sum). xd: the first row's
   block scale d, followed by its scaled sum s (XBlock and XBlock8 both begin so); rows xstride
   floats apart. */
static inline __attribute__((always_inline)) void window_scaled(const uint8_t* super, int w, const int type, VF d,
                                                               VF dmin, const float* xd, int64_t xstride,
                                                               const int rows, VI sums[2][BLOCK_TILE_ROWS], VF* acc) {
    const int G = GROUP_ROWS;
    if (type == GGML_Q6_K) {  /* the int8 scales of sub-blocks 2w and 2w + 1 */
        const uint8_t* sc = super + 2 * G + 2 * G * w;
        VF lower = OP(mul_ps)(d, OP(cvtepi32_ps)(CVT_I8(EIGHT(sc))));
        VF higher = OP(mul_ps)(d, OP(cvtepi32_ps)(CVT_I8(EIGHT(sc + G))));
        for (int r = 0; r < rows; r++) {
            VF dx = OP(set1_ps)(xd[r * xstride]);
            acc[r] = OP(fmadd_ps)(OP(cvtepi32_ps)(sums[0][r]), OP(mul_ps)(lower, dx), acc[r]);
            acc[r] = OP(fmadd_ps)(OP(cvtepi32_ps)(sums[1][r]), OP(mul_ps)(higher, dx), acc[r]);
        }
    } else {  /* the uint8 scales and minimums of sub-block w */
        const uint8_t* sc = super + 4 * G + G * w;
        VF scale = OP(mul_ps)(d, OP(cvtepi32_ps)(CVT_U8(EIGHT(sc))));
        VF min = OP(mul_ps)(dmin, OP(cvtepi32_ps)(CVT_U8(EIGHT(sc + 8 * G))));
        for (int r = 0; r < rows; r++) {
            acc[r] = OP(fmadd_ps)(OP(cvtepi32_ps)(sums[0][r]), OP(mul_ps)(scale, OP(set1_ps)(xd[r * xstride])), acc[r]);
            acc[r] = OP(fnmadd_ps)(min, OP(set1_ps)(xd[r * xstride + 1]), acc[r]);
        }
    }
}

/* As group_dot, for a group of K-quant superblocks (nblocks / 8 of them). */
static inline __attribute__((always_inline)) void group_dot_k(const uint8_t* group, int nblocks, const void* x,
                                                             int64_t ldx, float* y, int64_t ldy, const int rows,
                                                             const int type, const int x8) {
    const int G = GROUP_ROWS;
    const int64_t xstride = xblock_bytes(x8) / (int64_t)sizeof(float);
    const Widening wide = widenings();
    VF acc[BLOCK_TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = OP(setzero_ps)();
    for (int s = 0; s < nblocks / 8; s++) {
        const uint8_t* super = group + s * super_bytes(type);
        VF d = CVT_PH(HALF(super)), dmin = CVT_PH(HALF(super + 2 * G));
        for (int w = 0; w < 8; w++) {
            const uint8_t* window = super + header_bytes(type) + w * window_bytes(type);
            if (rows >= WHOLE_PREFETCH_ROWS)  /* PREFETCH_BLOCKS blocks ahead, an eighth of a superblock per window */
                prefetch_span(super + PREFETCH_BLOCKS / 8 * super_bytes(type) + w * super_bytes(type) / 8,
                              super_bytes(type) / 8);
            VI sums[2][BLOCK_TILE_ROWS];
            if (x8) window_sums8(window, type, (const XBlock8*)x + s * 8 + w, ldx, rows, sums);
            else window_sums16(window, type, &wide, (const XBlock*)x + s * 8 + w, ldx, rows, sums);
            window_scaled(super, w, type, d, dmin, (const float*)x + (s * 8 + w) * xstride, ldx * xstride, rows, sums,
                          acc);
        }
    }
    for (int r = 0; r < rows; r++) OP(storeu_ps)(y + r * ldy, acc[r]);
}

#define GROUP_DOT(NAME, KERNEL, X8, TYPE, ROWS)                                                     \
    static void NAME##_##TYPE##_##ROWS(const uint8_t* g, int nb, const void* x, int64_t ldx, float* y,  \
                                       int64_t ldy) {                                                   \
        KERNEL(g, nb, x, ldx, y, ldy, ROWS, GGML_##TYPE, X8);                                            \
    }
/* NAME_TYPE: KERNEL with int8 (X8 = 1) or int16 (X8 = 0) activations, by activation rows. */
#define GROUP_ROW_DOTS(NAME, KERNEL, X8, TYPE)                                                          \
    GROUP_DOT(NAME, KERNEL, X8, TYPE, 1) GROUP_DOT(NAME, KERNEL, X8, TYPE, 2)                           \
    GROUP_DOT(NAME, KERNEL, X8, TYPE, 3) GROUP_DOT(NAME, KERNEL, X8, TYPE, 4)                           \
    GROUP_DOT(NAME, KERNEL, X8, TYPE, 5) GROUP_DOT(NAME, KERNEL, X8, TYPE, 6)                           \
    GROUP_DOT(NAME, KERNEL, X8, TYPE, 7) GROUP_DOT(NAME, KERNEL, X8, TYPE, 8)                           \
    static const group_dot_fn NAME##_##TYPE[BLOCK_TILE_ROWS + 1] = {                                     \
        NULL, NAME##_##TYPE##_1, NAME##_##TYPE##_2, NAME##_##TYPE##_3, NAME##_##TYPE##_4,                \
        NAME##_##TYPE##_5, NAME##_##TYPE##_6, NAME##_##TYPE##_7, NAME##_##TYPE##_8};
/* dots16_TYPE and dots8_TYPE: int16 and int8 activations. */
#define GROUP_DOTS(KERNEL, TYPE) GROUP_ROW_DOTS(dots16, KERNEL, 0, TYPE) GROUP_ROW_DOTS(dots8, KERNEL, 1, TYPE)
GROUP_DOTS(group_dot, Q4_0)
GROUP_DOTS(group_dot, Q4_1)
GROUP_DOTS(group_dot, Q8_0)
GROUP_DOTS(group_dot_k, Q4_K)
GROUP_DOTS(group_dot_k, Q5_K)
GROUP_DOTS(group_dot_k, Q6_K)

/* A type's kernels for int16 (x8 = 0) or int8 activations, by activation rows (1 .. BLOCK_TILE_ROWS). */
static inline const group_dot_fn* group_dots(int64_t type, int x8) {
    switch (type) {
        case GGML_Q4_0: return x8 ? dots8_Q4_0 : dots16_Q4_0;
        case GGML_Q4_1: return x8 ? dots8_Q4_1 : dots16_Q4_1;
        case GGML_Q8_0: return x8 ? dots8_Q8_0 : dots16_Q8_0;
        case GGML_Q4_K: return x8 ? dots8_Q4_K : dots16_Q4_K;
        case GGML_Q5_K: return x8 ? dots8_Q5_K : dots16_Q5_K;
        default: return x8 ? dots8_Q6_K : dots16_Q6_K;
    }
}
