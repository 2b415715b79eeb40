/* What the native kernels share (included by each source; irminsul/model/native/__init__.py builds them). */
#ifndef IRM_COMMON_H
#define IRM_COMMON_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__SSE2__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#if defined(__AVX512F__)
/* e^x for x <= 0 (a softmax's scores less their maximum, silu's -|x|), 16 at a time: n = round(x
 * log2(e)), f = x - n ln 2 in two parts (Cody-Waite: ln 2's high part has trailing zero bits, so n
 * times it is exact; |f| <= ln 2 / 2), e^x = 2^n e^f, e^f by its Taylor polynomial of degree 7
 * (~1e-7 relative in float32 over the whole range); x below -87 is taken as -87 (e^-87 ~ 1.6e-38,
 * the smallest normal float's order) */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#endif
