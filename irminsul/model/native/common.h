/* What the native kernels share (included by each source; irminsul/model/native/__init__.py builds them). */
#ifndef IRM_COMMON_H
#define IRM_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#include "simd.h"

/* The least work (multiply-adds; elements for the one-pass kernels) a call shares among its threads:
 * below it the call runs on the calling thread alone, as waking a team costs more than it saves.
 * (torch's at::internal::GRAIN_SIZE plays the same part for its parallel loops.) Every kernel splits
 * only independent outputs among threads, never one sum, so its result is the same at any count. */
#ifndef IRM_GRAIN
#define IRM_GRAIN 32768L
#endif

/* whether a call of `work` units (as IRM_GRAIN's) runs on a team of nthreads */
static inline int irm_team(int nthreads, double work) { return nthreads > 1 && work >= (double)IRM_GRAIN; }

/* Denormals flushed to zero on the calling thread while a kernel runs (as oneDNN's kernels do): a real
 * model's softmax has probabilities far below FLT_MIN, and multiplying them at the denormal rate made a
 * decode call ~2x slower. Each thread of a team sets its own (MXCSR is per thread), so every thread
 * rounds alike. irm_ftz_on returns the state irm_ftz_off restores. */
static inline unsigned int irm_ftz_on(void) {
#if defined(__SSE2__)
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    return csr;
#else
    return 0;
#endif
}

static inline void irm_ftz_off(unsigned int csr) {
#if defined(__SSE2__)
    _mm_setcsr(csr);
#else
    (void)csr;
#endif
}

/* Buffers the vector loops load from: 64-byte aligned (a cache line; malloc gives 16, and a 64-byte
 * load from such a buffer spans two lines: the bf16 experts' products ran at half their speed), the
 * size rounded up to a multiple of 64 (as aligned_alloc asks); free() releases them. */
static inline void *irm_alloc(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64 + 64 * (bytes == 0)); }

static inline void *irm_calloc(size_t n, size_t size) {
    void *p = irm_alloc(n * size);
    if (p) memset(p, 0, n * size);
    return p;
}

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

#if defined(__AVX512F__)
/* x * sigmoid(x), 16 at a time: with e = e^-|x| (<= 1, no overflow), sigmoid is 1 / (1 + e) for
 * x >= 0 and e / (1 + e) below (NaN stays NaN, +inf gives +inf) */
static inline __m512 silu16(__m512 x) {
    __m512 ax = _mm512_abs_ps(x);
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), ax));
    __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_set1_ps(1.0f), e);
    /* 1 / (1 + e) for 1 + e in [1, 2]: the 14-bit reciprocal and one Newton step (~2^-23 relative) */
    __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), e), r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
    /* below -87 torch's x / (1 + e^-x) is x / inf: -0 (NaN for -inf), as x * 0 gives */
    __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    return _mm512_mask_mul_ps(_mm512_mul_ps(x, _mm512_mul_ps(num, r)), under, x, _mm512_setzero_ps());
}
#endif

#if defined(__AVX512F__)
/* out[k] = the sum of c_k's 16 lanes, k < 8: the eight sums folded together (halves, quarters, then
 * pairs within each 128-bit lane), ~22 instructions where eight separate reductions take ~64 */
static inline void reduce8(__m512 c0, __m512 c1, __m512 c2, __m512 c3, __m512 c4, __m512 c5, __m512 c6, __m512 c7,
                           float *out) {
    /* lanes of a01: [c0 L0+L2, c0 L1+L3, c1 L0+L2, c1 L1+L3] (L: 128-bit lanes) */
    __m512 a01 = _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x44), _mm512_shuffle_f32x4(c0, c1, 0xEE));
    __m512 a23 = _mm512_add_ps(_mm512_shuffle_f32x4(c2, c3, 0x44), _mm512_shuffle_f32x4(c2, c3, 0xEE));
    __m512 a45 = _mm512_add_ps(_mm512_shuffle_f32x4(c4, c5, 0x44), _mm512_shuffle_f32x4(c4, c5, 0xEE));
    __m512 a67 = _mm512_add_ps(_mm512_shuffle_f32x4(c6, c7, 0x44), _mm512_shuffle_f32x4(c6, c7, 0xEE));
    /* lane k of b0: 4 partial sums of c_k; of b4: of c_(k+4) */
    __m512 b0 = _mm512_add_ps(_mm512_shuffle_f32x4(a01, a23, 0x88), _mm512_shuffle_f32x4(a01, a23, 0xDD));
    __m512 b4 = _mm512_add_ps(_mm512_shuffle_f32x4(a45, a67, 0x88), _mm512_shuffle_f32x4(a45, a67, 0xDD));
    /* per lane k: [x0 + x2, y0 + y2, x1 + x3, y1 + y3] (x of b0, y of b4), then the two halves added */
    __m512 u = _mm512_add_ps(_mm512_unpacklo_ps(b0, b4), _mm512_unpackhi_ps(b0, b4));
    __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
    float t[16];
    _mm512_storeu_ps(t, v);
    out[0] = t[0], out[4] = t[1], out[1] = t[4], out[5] = t[5], out[2] = t[8], out[6] = t[9], out[3] = t[12], out[7] = t[13];
}
#endif

#if IRM_VEC
#if defined(__AVX512F__)
#define vf_exp_nonpositive exp_nonpositive
#define vf_silu silu16
#define vf_reduce8 reduce8
#else
#define vf_exp_nonpositive exp_nonpositive8
#define vf_silu silu8
#define vf_reduce8 reduce8_avx2
#endif

/* acc[k] += a[0..n) . rows[k][0..n) for k < 8, n a multiple of IRM_W: one load of `a` serves the eight
 * rows (the constant count, unrolled once inlined, keeps the sums in registers) */
static inline void fma8(const float *restrict a, const float *const *rows, long n, vf *acc) {
    for (long i = 0; i < n; i += IRM_W) {
        vf av = vf_load(a + i);
        for (int k = 0; k < 8; k++) acc[k] = vf_fma(av, vf_load(rows[k] + i), acc[k]);
    }
}

/* out[k] = a[0..n) . (b + k * ld)[0..n) for k < 8, n a multiple of IRM_W: eight dot products with rows
 * `ld` floats apart, folded together */
static inline void dots8(const float *restrict a, const float *b, long ld, long n, float *out) {
    const float *rows[8] = {b, b + ld, b + 2 * ld, b + 3 * ld, b + 4 * ld, b + 5 * ld, b + 6 * ld, b + 7 * ld};
    vf acc[8];
    for (int k = 0; k < 8; k++) acc[k] = vf_zero();
    fma8(a, rows, n, acc);
    vf_reduce8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7], out);
}
#endif

/* bfloat16 rows of x for bf16_dots: `rows` rows (ldx elements apart) in groups of up to four, each
 * group's rows interleaved 32 elements at a time (group g's row r's elements i .. i + 31 at
 * xi + g * 4 * n32 + (i / 32) * R * 32 + r * 32, R the group's rows; zeros past n up to n32, n
 * rounded up to 32), so that a weight row's products read x as one stream per group. xi holds
 * rows * n32 elements. */
static inline void bf16_interleave(const uint16_t *x, long rows, long ldx, long n, uint16_t *xi) {
    long n32 = (n + 31) / 32 * 32;
    for (long g = 0; g * 4 < rows; g++) {
        long R = rows - 4 * g < 4 ? rows - 4 * g : 4;
        uint16_t *xg = xi + g * 4 * n32;
        for (long r = 0; r < R; r++) {
            const uint16_t *xr = x + (4 * g + r) * ldx;
            for (long i = 0; i < n32; i++) xg[(i / 32) * R * 32 + r * 32 + i % 32] = i < n ? xr[i] : 0;
        }
    }
}

#if defined(__AVX512BF16__)
/* out[r] = x_r . w[0 .. n) for the R (<= 4, a constant where it is inlined) interleaved rows of one
 * group (bf16_interleave), w a bfloat16 weight row: vdpbf16ps (each pair of elements multiplied
 * exactly and summed in float32; denormal inputs read as zero), two sums per row. `ahead`: bytes of
 * w asked for early (0: none). Variants with eight rows of x in one pass, or two or four weight rows
 * at once, read slower (bench_gemv_layout.py times it as kernel_choice does). */
static inline __attribute__((always_inline)) void bf16_group(const uint16_t *xg, const int R, const uint16_t *w,
                                                             long n, float *out, long ahead) {
    __m512 a0[4], a1[4];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    long i = 0;
    for (; i + 64 <= n; i += 64) {
        if (ahead) {
            _mm_prefetch((const char *)(w + i) + ahead, _MM_HINT_T0);
            _mm_prefetch((const char *)(w + i) + ahead + 64, _MM_HINT_T0);
        }
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i), w1 = (__m512bh)_mm512_loadu_si512(w + i + 32);
        const uint16_t *xb = xg + (i / 32) * R * 32;
        for (int r = 0; r < R; r++) {
            a0[r] = _mm512_dpbf16_ps(a0[r], (__m512bh)_mm512_loadu_si512(xb + r * 32), w0);
            a1[r] = _mm512_dpbf16_ps(a1[r], (__m512bh)_mm512_loadu_si512(xb + R * 32 + r * 32), w1);
        }
    }
    for (; i < n; i += 32) { /* (x is zero past n; w's tail is masked) */
        __mmask32 m = n - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (n - i)) - 1);
        __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + i);
        const uint16_t *xb = xg + (i / 32) * R * 32;
        for (int r = 0; r < R; r++) a0[r] = _mm512_dpbf16_ps(a0[r], (__m512bh)_mm512_loadu_si512(xb + r * 32), wv);
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}

/* out[r] = x_r . w[0 .. n) for r < rows, x interleaved by bf16_interleave into xi: the first group
 * of four asks for w early, the others read the row again from the cache */
static inline void bf16_dots(const uint16_t *xi, long rows, const uint16_t *w, long n, float *out) {
    long n32 = (n + 31) / 32 * 32;
    for (long g = 0; g * 4 < rows; g++) {
        long R = rows - 4 * g < 4 ? rows - 4 * g : 4;
        const uint16_t *xg = xi + g * 4 * n32;
        long ahead = g == 0 ? 4096 : 0;
        switch (R) {
        case 1: bf16_group(xg, 1, w, n, out + 4 * g, ahead); break;
        case 2: bf16_group(xg, 2, w, n, out + 4 * g, ahead); break;
        case 3: bf16_group(xg, 3, w, n, out + 4 * g, ahead); break;
        default: bf16_group(xg, 4, w, n, out + 4 * g, ahead); break;
        }
    }
}
#endif

/* out[r] = x_r . w[0 .. n) for M (<= 4, a constant where it is inlined) float32 rows x_r = x + r * ldx
 * and a bfloat16 weight row w, widened to float32 IRM_W at a time (the products of a bf16 model where
 * the CPU has no vdpbf16ps: bf16 times bf16 is exact in float32, as there). Each row keeps U = 4 / M
 * independent sums (four FMA chains in all for one or two rows): one chain per row is bound by the
 * FMA's latency, below the memory's speed, when a weight row serves only one or two rows. */
static inline __attribute__((always_inline)) void widen_group(const float *x, const int M, long ldx,
                                                              const uint16_t *w, long n, float *out) {
    const int U = M == 1 ? 4 : M == 2 ? 2 : 1;
    vf a[4][4];
    for (int r = 0; r < M; r++)
        for (int u = 0; u < U; u++) a[r][u] = vf_zero();
    long i = 0;
    for (; i + U * IRM_W <= n; i += U * IRM_W)
        for (int u = 0; u < U; u++) {
            vf wv = vf_load_bf16(w + i + u * IRM_W);
            for (int r = 0; r < M; r++) a[r][u] = vf_fma(vf_load(x + r * ldx + i + u * IRM_W), wv, a[r][u]);
        }
    for (; i + IRM_W <= n; i += IRM_W) {
        vf wv = vf_load_bf16(w + i);
        for (int r = 0; r < M; r++) a[r][0] = vf_fma(vf_load(x + r * ldx + i), wv, a[r][0]);
    }
    if (i < n) {
        vf wv = vf_load_bf16_n(w + i, n - i);
        for (int r = 0; r < M; r++) a[r][0] = vf_fma(vf_load_n(x + r * ldx + i, n - i), wv, a[r][0]);
    }
    for (int r = 0; r < M; r++) {
        vf s = a[r][0];
        for (int u = 1; u < U; u++) s = vf_add(s, a[r][u]);
        out[r] = vf_hsum(s);
    }
}

/* out[r] = x_r . w[0 .. n) for r < rows: widen_group over groups of four rows */
static inline void widen_dots(const float *x, long rows, long ldx, const uint16_t *w, long n, float *out) {
    for (long r0 = 0; r0 < rows; r0 += 4) {
        const float *xg = x + r0 * ldx;
        switch (rows - r0 < 4 ? rows - r0 : 4) {
        case 1: widen_group(xg, 1, ldx, w, n, out + r0); break;
        case 2: widen_group(xg, 2, ldx, w, n, out + r0); break;
        case 3: widen_group(xg, 3, ldx, w, n, out + r0); break;
        default: widen_group(xg, 4, ldx, w, n, out + r0); break;
        }
    }
}

/* IRM_W weights from w + i (bf: bfloat16, else float32) as floats; the _n form the first n */
static inline vf vf_weights(const void *w, long i, int bf) {
    return bf ? vf_load_bf16((const uint16_t *)w + i) : vf_load((const float *)w + i);
}

static inline vf vf_weights_n(const void *w, long i, long n, int bf) {
    return bf ? vf_load_bf16_n((const uint16_t *)w + i, n) : vf_load_n((const float *)w + i, n);
}

/* dots3's tile: M <= 4 rows from x0 against the three weight rows w, w1, w2 */
static inline __attribute__((always_inline)) void dots3_tile(const float *x0, long M, long ldx, const void *w,
                                                             const void *w1, const void *w2, long n, float *out,
                                                             long ldo, int bf) {
    vf a[4], b[4], c[4];
    for (int r = 0; r < 4; r++) a[r] = b[r] = c[r] = vf_zero();
    long i = 0;
    for (; i + IRM_W <= n; i += IRM_W) {
        vf wa = vf_weights(w, i, bf), wb = vf_weights(w1, i, bf), wc = vf_weights(w2, i, bf);
        for (long r = 0; r < M; r++) {
            vf xv = vf_load(x0 + r * ldx + i);
            a[r] = vf_fma(wa, xv, a[r]), b[r] = vf_fma(wb, xv, b[r]), c[r] = vf_fma(wc, xv, c[r]);
        }
    }
    if (i < n) {
        vf wa = vf_weights_n(w, i, n - i, bf), wb = vf_weights_n(w1, i, n - i, bf), wc = vf_weights_n(w2, i, n - i, bf);
        for (long r = 0; r < M; r++) {
            vf xv = vf_load_n(x0 + r * ldx + i, n - i);
            a[r] = vf_fma(wa, xv, a[r]), b[r] = vf_fma(wb, xv, b[r]), c[r] = vf_fma(wc, xv, c[r]);
        }
    }
    for (long r = 0; r < M; r++) out[r] = vf_hsum(a[r]), out[ldo + r] = vf_hsum(b[r]), out[2 * ldo + r] = vf_hsum(c[r]);
}

/* out[j * ldo + r] = x_r . w_j[0 .. n) for three weight rows w_j = w + j * ldw (bf: bfloat16, widened
 * as read, else float32) and r < rows (float32, ldx apart): rows taken four at a time against the
 * three weight rows (12 sums: AVX2's 16 registers hold them and the loads), for products of three or
 * more rows, which the FMA's throughput bounds rather than the weight's reading. Each sum is one FMA
 * chain over n (gemv.c's several-row order). Always inlined where bf is a constant.
 * Each call of the tile has M a constant (4, or the last group's 1-3), so its sums are unrolled into
 * registers (with a variable M the compiler kept them in memory). */
static inline __attribute__((always_inline)) void dots3(const float *x, long rows, long ldx, const void *w, long ldw,
                                                        long n, float *out, long ldo, int bf) {
    const void *w1 = (const char *)w + ldw * (bf ? 2 : 4), *w2 = (const char *)w1 + ldw * (bf ? 2 : 4);
    long r0 = 0;
    for (; r0 + 4 <= rows; r0 += 4) dots3_tile(x + r0 * ldx, 4, ldx, w, w1, w2, n, out + r0, ldo, bf);
    switch (rows - r0) { /* (the last group's count a constant too) */
    case 3: dots3_tile(x + r0 * ldx, 3, ldx, w, w1, w2, n, out + r0, ldo, bf); break;
    case 2: dots3_tile(x + r0 * ldx, 2, ldx, w, w1, w2, n, out + r0, ldo, bf); break;
    case 1: dots3_tile(x + r0 * ldx, 1, ldx, w, w1, w2, n, out + r0, ldo, bf); break;
    }
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One block of a row's scores p[0 .. n) (-inf: a key not seen), bm their maximum, into the row's running
 * softmax (flash attention's): mx and sum its maximum and sum so far, o[0 .. vd) its output so far,
 * rescaled by e^(mx - bm) when the maximum grows; p becomes the block's e^(p - mx) (0 where not seen).
 * A block with nothing seen (bm -inf) leaves the row as it was and p zeros. (mla_decode.c and
 * prefill_attention.c fold their blocks through it.) */
static inline void softmax_fold(float *p, long n, float bm, float *mx, float *sum, float *o, long vd) {
    if (bm == -INFINITY) {
        memset(p, 0, sizeof(float) * (size_t)n);
        return;
    }
    if (bm > *mx) {
        if (*mx != -INFINITY) {
            float a = expf(*mx - bm);
            *sum *= a;
            for (long c = 0; c < vd; c++) o[c] *= a;
        }
        *mx = bm;
    }
#if defined(__AVX512F__)
    const __m512 ninf = _mm512_set1_ps(-INFINITY), m = _mm512_set1_ps(*mx);
    __m512 acc = _mm512_setzero_ps();
    for (long k = 0; k < n; k += 16) {
        __mmask16 in = (__mmask16)(n - k >= 16 ? 0xffff : (1u << (n - k)) - 1);
        __m512 x = _mm512_mask_loadu_ps(ninf, in, p + k);
        __mmask16 seen = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
        __m512 e = _mm512_maskz_mov_ps(seen, exp_nonpositive(_mm512_sub_ps(x, m)));
        _mm512_mask_storeu_ps(p + k, in, e);
        acc = _mm512_add_ps(acc, e);
    }
    *sum += _mm512_reduce_add_ps(acc);
#elif IRM_VEC /* AVX2: the lanes past n and the keys not seen (-inf) masked by compares */
    const __m256 ninf = _mm256_set1_ps(-INFINITY), m = _mm256_set1_ps(*mx);
    __m256 acc = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= n; k += 8) {
        __m256 x = _mm256_loadu_ps(p + k);
        __m256 e = _mm256_and_ps(_mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ), exp_nonpositive8(_mm256_sub_ps(x, m)));
        _mm256_storeu_ps(p + k, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (k < n) {
        __m256i in = vf_mask(n - k);
        __m256 x = _mm256_blendv_ps(ninf, _mm256_maskload_ps(p + k, in), _mm256_castsi256_ps(in));
        __m256 e = _mm256_and_ps(_mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ), exp_nonpositive8(_mm256_sub_ps(x, m)));
        _mm256_maskstore_ps(p + k, in, e);
        acc = _mm256_add_ps(acc, e);
    }
    *sum += vf_hsum(acc);
#else
    float add = 0.0f;
    for (long k = 0; k < n; k++) {
        p[k] = p[k] == -INFINITY ? 0.0f : expf(p[k] - *mx);
        add += p[k];
    }
    *sum += add;
#endif
}

/* silu(g) one at a time, as torch computes it: g / (1 + e^-g) */
static inline float silu1(float g) { return g / (1.0f + expf(-g)); }

#endif
