/* Products of a few rows that stream their weight: y[r, o] = sum_i x[r, i] * w[o, i] (+ bias[o]).
 *
 * The output rows shared among the threads given (each output's sum on one thread), fp32 products
 * and sums, for a weight whose rows are contiguous (w[o, i] at
 * w + o * ld + i) in bfloat16 or float32; x, bias and y in either. It reads each weight row once
 * for all the rows of x (at most IRM_MAX_ROWS), which is what a decode step needs: its products
 * are bound by reading the weight. Built by irminsul/model/native/__init__.py with -march=native;
 * the vector paths (AVX-512, and AVX2 through simd.h) keep four independent FMA chains for one or two
 * rows (one chain per sum is bound by the FMA's latency, well below the memory's speed), and with
 * AVX2 compute three outputs at a time for three or more rows (common.h dots3), a build
 * without them takes the plain loops, which the compiler vectorises (the flags allow reassociating
 * the sums). Where x and w are both
 * bfloat16 (a bf16 model) and the CPU has AVX512-BF16, the products are vdpbf16ps over x's own bf16
 * rows instead (common.h bf16_dots: faster than converting to float32, most of all for several rows).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

#define IRM_MAX_ROWS 8
/* How far ahead (bytes) the one-row loops ask for the weight's bytes early; 0: not at all. Whether it
 * pays differs between CPUs: model/gemv.py times both on the machine at hand and sets it
 * (irm_gemv_set_prefetch). */
static long irm_prefetch = 0;

void irm_gemv_set_prefetch(long bytes) { irm_prefetch = bytes > 0 ? bytes : 0; }

#if defined(__AVX512F__)
/* 16 weights from w + i (bf: bfloat16, else float32) as floats; the masked form reads only m's lanes */
static inline __m512 load16(const void *w, long i, int bf) {
    if (bf)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i))), 16));
    return _mm512_loadu_ps((const float *)w + i);
}

static inline __m512 load16_masked(const void *w, long i, __mmask16 m, int bf) {
    if (bf)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)w + i);
}
#endif


static inline float weight_at(const void *w, long i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* one weight row (bf: bfloat16, else float32) against `rows` rows of x (fp32, stride ldx): sums into
 * acc[r]. Always inlined where bf is a constant, so each dtype gets its own loops. */
static inline __attribute__((always_inline)) void row(const float *x, long rows, long ldx, const void *w, long in,
                                                      float *acc, int bf, long pf) {
#if defined(__AVX512F__)
    if (rows == 1) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        long i = 0;
        const char *bytes = (const char *)w;
        for (; i + 64 <= in; i += 64) {
            if (pf) /* the 64 weights' bytes, irm_prefetch ahead */
                for (int c = 0; c < (bf ? 2 : 4); c++) _mm_prefetch(bytes + i * (bf ? 2 : 4) + pf + 64 * c, _MM_HINT_T0);
            a0 = _mm512_fmadd_ps(load16(w, i, bf), _mm512_loadu_ps(x + i), a0);
            a1 = _mm512_fmadd_ps(load16(w, i + 16, bf), _mm512_loadu_ps(x + i + 16), a1);
            a2 = _mm512_fmadd_ps(load16(w, i + 32, bf), _mm512_loadu_ps(x + i + 32), a2);
            a3 = _mm512_fmadd_ps(load16(w, i + 48, bf), _mm512_loadu_ps(x + i + 48), a3);
        }
        for (; i < in; i += 16) {
            __mmask16 m = (__mmask16)(in - i >= 16 ? 0xffff : (1u << (in - i)) - 1);
            a0 = _mm512_fmadd_ps(load16_masked(w, i, m, bf), _mm512_maskz_loadu_ps(m, x + i), a0);
        }
        acc[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        return;
    }
    for (long r0 = 0; r0 < rows; r0 += 4) { /* four rows of x per pass over the (cached) weight row */
        long n = rows - r0 < 4 ? rows - r0 : 4;
        const float *x0 = x + r0 * ldx;
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (long i = 0; i < in; i += 16) {
            __mmask16 m = (__mmask16)(in - i >= 16 ? 0xffff : (1u << (in - i)) - 1);
            __m512 wv = load16_masked(w, i, m, bf);
            for (long r = 0; r < n; r++) a[r] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x0 + r * ldx + i), a[r]);
        }
        for (long r = 0; r < n; r++) acc[r0 + r] = _mm512_reduce_add_ps(a[r]);
    }
#elif IRM_VEC /* simd.h's vectors (AVX2): the same loops, the tails by its _n loads */
    if (rows == 1) {
        vf a0 = vf_zero(), a1 = a0, a2 = a0, a3 = a0;
        long i = 0;
        const char *bytes = (const char *)w;
        for (; i + 4 * IRM_W <= in; i += 4 * IRM_W) {
            if (pf) /* the weights' bytes, irm_prefetch ahead */
                for (int c = 0; c < (bf ? 2 : 4) * IRM_W / 16; c++)
                    _mm_prefetch(bytes + i * (bf ? 2 : 4) + pf + 64 * c, _MM_HINT_T0);
            a0 = vf_fma(vf_weights(w, i, bf), vf_load(x + i), a0);
            a1 = vf_fma(vf_weights(w, i + IRM_W, bf), vf_load(x + i + IRM_W), a1);
            a2 = vf_fma(vf_weights(w, i + 2 * IRM_W, bf), vf_load(x + i + 2 * IRM_W), a2);
            a3 = vf_fma(vf_weights(w, i + 3 * IRM_W, bf), vf_load(x + i + 3 * IRM_W), a3);
        }
        for (; i + IRM_W <= in; i += IRM_W) a0 = vf_fma(vf_weights(w, i, bf), vf_load(x + i), a0);
        if (i < in) a1 = vf_fma(vf_weights_n(w, i, in - i, bf), vf_load_n(x + i, in - i), a1);
        acc[0] = vf_hsum(vf_add(vf_add(a0, a1), vf_add(a2, a3)));
        return;
    }
    if (rows == 2) { /* two sums per row: four FMA chains, as one row's */
        vf a0 = vf_zero(), a1 = a0, b0 = a0, b1 = a0;
        const float *x1 = x + ldx;
        long i = 0;
        for (; i + 2 * IRM_W <= in; i += 2 * IRM_W) {
            vf w0 = vf_weights(w, i, bf), w1 = vf_weights(w, i + IRM_W, bf);
            a0 = vf_fma(w0, vf_load(x + i), a0), a1 = vf_fma(w1, vf_load(x + i + IRM_W), a1);
            b0 = vf_fma(w0, vf_load(x1 + i), b0), b1 = vf_fma(w1, vf_load(x1 + i + IRM_W), b1);
        }
        for (; i + IRM_W <= in; i += IRM_W) {
            vf w0 = vf_weights(w, i, bf);
            a0 = vf_fma(w0, vf_load(x + i), a0), b0 = vf_fma(w0, vf_load(x1 + i), b0);
        }
        if (i < in) {
            vf w0 = vf_weights_n(w, i, in - i, bf);
            a1 = vf_fma(w0, vf_load_n(x + i, in - i), a1), b1 = vf_fma(w0, vf_load_n(x1 + i, in - i), b1);
        }
        acc[0] = vf_hsum(vf_add(a0, a1)), acc[1] = vf_hsum(vf_add(b0, b1));
        return;
    }
    for (long r0 = 0; r0 < rows; r0 += 4) { /* four rows of x per pass over the (cached) weight row */
        long n = rows - r0 < 4 ? rows - r0 : 4;
        const float *x0 = x + r0 * ldx;
        vf a[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
        long i = 0;
        for (; i + IRM_W <= in; i += IRM_W) {
            vf wv = vf_weights(w, i, bf);
            for (long r = 0; r < n; r++) a[r] = vf_fma(wv, vf_load(x0 + r * ldx + i), a[r]);
        }
        if (i < in) {
            vf wv = vf_weights_n(w, i, in - i, bf);
            for (long r = 0; r < n; r++) a[r] = vf_fma(wv, vf_load_n(x0 + r * ldx + i, in - i), a[r]);
        }
        for (long r = 0; r < n; r++) acc[r0 + r] = vf_hsum(a[r]);
    }
#else
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float a = 0.0f;
        for (long i = 0; i < in; i++) a += xr[i] * weight_at(w, i, bf);
        acc[r] = a;
    }
#endif
}

#if IRM_VEC && !defined(__AVX512F__)
/* Outputs a pass of several rows computes together: with AVX2's 16 registers 4 rows x 3 weight rows
 * = 12 sums (4 rows x 1 weight row keeps 4 FMA chains in flight, bound by the FMA's latency when
 * several rows make the product compute-bound). */
#define OUT_TILE 3
#else
#define OUT_TILE 1
#endif

static void row_bf16(const float *x, long rows, long ldx, const void *w, long in, float *acc, long pf) {
    row(x, rows, ldx, w, in, acc, 1, pf);
}

static void row_f32(const float *x, long rows, long ldx, const void *w, long in, float *acc, long pf) {
    row(x, rows, ldx, w, in, acc, 0, pf);
}

int irm_max_rows(void) { return IRM_MAX_ROWS; }

int irm_openmp(void) { /* whether the kernels were built with OpenMP (else each runs on one thread) */
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}

/* output o of each row: acc[r] (+ bias[o]) into y (bf16 rounded to nearest even, or float32) */
static inline void put(const float *acc, long rows, long o, const void *bias, int bias_bf, void *y, int y_bf, long ldy) {
    float b = bias == NULL ? 0.0f : weight_at(bias, o, bias_bf);
    for (long r = 0; r < rows; r++) {
        float v = acc[r] + b;
        if (y_bf)
            ((uint16_t *)y)[r * ldy + o] = f32_to_bf16(v);
        else
            ((float *)y)[r * ldy + o] = v;
    }
}

/* y [rows, ldy] = x [rows, ldx] times w [out, ld]^T (+ bias [out]); *_bf: 1 bfloat16, 0 float32.
 * Returns 0, or -1 for rows outside 1..IRM_MAX_ROWS or no memory for x's fp32 copy. */
int irm_linear(const void *x, int x_bf, long rows, long ldx, const void *w, int w_bf, long out, long in, long ld,
               const void *bias, int bias_bf, void *y, int y_bf, long ldy, int nthreads) {
    if (rows < 1 || rows > IRM_MAX_ROWS) return -1;
    const int team = irm_team(nthreads, (double)out * in * rows);
#if defined(__AVX512BF16__)
    if (x_bf && w_bf) { /* a bf16 model's products: vdpbf16ps over x's own bf16 rows (common.h bf16_dots) */
        long n32 = (in + 31) / 32 * 32;
        uint16_t *xi = (uint16_t *)irm_alloc(sizeof(uint16_t) * (size_t)(rows * n32));
        if (!xi) return -1;
        bf16_interleave((const uint16_t *)x, rows, ldx, in, xi);
#pragma omp parallel for num_threads(nthreads) if (team) schedule(static)
        for (long o = 0; o < out; o++) {
            float acc[IRM_MAX_ROWS];
            bf16_dots(xi, rows, (const uint16_t *)w + o * ld, in, acc);
            put(acc, rows, o, bias, bias_bf, y, y_bf, ldy);
        }
        free(xi);
        return 0;
    }
#endif
    const float *xf = (const float *)x;
    float *copy = NULL;
    if (x_bf) { /* x's rows in fp32, once (they are read once per weight row) */
        copy = (float *)irm_alloc(sizeof(float) * (size_t)(rows * in));
        if (!copy) return -1;
        for (long r = 0; r < rows; r++)
            for (long i = 0; i < in; i++) copy[r * in + i] = bf16_to_f32(((const uint16_t *)x)[r * ldx + i]);
        xf = copy;
        ldx = in;
    }
    /* one or two rows: an output at a time (bound by reading the weight, one stream of it); more:
     * OUT_TILE outputs at a time (bound by the products) */
    const long step = rows > 2 ? OUT_TILE : 1, pf = irm_prefetch;
#pragma omp parallel for num_threads(nthreads) if (team) schedule(static)
    for (long t = 0; t < (out + step - 1) / step; t++) {
        long o = t * step;
#if OUT_TILE > 1
        if (step > 1 && o + OUT_TILE <= out) {
            float acc[OUT_TILE * IRM_MAX_ROWS];
            if (w_bf)
                dots3(xf, rows, ldx, (const uint16_t *)w + o * ld, ld, in, acc, IRM_MAX_ROWS, 1);
            else
                dots3(xf, rows, ldx, (const float *)w + o * ld, ld, in, acc, IRM_MAX_ROWS, 0);
            for (int j = 0; j < OUT_TILE; j++) put(acc + j * IRM_MAX_ROWS, rows, o + j, bias, bias_bf, y, y_bf, ldy);
            continue;
        }
#endif
        for (; o < out && o < (t + 1) * step; o++) {
            float acc[IRM_MAX_ROWS];
            if (w_bf)
                row_bf16(xf, rows, ldx, (const uint16_t *)w + o * ld, in, acc, pf);
            else
                row_f32(xf, rows, ldx, (const float *)w + o * ld, in, acc, pf);
            put(acc, rows, o, bias, bias_bf, y, y_bf, ldy);
        }
    }
    free(copy);
    return 0;
}

/* The same per head: y[r, h, o] = sum_i x[r, h, i] * w[h, o, i] for h < H (no bias): x's rows ldx and its
 * heads xh elements apart, w's heads wh and its rows ld, y's rows ldy and heads yh (attention's
 * absorbed W_UK and W_UV products, one small weight per head). The heads are shared among the
 * threads. Returns irm_linear's code (the first head's that failed). */
int irm_heads_linear(const void *x, int x_bf, long rows, long ldx, long xh, long H, const void *w, int w_bf, long wh,
                     long out, long in, long ld, void *y, int y_bf, long ldy, long yh, int nthreads) {
    if (rows < 1 || rows > IRM_MAX_ROWS) return -1;
    int rc = 0;
#pragma omp parallel for num_threads(nthreads) if (irm_team(nthreads, (double)H * out * in * rows)) schedule(static)
    for (long h = 0; h < H; h++) {
        int r = irm_linear((const char *)x + h * xh * (x_bf ? 2 : 4), x_bf, rows, ldx,
                           (const char *)w + h * wh * (w_bf ? 2 : 4), w_bf, out, in, ld, NULL, 0,
                           (char *)y + h * yh * (y_bf ? 2 : 4), y_bf, ldy, 1);
        if (r != 0) {
#pragma omp atomic write
            rc = r;
        }
    }
    return rc;
}
