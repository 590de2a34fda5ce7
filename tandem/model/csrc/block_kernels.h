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

/* y[r * ldy + i] = row i . x[r] for a group's rows (lane i of each vector is row i) and `rows`
   activation rows, blocks ldx apart. Per block, the weights are widened to int16 once, as vectors
   of the rows' pairs (2j, 2j + 1); each pair of x is broadcast and multiplied by one of them,
   summing into int32 lanes, so the rows need no horizontal sums and one multiply-add scales them
   all. */
static inline __attribute__((always_inline)) void group_dot(const uint8_t* group, int nblocks, const XBlock* x,
                                                           int64_t ldx, float* y, int64_t ldy, const int rows,
                                                           const int type) {
    const int G = GROUP_ROWS;
    const VI low = OP(set1_epi8)(0x0f);
    /* per 32-bit lane: bytes (0, 1) or (2, 3) into the low halves of two int16, or, for signed
       bytes, into the high halves (then shifted down with their sign) */
    const VI first = WIDE(widening(0, 0)), second = WIDE(widening(2, 0));
    const VI first_high = WIDE(widening(0, 1)), second_high = WIDE(widening(2, 1));
    const int64_t size = G * block_bytes(type);
    VF acc[BLOCK_TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = OP(setzero_ps)();
    for (int b = 0; b < nblocks; b++) {
        const uint8_t* block = group + b * size;
        const uint8_t* values = block + values_at(type);
        VF dw = CVT_PH(HALF(block)), cw = dw;
        VI sums[BLOCK_TILE_ROWS];
        for (int r = 0; r < rows; r++) sums[r] = SI(setzero)();
        if (type == GGML_Q8_0) {
            for (int c = 0; c < 8; c++) {  /* weights 4c .. 4c + 3 */
                VI w = CHUNK(values + 4 * G * c);
                VI v[2] = {OP(srai_epi16)(OP(shuffle_epi8)(w, first_high), 8),
                           OP(srai_epi16)(OP(shuffle_epi8)(w, second_high), 8)};
                pair_products(v, 2, 2 * c, x + b, ldx, rows, sums);
            }
        } else {
            cw = type == GGML_Q4_1 ? CVT_PH(HALF(block + 2 * G)) : OP(mul_ps)(dw, OP(set1_ps)(-8.0f));
            for (int c = 0; c < 4; c++) {  /* weights 4c .. 4c + 3 (low nibbles) and 16 + 4c .. (high) */
                VI packed = CHUNK(values + 4 * G * c);
                VI lo = SI(and)(packed, low), hi = SI(and)(OP(srli_epi16)(packed, 4), low);
                VI v[2] = {OP(shuffle_epi8)(lo, first), OP(shuffle_epi8)(lo, second)};
                pair_products(v, 2, 2 * c, x + b, ldx, rows, sums);
                v[0] = OP(shuffle_epi8)(hi, first), v[1] = OP(shuffle_epi8)(hi, second);
                pair_products(v, 2, 8 + 2 * c, x + b, ldx, rows, sums);
            }
        }
        prefetch_ahead(block, size, rows);
        for (int r = 0; r < rows; r++) {
            const XBlock* xb = x + r * ldx + b;
            acc[r] = OP(fmadd_ps)(OP(cvtepi32_ps)(sums[r]), OP(mul_ps)(dw, OP(set1_ps)(xb->d)), acc[r]);
            if (type != GGML_Q8_0) acc[r] = OP(fmadd_ps)(cw, OP(set1_ps)(xb->s), acc[r]);
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

/* As group_dot, for a group of K-quant superblocks (nblocks / 8 of them). */
static inline __attribute__((always_inline)) void group_dot_k(const uint8_t* group, int nblocks, const XBlock* x,
                                                             int64_t ldx, float* y, int64_t ldy, const int rows,
                                                             const int type) {
    const int G = GROUP_ROWS;
    const VI low = OP(set1_epi8)(0x0f), first = WIDE(widening(0, 0)), second = WIDE(widening(2, 0));
    const VI offset = OP(set1_epi16)(type == GGML_Q6_K ? 32 : 0);
    VF acc[BLOCK_TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = OP(setzero_ps)();
    for (int s = 0; s < nblocks / 8; s++) {
        const uint8_t* super = group + s * super_bytes(type);
        VF d = CVT_PH(HALF(super)), dmin = CVT_PH(HALF(super + 2 * G));
        for (int w = 0; w < 8; w++) {
            const uint8_t* window = super + header_bytes(type) + w * window_bytes(type);
            const XBlock* xw = x + s * 8 + w;
            if (rows >= WHOLE_PREFETCH_ROWS)  /* PREFETCH_BLOCKS blocks ahead, an eighth of a superblock per window */
                prefetch_span(super + PREFETCH_BLOCKS / 8 * super_bytes(type) + w * super_bytes(type) / 8,
                              super_bytes(type) / 8);
            VI sums[2][BLOCK_TILE_ROWS];  /* Q6_K: weights 0-15 and 16-31 of the window apart */
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
                VI v[2] = {OP(sub_epi16)(OP(shuffle_epi8)(lo, first), offset),
                           OP(sub_epi16)(OP(shuffle_epi8)(lo, second), offset)};
                pair_products(v, 2, 2 * c, xw, ldx, rows, sums[0]);
                v[0] = OP(sub_epi16)(OP(shuffle_epi8)(hi, first), offset);
                v[1] = OP(sub_epi16)(OP(shuffle_epi8)(hi, second), offset);
                pair_products(v, 2, 8 + 2 * c, xw, ldx, rows, sums[type == GGML_Q6_K]);
            }
            if (type == GGML_Q6_K) {  /* the int8 scales of sub-blocks 2w and 2w + 1 */
                const uint8_t* sc = super + 2 * G + 2 * G * w;
                VF lower = OP(mul_ps)(d, OP(cvtepi32_ps)(CVT_I8(EIGHT(sc))));
                VF higher = OP(mul_ps)(d, OP(cvtepi32_ps)(CVT_I8(EIGHT(sc + G))));
                for (int r = 0; r < rows; r++) {
                    VF dx = OP(set1_ps)(xw[r * ldx].d);
                    acc[r] = OP(fmadd_ps)(OP(cvtepi32_ps)(sums[0][r]), OP(mul_ps)(lower, dx), acc[r]);
                    acc[r] = OP(fmadd_ps)(OP(cvtepi32_ps)(sums[1][r]), OP(mul_ps)(higher, dx), acc[r]);
                }
            } else {  /* the uint8 scales and minimums of sub-block w */
                const uint8_t* sc = super + 4 * G + G * w;
                VF scale = OP(mul_ps)(d, OP(cvtepi32_ps)(CVT_U8(EIGHT(sc))));
                VF min = OP(mul_ps)(dmin, OP(cvtepi32_ps)(CVT_U8(EIGHT(sc + 8 * G))));
                for (int r = 0; r < rows; r++) {
                    acc[r] = OP(fmadd_ps)(OP(cvtepi32_ps)(sums[0][r]), OP(mul_ps)(scale, OP(set1_ps)(xw[r * ldx].d)),
                                          acc[r]);
                    acc[r] = OP(fnmadd_ps)(min, OP(set1_ps)(xw[r * ldx].s), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) OP(storeu_ps)(y + r * ldy, acc[r]);
}

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

/* A type's kernels, by activation rows (1 .. BLOCK_TILE_ROWS). */
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
