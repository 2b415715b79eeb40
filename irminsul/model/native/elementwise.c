/* A layer's small float32 operations, each one pass over its rows: RMSNorm, and SwiGLU's
 * silu(gate) * up.
 *
 * torch computes RMSNorm as five operations (x^2, the mean, + eps, rsqrt, two products), each a
 * pass over [n, d] and a dispatch; silu(g) * u as two. These compute the same in one pass: RMSNorm
 * in the same order of roundings but for the sum of squares' order (a sum in float32, reassociated
 * as torch's own vectorised sum is), silu with common.h's exp and reciprocal on AVX-512 (~1e-7
 * relative). The rows are shared among the threads given; the AVX-512 paths take 16 floats at a time,
 * the plain loops are vectorised by the compiler for any other CPU.
 */
#include <math.h>
#include <stdint.h>

#include "common.h"

/* out[i, j] = w[j] * (x[i, j] * (1 / sqrt(mean_j x[i, j]^2 + eps))), n rows of d (row strides ldx, ldo) */
void irm_rms_norm(const float *x, long n, long d, long ldx, const float *w, float eps, float *out, long ldo,
                  int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (irm_team(nthreads, (double)n * d)) schedule(static)
    for (long i = 0; i < n; i++) {
        const float *xi = x + i * ldx;
        float *oi = out + i * ldo;
        float ss;
        long j = 0;
#if defined(__AVX512F__)
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        for (; j + 32 <= d; j += 32) {
            __m512 v0 = _mm512_loadu_ps(xi + j), v1 = _mm512_loadu_ps(xi + j + 16);
            a0 = _mm512_fmadd_ps(v0, v0, a0);
            a1 = _mm512_fmadd_ps(v1, v1, a1);
        }
        ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#else
        ss = 0.0f;
#endif
        for (; j < d; j++) ss += xi[j] * xi[j];
        float scale = 1.0f / sqrtf(ss / (float)d + eps);
        j = 0;
#if defined(__AVX512F__)
        __m512 s = _mm512_set1_ps(scale);
        for (; j + 16 <= d; j += 16)
            _mm512_storeu_ps(oi + j, _mm512_mul_ps(_mm512_loadu_ps(w + j), _mm512_mul_ps(_mm512_loadu_ps(xi + j), s)));
#endif
        for (; j < d; j++) oi[j] = w[j] * (xi[j] * scale);
    }
}

/* irm_rms_norm for a bfloat16 model: x, w and out bfloat16, rounded as torch's RMSNorm rounds a bf16
 * tensor (the normalised x rounded to bf16, then times w rounded again: out = bf16(w * bf16(x * scale))),
 * the sum of squares in float32 */
void irm_rms_norm_bf16(const uint16_t *x, long n, long d, long ldx, const uint16_t *w, float eps, uint16_t *out,
                       long ldo, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (irm_team(nthreads, (double)n * d)) schedule(static)
    for (long i = 0; i < n; i++) {
        const uint16_t *xi = x + i * ldx;
        uint16_t *oi = out + i * ldo;
        float ss = 0.0f;
        for (long j = 0; j < d; j++) {
            float v = bf16_to_f32(xi[j]);
            ss += v * v;
        }
        float scale = 1.0f / sqrtf(ss / (float)d + eps);
        for (long j = 0; j < d; j++)
            oi[j] = f32_to_bf16(bf16_to_f32(w[j]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xi[j]) * scale)));
    }
}

/* out[i, j] = silu(gu[i, j]) * gu[i, inner + j], j < inner: n rows of [gate | up] (row stride ldg) */
void irm_silu_mul(const float *gu, long n, long inner, long ldg, float *out, long ldo, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (irm_team(nthreads, (double)n * inner)) schedule(static)
    for (long i = 0; i < n; i++) {
        const float *g = gu + i * ldg, *u = g + inner;
        float *oi = out + i * ldo;
        long j = 0;
#if defined(__AVX512F__)
        for (; j + 16 <= inner; j += 16)
            _mm512_storeu_ps(oi + j, _mm512_mul_ps(silu16(_mm512_loadu_ps(g + j)), _mm512_loadu_ps(u + j)));
#endif
        for (; j < inner; j++) oi[j] = silu1(g[j]) * u[j];
    }
}
