/* Float vectors of the machine's width in GCC's vector extensions: 16 lanes (a zmm) under AVX-512,
   8 (a ymm) under AVX2; wider types than the ISA's would live on the stack. Everything is written
   with these, so one source serves every ISA. */
#ifndef TANDEM_VEC_H
#define TANDEM_VEC_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4), aligned(4)));

/* Loads, stores and broadcasts by intrinsics: GCC lowers memcpy and element-wise builds of these
   types to stack traffic and inserts under AVX2 (measured 2x slower steps). */
#if defined(__AVX512F__)
static inline vf v_load(const float* p) { return (vf)_mm512_loadu_ps(p); }
static inline void v_store(float* p, vf v) { _mm512_storeu_ps(p, (__m512)v); }
static inline vf v_splat(float x) { return (vf)_mm512_set1_ps(x); }
static inline vi v_splat_i(int32_t x) { return (vi)_mm512_set1_epi32(x); }
static inline vi v_iota(void) { return (vi)_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline vf v_load_bf16(const uint16_t* p) {
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
}
static inline vf v_load_f16(const uint16_t* p) { return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
#else
static inline vf v_load(const float* p) { return (vf)_mm256_loadu_ps(p); }
static inline void v_store(float* p, vf v) { _mm256_storeu_ps(p, (__m256)v); }
static inline vf v_splat(float x) { return (vf)_mm256_set1_ps(x); }
static inline vi v_splat_i(int32_t x) { return (vi)_mm256_set1_epi32(x); }
static inline vi v_iota(void) { return (vi)_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
static inline vf v_load_bf16(const uint16_t* p) {
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
}
static inline vf v_load_f16(const uint16_t* p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#endif

/* bf16 <-> fp32. Rounding is to nearest even, as torch's .to(torch.bfloat16). */
static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* fp32 -> fp16 (F16C), rounding to nearest even as torch's .to(torch.float16); beyond fp16's range, inf. */
static inline uint16_t f32_to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

/* Lanes of a where mask is set, else of b; mask from a vector comparison. */
static inline vf v_select(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline vf v_maxv(vf a, vf b) { return v_select(a > b, a, b); }
static inline vf v_minv(vf a, vf b) { return v_select(a < b, a, b); }

static inline float v_sum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}
static inline float v_max(vf v) {
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* exp(x) to about 2 ulp for x <= 88 (larger x are taken as 88); 0 below -87.3. Enough for the
   softmax and SiLU inputs it gets. exp(x) = 2^n * exp(r): n = round(x / ln 2) by the 1.5 * 2^23
   trick, r = x - n ln 2 in two parts, exp(r) by a degree-6 polynomial (Cephes' expf). */
static inline vf v_exp(vf x) {
    const vf lo = v_splat(-87.3365447504f), hi = v_splat(88.0f), magic = v_splat(12582912.0f);
    vi underflow = x < lo;
    x = v_maxv(v_minv(x, hi), lo);
    vf n = (x * v_splat(1.44269504088896341f) + magic) - magic;
    vf r = x - n * v_splat(0.693359375f);
    r = r - n * v_splat(-2.12194440e-4f);
    vf p = v_splat(1.9875691500e-4f);
    p = p * r + v_splat(1.3981999507e-3f);
    p = p * r + v_splat(8.3334519073e-3f);
    p = p * r + v_splat(4.1665795894e-2f);
    p = p * r + v_splat(1.6666665459e-1f);
    p = p * r + v_splat(5.0000001201e-1f);
    p = p * r * r + r + v_splat(1.0f);
    vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)scale) & ~underflow);
}

#endif
