/* The kernels' vector layer: one float vector type `vf` of IRM_W lanes and the operations the kernels
 * use, one set per instruction set (the idea of ggml-cpu's simd-mappings.h), so a kernel's vector loop
 * is written once:
 *   AVX-512F      IRM_W 16  __m512
 *   AVX2 + FMA    IRM_W 8   __m256
 *   otherwise     IRM_W 1   float (the kernels keep their plain loops there, which the compiler
 *                           vectorises for the CPU; the layer's scalar form serves the code written once)
 * IRM_VEC is 1 where the vector forms exist. Loads and stores are unaligned; the _n forms touch only the
 * first n < IRM_W lanes (the rest read as zero). */
#ifndef IRM_SIMD_H
#define IRM_SIMD_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define IRM_W 16
#define IRM_VEC 1
typedef __m512 vf;
static inline __mmask16 vf_mask(long n) { return (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_load_n(const float *p, long n) { return _mm512_maskz_loadu_ps(vf_mask(n), p); }
static inline void vf_store_n(float *p, vf v, long n) { _mm512_mask_storeu_ps(p, vf_mask(n), v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); } /* a b + c */
static inline float vf_hsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float vf_hmax(vf v) { return _mm512_reduce_max_ps(v); }
/* IRM_W bfloat16 values as floats (a bf16 is a float's upper half) */
static inline vf vf_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#elif defined(__AVX2__) && defined(__FMA__)
#define IRM_W 8
#define IRM_VEC 1
typedef __m256 vf;
/* lanes below n all ones (a maskload's and blendv's mask) */
static inline __m256i vf_mask(long n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_load_n(const float *p, long n) { return _mm256_maskload_ps(p, vf_mask(n)); }
static inline void vf_store_n(float *p, vf v, long n) { _mm256_maskstore_ps(p, vf_mask(n), v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vf_hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vf_hmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vf_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

#else
#define IRM_W 1
#define IRM_VEC 0
typedef float vf;
static inline vf vf_zero(void) { return 0.0f; }
static inline vf vf_set1(float x) { return x; }
static inline vf vf_load(const float *p) { return *p; }
static inline void vf_store(float *p, vf v) { *p = v; }
static inline vf vf_load_n(const float *p, long n) { return n > 0 ? *p : 0.0f; }
static inline void vf_store_n(float *p, vf v, long n) {
    if (n > 0) *p = v;
}
static inline vf vf_add(vf a, vf b) { return a + b; }
static inline vf vf_sub(vf a, vf b) { return a - b; }
static inline vf vf_mul(vf a, vf b) { return a * b; }
static inline vf vf_max(vf a, vf b) { return a > b ? a : b; }
static inline vf vf_fma(vf a, vf b, vf c) { return a * b + c; }
static inline float vf_hsum(vf v) { return v; }
static inline float vf_hmax(vf v) { return v; }
static inline vf vf_load_bf16(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#endif

/* the first n (< IRM_W) bfloat16 values as floats, the rest zero: through a copy, as AVX2 has no
 * 16-bit masked load */
static inline vf vf_load_bf16_n(const uint16_t *p, long n) {
    uint16_t t[IRM_W] = {0};
    memcpy(t, p, sizeof(uint16_t) * (size_t)(n < IRM_W ? n : IRM_W));
    return vf_load_bf16(t);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* common.h's exp_nonpositive in 8 lanes: n = round(x log2(e)), f = x - n ln 2 (Cody-Waite), the same
 * degree-7 polynomial, 2^n built in the exponent field (n in [-126, 0] for x >= -87: a normal float) */
static inline __m256 exp_nonpositive8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    f = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), f);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* common.h's silu16 in 8 lanes: with e = e^-|x|, x * (x >= 0 ? 1 : e) / (1 + e) (a division where
 * AVX-512 takes rcp14 and a Newton step); below -87, what torch's x / (1 + inf) gives: -0, NaN for
 * -inf (by bits: the compiler may fold a product by zero) */
static inline __m256 silu8(__m256 x) {
    __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_setzero_ps(), ax));
    __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
    __m256 s = _mm256_div_ps(_mm256_mul_ps(x, num), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    __m256 under = _mm256_or_ps(_mm256_and_ps(x, _mm256_set1_ps(-0.0f)),
                                _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
    return _mm256_blendv_ps(s, under, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ));
}

/* out[k] = the sum of c_k's 8 lanes, k < 8: pairs added within the 128-bit halves (hadd twice), then
 * the halves */
static inline void reduce8_avx2(__m256 c0, __m256 c1, __m256 c2, __m256 c3, __m256 c4, __m256 c5, __m256 c6,
                                __m256 c7, float *out) {
    __m256 t0 = _mm256_hadd_ps(c0, c1), t1 = _mm256_hadd_ps(c2, c3), t2 = _mm256_hadd_ps(c4, c5),
           t3 = _mm256_hadd_ps(c6, c7);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* [c0 c1 c2 c3 | c0 c1 c2 c3] halves, ... */
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
}
#endif

#endif
