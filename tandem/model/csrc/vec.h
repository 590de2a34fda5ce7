/* 16-lane float vectors in GCC's vector extensions: one zmm under AVX-512, two ymm under AVX2.
   Everything but the GEMM's inner loop is written with these, so one source serves every ISA. */
#ifndef TANDEM_VEC_H
#define TANDEM_VEC_H

#include <stdint.h>
#include <string.h>

#define LANES 16
typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
typedef uint32_t v16u __attribute__((vector_size(64), aligned(4)));

static inline v16f v_load(const float* p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void v_store(float* p, v16f v) { memcpy(p, &v, sizeof v); }
static inline v16i v_splat_i(int32_t x) { return (v16i){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline v16i v16i_iota(void) { return (v16i){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
static inline v16f v_splat(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* bf16 <-> fp32. Rounding is to nearest even, as torch's .to(torch.bfloat16). */
static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));
static inline v16f v_load_bf16(const uint16_t* p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16u) << 16);
}

/* Lanes of a where mask is set, else of b; mask from a vector comparison. */
static inline v16f v_select(v16i mask, v16f a, v16f b) { return (v16f)((mask & (v16i)a) | (~mask & (v16i)b)); }
static inline v16f v_maxv(v16f a, v16f b) { return v_select(a > b, a, b); }
static inline v16f v_minv(v16f a, v16f b) { return v_select(a < b, a, b); }

static inline float v_sum(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}
static inline float v_max(v16f v) {
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* exp(x) to about 2 ulp for x <= 88 (larger x are taken as 88); 0 below -87.3. Enough for the
   softmax and SiLU inputs it gets. exp(x) = 2^n * exp(r): n = round(x / ln 2) by the 1.5 * 2^23
   trick, r = x - n ln 2 in two parts, exp(r) by a degree-6 polynomial (Cephes' expf). */
static inline v16f v_exp(v16f x) {
    const v16f lo = v_splat(-87.3365447504f), hi = v_splat(88.0f), magic = v_splat(12582912.0f);
    v16i underflow = x < lo;
    x = v_maxv(v_minv(x, hi), lo);
    v16f n = (x * v_splat(1.44269504088896341f) + magic) - magic;
    v16f r = x - n * v_splat(0.693359375f);
    r = r - n * v_splat(-2.12194440e-4f);
    v16f p = v_splat(1.9875691500e-4f);
    p = p * r + v_splat(1.3981999507e-3f);
    p = p * r + v_splat(8.3334519073e-3f);
    p = p * r + v_splat(4.1665795894e-2f);
    p = p * r + v_splat(1.6666665459e-1f);
    p = p * r + v_splat(5.0000001201e-1f);
    p = p * r * r + r + v_splat(1.0f);
    v16i scale = (__builtin_convertvector(n, v16i) + 127) << 23;
    return (v16f)((v16i)(p * (v16f)scale) & ~underflow);
}

#endif
