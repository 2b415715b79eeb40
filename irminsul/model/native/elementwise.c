/* A layer's small float32 operations, each one pass over its rows: RMSNorm, and SwiGLU's
 * silu(gate) * up.
 *
 * torch computes RMSNorm as five operations (x^2, the mean, + eps, rsqrt, two products), each a
 * pass over [n, d] and a dispatch; silu(g) * u as two. These compute the same in one pass: RMSNorm
 * in the same order of roundings but for the sum of squares' order (a sum in float32, reassociated
 * as torch's own vectorised sum is), silu with simd.h's exp (and on AVX-512 its reciprocal, ~1e-7
 * relative). The rows are shared among the threads given; the vector paths (simd.h) take IRM_W floats
 * at a time (16 with AVX-512, 8 with AVX2), the plain loops are vectorised by the compiler elsewhere.
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
#if IRM_VEC
        vf a0 = vf_zero(), a1 = a0;
        for (; j + 2 * IRM_W <= d; j += 2 * IRM_W) {
            vf v0 = vf_load(xi + j), v1 = vf_load(xi + j + IRM_W);
            a0 = vf_fma(v0, v0, a0);
            a1 = vf_fma(v1, v1, a1);
        }
        ss = vf_hsum(vf_add(a0, a1));
#else
        ss = 0.0f;
#endif
        for (; j < d; j++) ss += xi[j] * xi[j];
        float scale = 1.0f / sqrtf(ss / (float)d + eps);
        j = 0;
#if IRM_VEC
        vf s = vf_set1(scale);
        for (; j + IRM_W <= d; j += IRM_W) vf_store(oi + j, vf_mul(vf_load(w + j), vf_mul(vf_load(xi + j), s)));
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
#if IRM_VEC
        for (; j + IRM_W <= inner; j += IRM_W) vf_store(oi + j, vf_mul(vf_silu(vf_load(g + j)), vf_load(u + j)));
#endif
        for (; j < inner; j++) oi[j] = silu1(g[j]) * u[j];
    }
}
