/* Routed experts of a few tokens in one call, float32: out[t] = sum_j w[t, j] * E_j(x[t]) with
 * E(x) = (silu(x . W_gate) * (x . W_up)) . W_down, e = ids[t, j].
 *
 * A decode step of 32 sequences gives each of the bundled model's 8 experts a handful of rows; in
 * torch each expert is ~10 operations (find its rows, gather, two products, silu * up, weigh, add
 * back), ~80 us of dispatch for ~2 us of products. Here the assignments are sorted by expert in C,
 * and each expert's rows, gathered 8 at a time, go through its two products and silu * up: the
 * products read the expert's weights where MoE.stacked() keeps them, gate|up [E, H, 2I] and down
 * [E, I, H], either input-major (element [e, i, o] at e*s0 + i*s1 + o, s2 = 1: eight rows times
 * 32 outputs summed in registers) or out-major (s1 = 1: dot products). Sums in float32 in another
 * order than torch's products (as oneDNN's and MKL's differ among themselves). irm_moe_bf16 is the
 * same for a bfloat16 model on a CPU with AVX512-BF16 (out-major stacks only), its products common.h's
 * bf16_dots.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define RB 8 /* rows per block */
#define RB_BF16 64 /* ... in irm_moe_bf16, whose products read each weight row once for all of them */

void irm_silu_mul(const float *gu, long n, long inner, long ldg, float *out, long ldo); /* elementwise.c */

/* c[r][o] = sum_i a[r][i] * w[i*si + o*so], r < R <= RB, o < out; a rows of `in` at stride lda */
static void product(const float *restrict a, long R, long in, long lda, const float *restrict w, long si, long so,
                    long out, float *restrict c, long ldc) {
#if defined(__AVX512F__)
    if (so == 1 && R == RB && out % 32 == 0) { /* input-major, a full block: 8 x 32 sums in registers */
        for (long o = 0; o < out; o += 32) {
            __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
                   c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00;
            const float *wp = w + o;
            for (long i = 0; i < in; i++, wp += si) {
                __m512 w0 = _mm512_loadu_ps(wp), w1 = _mm512_loadu_ps(wp + 16), x;
#define ROW(r, lo, hi)                                 \
    x = _mm512_set1_ps(a[(r) * lda + i]);              \
    lo = _mm512_fmadd_ps(x, w0, lo);                   \
    hi = _mm512_fmadd_ps(x, w1, hi);
                ROW(0, c00, c01) ROW(1, c10, c11) ROW(2, c20, c21) ROW(3, c30, c31)
                ROW(4, c40, c41) ROW(5, c50, c51) ROW(6, c60, c61) ROW(7, c70, c71)
#undef ROW
            }
#define PUT(r, lo, hi)                               \
    _mm512_storeu_ps(c + (r) * ldc + o, lo);         \
    _mm512_storeu_ps(c + (r) * ldc + o + 16, hi);
            PUT(0, c00, c01) PUT(1, c10, c11) PUT(2, c20, c21) PUT(3, c30, c31)
            PUT(4, c40, c41) PUT(5, c50, c51) PUT(6, c60, c61) PUT(7, c70, c71)
#undef PUT
        }
        return;
    }
    if (si == 1 && in % 16 == 0 && out % 8 == 0) { /* out-major: eight outputs' dot products at a time, folded together */
        for (long r = 0; r < R; r++) {
            const float *ar = a + r * lda;
            for (long o = 0; o < out; o += 8) dots8(ar, w + o * so, so, in, c + r * ldc + o);
        }
        return;
    }
    if (si == 1 && in % 16 == 0) { /* out-major: each output a dot product per row */
        for (long o = 0; o < out; o++) {
            const float *wo = w + o * so;
            __m512 acc[RB];
            for (long r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
            for (long i = 0; i < in; i += 16) {
                __m512 wv = _mm512_loadu_ps(wo + i);
                for (long r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(a + r * lda + i), wv, acc[r]);
            }
            for (long r = 0; r < R; r++) c[r * ldc + o] = _mm512_reduce_add_ps(acc[r]);
        }
        return;
    }
#endif
    for (long r = 0; r < R; r++) {
        float *cr = c + r * ldc;
        for (long o = 0; o < out; o++) cr[o] = 0.0f;
        for (long i = 0; i < in; i++) {
            float x = a[r * lda + i];
            const float *wi = w + i * si;
            for (long o = 0; o < out; o++) cr[o] += x * wi[o * so];
        }
    }
}

/* the nk assignments' indices sorted by expert into order (a counting sort, stable: tokens in order
 * within an expert); expert e's run is order[start[e] .. start[e + 1]), start zeroed [E + 1] on
 * entry. Returns 0, or -1 without memory. */
static int sort_by_expert(const int64_t *ids, long nk, long E, long *start, long *order) {
    for (long a = 0; a < nk; a++) start[ids[a] + 1]++;
    for (long e = 0; e < E; e++) start[e + 1] += start[e];
    long *fill = (long *)malloc(sizeof(long) * (size_t)(E > 0 ? E : 1));
    if (!fill) return -1;
    memcpy(fill, start, sizeof(long) * (size_t)E);
    for (long a = 0; a < nk; a++) order[fill[ids[a]]++] = a;
    free(fill);
    return 0;
}

/* x [n, H] (row stride ldx), ids / weights [n, k]; gate_up element [e, i, o] at gu + e*gu0 + i*gu1 + o*gu2
 * (i < H, o < 2I), down [e, i, o] at dn + e*dn0 + i*dn1 + o*dn2 (i < I, o < H); out [n, H] (stride ldo),
 * overwritten. Returns 0, or -1 without memory for its buffers (out untouched), -2 for an expert id
 * outside [0, E). */
int irm_moe(const float *x, long n, long H, long ldx, const int64_t *ids, const float *weights, long k, long E,
            long I, const float *gu, long gu0, long gu1, long gu2, const float *dn, long dn0, long dn1, long dn2,
            float *out, long ldo) {
    long nk = n * k;
    for (long a = 0; a < nk; a++)
        if (ids[a] < 0 || ids[a] >= E) return -2;
    long *start = (long *)calloc((size_t)E + 1, sizeof(long));
    long *order = (long *)malloc(sizeof(long) * (size_t)(nk > 0 ? nk : 1));
    float *xs = (float *)irm_alloc(sizeof(float) * (size_t)(RB * H));
    float *h = (float *)irm_alloc(sizeof(float) * (size_t)(RB * 2 * I));
    float *act = (float *)irm_alloc(sizeof(float) * (size_t)(RB * I));
    float *y = (float *)irm_alloc(sizeof(float) * (size_t)(RB * H));
    if (!start || !order || !xs || !h || !act || !y) {
        free(start), free(order), free(xs), free(h), free(act), free(y);
        return -1;
    }
    if (sort_by_expert(ids, nk, E, start, order) != 0) {
        free(start), free(order), free(xs), free(h), free(act), free(y);
        return -1;
    }
    for (long t = 0; t < n; t++) memset(out + t * ldo, 0, sizeof(float) * (size_t)H);
    for (long e = 0; e < E; e++) {
        for (long b = start[e]; b < start[e + 1]; b += RB) {
            long R = start[e + 1] - b < RB ? start[e + 1] - b : RB;
            for (long r = 0; r < RB; r++) /* (a short block's missing rows are zeros: the 8-row kernel runs) */
                if (r < R)
                    memcpy(xs + r * H, x + (order[b + r] / k) * ldx, sizeof(float) * (size_t)H);
                else
                    memset(xs + r * H, 0, sizeof(float) * (size_t)H);
            long RR = (gu2 == 1 && (2 * I) % 32 == 0) ? RB : R;
            product(xs, RR, H, H, gu + e * gu0, gu1, gu2, 2 * I, h, 2 * I);
            irm_silu_mul(h, RR, I, 2 * I, act, I);
            RR = (dn2 == 1 && H % 32 == 0) ? RB : R;
            product(act, RR, I, I, dn + e * dn0, dn1, dn2, H, y, H);
            for (long r = 0; r < R; r++) {
                long a = order[b + r];
                float wt = weights[a], *ot = out + (a / k) * ldo;
                const float *yr = y + r * H;
                for (long j = 0; j < H; j++) ot[j] += wt * yr[j];
            }
        }
    }
    free(start), free(order), free(xs), free(h), free(act), free(y);
    return 0;
}

int irm_moe_has_bf16(void) { /* whether irm_moe_bf16 was built (AVX512-BF16) */
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* irm_moe for a bfloat16 model, where the CPU has AVX512-BF16: x [n, H] bf16 (row stride ldx), ids /
 * weights (float32) [n, k], out [n, H] bf16 (stride ldo), overwritten; gate_up and down bf16 and
 * out-major (each output's weights contiguous along the input): gate|up output o of expert e at
 * gu + e*gu0 + o*gu2 (H elements), down output o at dn + e*dn0 + o*dn2 (I elements). Each expert's
 * rows go through common.h's bf16_dots (vdpbf16ps: bf16 products, float32 sums):
 * gate|up in float32, silu * up rounded to bf16 for the down product (as torch's bf16 experts
 * round it), the weighted outputs summed in float32 and rounded once. An expert's rows go 64 at a
 * time (RB_BF16), so its weights are read once for them all. Returns 0, -1 without memory,
 * -2 for an expert id outside [0, E), -3 where it was not built. */
int irm_moe_bf16(const uint16_t *x, long n, long H, long ldx, const int64_t *ids, const float *weights, long k,
                 long E, long I, const uint16_t *gu, long gu0, long gu2, const uint16_t *dn, long dn0, long dn2,
                 uint16_t *out, long ldo) {
#if defined(__AVX512BF16__)
    long nk = n * k;
    for (long a = 0; a < nk; a++)
        if (ids[a] < 0 || ids[a] >= E) return -2;
    long H32 = (H + 31) / 32 * 32, I32 = (I + 31) / 32 * 32;
    long *start = (long *)calloc((size_t)E + 1, sizeof(long));
    long *order = (long *)malloc(sizeof(long) * (size_t)(nk > 0 ? nk : 1));
    uint16_t *xs = (uint16_t *)irm_alloc(sizeof(uint16_t) * (size_t)(RB_BF16 * H));
    uint16_t *xi = (uint16_t *)irm_alloc(sizeof(uint16_t) * (size_t)(RB_BF16 * H32));
    float *h = (float *)irm_alloc(sizeof(float) * (size_t)(RB_BF16 * 2 * I));
    float *act = (float *)irm_alloc(sizeof(float) * (size_t)(RB_BF16 * I));
    uint16_t *ab = (uint16_t *)irm_alloc(sizeof(uint16_t) * (size_t)(RB_BF16 * I));
    uint16_t *ai = (uint16_t *)irm_alloc(sizeof(uint16_t) * (size_t)(RB_BF16 * I32));
    float *y = (float *)irm_alloc(sizeof(float) * (size_t)(RB_BF16 * H));
    float *acc = (float *)irm_calloc((size_t)(n > 0 ? n : 1) * (size_t)H, sizeof(float));
    int rc = -1;
    if (!start || !order || !xs || !xi || !h || !act || !ab || !ai || !y || !acc) goto done;
    if (sort_by_expert(ids, nk, E, start, order) != 0) goto done;
    for (long e = 0; e < E; e++) {
        for (long b = start[e]; b < start[e + 1]; b += RB_BF16) {
            long R = start[e + 1] - b < RB_BF16 ? start[e + 1] - b : RB_BF16;
            float d[RB_BF16];
            for (long r = 0; r < R; r++) memcpy(xs + r * H, x + (order[b + r] / k) * ldx, sizeof(uint16_t) * (size_t)H);
            bf16_interleave(xs, R, H, H, xi);
            for (long o = 0; o < 2 * I; o++) {
                bf16_dots(xi, R, gu + e * gu0 + o * gu2, H, d);
                for (long r = 0; r < R; r++) h[r * 2 * I + o] = d[r];
            }
            irm_silu_mul(h, R, I, 2 * I, act, I);
            for (long j = 0; j < R * I; j++) ab[j] = f32_to_bf16(act[j]);
            bf16_interleave(ab, R, I, I, ai);
            for (long o = 0; o < H; o++) {
                bf16_dots(ai, R, dn + e * dn0 + o * dn2, I, d);
                for (long r = 0; r < R; r++) y[r * H + o] = d[r];
            }
            for (long r = 0; r < R; r++) {
                long a = order[b + r];
                float wt = weights[a], *at = acc + (a / k) * H;
                const float *yr = y + r * H;
                for (long j = 0; j < H; j++) at[j] += wt * yr[j];
            }
        }
    }
    for (long t = 0; t < n; t++)
        for (long j = 0; j < H; j++) out[t * ldo + j] = f32_to_bf16(acc[t * H + j]);
    rc = 0;
done:
    free(start), free(order), free(xs), free(xi), free(h), free(act), free(ab), free(ai), free(y), free(acc);
    return rc;
#else
    (void)x, (void)n, (void)H, (void)ldx, (void)ids, (void)weights, (void)k, (void)E, (void)I, (void)gu, (void)gu0,
        (void)gu2, (void)dn, (void)dn0, (void)dn2, (void)out, (void)ldo;
    return -3;
#endif
}
