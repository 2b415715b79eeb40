/* Prefill attention in MLA's expanded form, float32 (what SDPA's flash kernel computes for
 * model/attention/reference.py `_expanded_attention`, without assembling padded head-major copies for it).
 *
 * Per sequence b and head h: queries i < qlen[b] at positions qpos[b, i], keys j < T whose slot is not 0
 * (slot 0: no row) and j <= qpos[b, i]; the q·k width is nope + rope (q = [q_nope | q_pe], k = [k_nope
 * | k_r], k_r shared by the heads, both already rotated), values vd wide:
 * out[b, i, h] = softmax_j(scale * q . k_j) v_j. Every tensor is passed as a base pointer and element
 * strides (its last dimension contiguous), so the caller's views (the kv_b product split into k_nope
 * and v, the query rows' grid) are read where they lie.
 *
 * Flash attention's order: queries in superblocks of QS rows, keys in blocks of KB; for each key block,
 * each tile of QB query rows: scores, each row's running maximum and sum (its output rescaled when the
 * maximum grows), then probabilities times values, while the block is in cache. Keys past a tile's last
 * query position are never read. A head's keys are first transposed into blocks of KB, each [d, KB]
 * contiguous (the rope rows once per sequence, shared by the heads), and its values copied into [T, vd]
 * rows, so that with vectors (simd.h) a score tile is an outer product: per q·k column, QB broadcast
 * query values times up to TV vectors of keys (AVX-512: 4 of 16, QB x 64 sums in registers; AVX2: 2 of
 * 8), and an output tile the same with values: QB probabilities times up to TV vectors of one value
 * row. Elsewhere the same loops in plain C.
 *
 * Threads share the work by (sequence, head, run of superblocks): each item transposes its head's keys
 * up to the last its queries see, into its thread's buffers (one head's keys and values, linear in T);
 * a sequence's heads are split into runs of superblocks only where there are too few (sequence, head)
 * pairs to go round. A query row computes the same whichever item holds it.
 */
#include <math.h>

#include "common.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#define QB 6  /* query rows per block */
#define KB 64 /* keys per block (4 vectors of 16) */
#define QS 48 /* query rows per superblock: QS / QB tiles share each key block while it is in cache */

#if IRM_VEC
/* The register tiles (simd.h's vectors): a score tile QB query rows x up to TV vectors of keys, a value
 * tile QB rows x up to TV vectors of value columns: 4 with AVX-512 (32 registers), 2 with AVX2 (16) */
#if defined(__AVX512F__)
#define TV 4
static inline __mmask16 tail_mask(long n) { return (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1); }
#else
#define TV 2
#endif

/* s[i * KB + W v + l] = sum_e q[i * d + e] kt[e * ldk + W v + l], i < QB, v < NV (W = IRM_W) */
#define SCORE_TILE(NAME, NV)                                                                              \
    static void NAME(const float *q, long d, const float *kt, long ldk, float *s) {                       \
        vf a[QB][NV];                                                                                     \
        for (int i = 0; i < QB; i++)                                                                      \
            for (int v = 0; v < NV; v++) a[i][v] = vf_zero();                                             \
        for (long e = 0; e < d; e++) {                                                                    \
            vf k[NV];                                                                                     \
            for (int v = 0; v < NV; v++) k[v] = vf_load(kt + e * ldk + IRM_W * v);                        \
            for (int i = 0; i < QB; i++) {                                                                \
                vf qi = vf_set1(q[i * d + e]);                                                            \
                for (int v = 0; v < NV; v++) a[i][v] = vf_fma(qi, k[v], a[i][v]);                         \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < QB; i++)                                                                      \
            for (int v = 0; v < NV; v++) vf_store(s + i * KB + IRM_W * v, a[i][v]);                       \
    }
SCORE_TILE(score_tile1, 1)
SCORE_TILE(score_tile2, 2)
#if defined(__AVX512F__)
SCORE_TILE(score_tile3, 3)
SCORE_TILE(score_tile4, 4)
#endif

/* o[i * ldo + c0 + ..] += sum_k p[i * KB + k] v_k[c0 + ..] for i < QB, n keys, the columns c0 .. c0 +
 * 16 NV (the last vector masked to `last` lanes); v_k = v + k * ldv */
#if defined(__AVX512F__)
#define VALUE_TILE(NAME, NV)                                                                              \
    static void NAME(float *o, long ldo, const float *p, const float *v, long ldv, long n, long c0,       \
                     __mmask16 last) {                                                                    \
        __m512 a[QB][NV];                                                                                 \
        for (int i = 0; i < QB; i++)                                                                      \
            for (int u = 0; u < NV; u++)                                                                  \
                a[i][u] = _mm512_maskz_loadu_ps(u == NV - 1 ? last : 0xffff, o + i * ldo + c0 + 16 * u);      \
        for (long k = 0; k < n; k++) {                                                                    \
            __m512 x[NV];                                                                                 \
            for (int u = 0; u < NV; u++)                                                                  \
                x[u] = _mm512_maskz_loadu_ps(u == NV - 1 ? last : 0xffff, v + k * ldv + c0 + 16 * u);     \
            for (int i = 0; i < QB; i++) {                                                                \
                __m512 pi = _mm512_set1_ps(p[i * KB + k]);                                                \
                for (int u = 0; u < NV; u++) a[i][u] = _mm512_fmadd_ps(pi, x[u], a[i][u]);                \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < QB; i++)                                                                      \
            for (int u = 0; u < NV; u++)                                                                  \
                _mm512_mask_storeu_ps(o + i * ldo + c0 + 16 * u, u == NV - 1 ? last : 0xffff, a[i][u]);       \
    }
VALUE_TILE(value_tile1, 1)
VALUE_TILE(value_tile2, 2)
VALUE_TILE(value_tile3, 3)
VALUE_TILE(value_tile4, 4)
#else
/* AVX2's: the same with the last vector's `last` lanes loaded and stored by simd.h's _n forms */
#define VALUE_TILE(NAME, NV)                                                                              \
    static void NAME(float *o, long ldo, const float *p, const float *v, long ldv, long n, long c0, long last) { \
        vf a[QB][NV];                                                                                     \
        for (int i = 0; i < QB; i++)                                                                      \
            for (int u = 0; u < NV; u++)                                                                  \
                a[i][u] = u == NV - 1 ? vf_load_n(o + i * ldo + c0 + IRM_W * u, last)                     \
                                      : vf_load(o + i * ldo + c0 + IRM_W * u);                            \
        for (long k = 0; k < n; k++) {                                                                    \
            vf x[NV];                                                                                     \
            for (int u = 0; u < NV; u++)                                                                  \
                x[u] = u == NV - 1 ? vf_load_n(v + k * ldv + c0 + IRM_W * u, last)                        \
                                   : vf_load(v + k * ldv + c0 + IRM_W * u);                               \
            for (int i = 0; i < QB; i++) {                                                                \
                vf pi = vf_set1(p[i * KB + k]);                                                           \
                for (int u = 0; u < NV; u++) a[i][u] = vf_fma(pi, x[u], a[i][u]);                         \
            }                                                                                             \
        }                                                                                                 \
        for (int i = 0; i < QB; i++)                                                                      \
            for (int u = 0; u < NV; u++)                                                                  \
                if (u == NV - 1)                                                                          \
                    vf_store_n(o + i * ldo + c0 + IRM_W * u, a[i][u], last);                              \
                else                                                                                      \
                    vf_store(o + i * ldo + c0 + IRM_W * u, a[i][u]);                                      \
    }
VALUE_TILE(value_tile1, 1)
VALUE_TILE(value_tile2, 2)
#endif
#endif

/* s [QB, KB] = q [QB, d] times kt[:, 0 .. n) (ldk apart), n <= KB */
static void scores(const float *q, long d, const float *kt, long ldk, long n, float *s) {
#if defined(__AVX512F__)
    switch ((n + 15) / 16) { /* kt holds zeros up to a multiple of 16 past the last key */
    case 1: score_tile1(q, d, kt, ldk, s); return;
    case 2: score_tile2(q, d, kt, ldk, s); return;
    case 3: score_tile3(q, d, kt, ldk, s); return;
    default: score_tile4(q, d, kt, ldk, s); return;
    }
#elif IRM_VEC
    for (long k0 = 0; k0 < n; k0 += TV * IRM_W) /* (kt holds zeros up to a multiple of IRM_W past the last key) */
        if (n - k0 > IRM_W)
            score_tile2(q, d, kt + k0, ldk, s + k0);
        else
            score_tile1(q, d, kt + k0, ldk, s + k0);
#else
    for (int i = 0; i < QB; i++)
        for (long k = 0; k < n; k++) {
            float acc = 0.0f;
            for (long e = 0; e < d; e++) acc += q[i * d + e] * kt[e * ldk + k];
            s[i * KB + k] = acc;
        }
#endif
}

/* o [QB, vd] (ldo apart) += p [QB, n] times the n value rows v + k * ldv */
static void values(float *o, long ldo, const float *p, const float *v, long ldv, long n, long vd) {
#if defined(__AVX512F__)
    for (long c0 = 0; c0 < vd; c0 += 64) {
        long left = vd - c0, nv = left >= 64 ? 4 : (left + 15) / 16;
        __mmask16 last = tail_mask(left - 16 * (nv - 1));
        switch (nv) {
        case 1: value_tile1(o, ldo, p, v, ldv, n, c0, last); break;
        case 2: value_tile2(o, ldo, p, v, ldv, n, c0, last); break;
        case 3: value_tile3(o, ldo, p, v, ldv, n, c0, last); break;
        default: value_tile4(o, ldo, p, v, ldv, n, c0, last); break;
        }
    }
#elif IRM_VEC
    for (long c0 = 0; c0 < vd; c0 += TV * IRM_W) {
        long left = vd - c0;
        if (left > IRM_W)
            value_tile2(o, ldo, p, v, ldv, n, c0, left - IRM_W);
        else
            value_tile1(o, ldo, p, v, ldv, n, c0, left);
    }
#else
    for (int i = 0; i < QB; i++)
        for (long k = 0; k < n; k++) {
            float pk = p[i * KB + k];
            if (pk != 0.0f)
                for (long c = 0; c < vd; c++) o[i * ldo + c] += pk * v[k * ldv + c];
        }
#endif
}

/* one query row's scores si[0 .. n) of a key block into its running softmax (common.h `softmax_fold`):
 * the bias added (-inf: no key), keys past `last` masked; si becomes the block's probabilities (0
 * where masked) */
static void fold_row(float *si, const float *bias, long n, long last, float *mx, float *sum, float *o, long vd) {
    float bm = -INFINITY;
#if defined(__AVX512F__)
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 mv = ninf;
    for (long k = 0; k < n; k += 16) {
        /* visible lanes: within the block and at most `last` */
        long lim = last - k < -1 ? -1 : last - k > 15 ? 15 : last - k;
        __mmask16 in = tail_mask(n - k) & _mm512_cmple_epi32_mask(lane, _mm512_set1_epi32((int)lim));
        __m512 x = _mm512_mask_add_ps(ninf, in, _mm512_loadu_ps(si + k), _mm512_maskz_loadu_ps(in, bias + k));
        _mm512_storeu_ps(si + k, x);
        mv = _mm512_max_ps(mv, x);
    }
    bm = _mm512_reduce_max_ps(mv);
#elif IRM_VEC /* AVX2: the visible lanes by compares (si and bias are readable a whole vector past n) */
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 mv = ninf;
    for (long k = 0; k < n; k += 8) {
        long lim = last - k < -1 ? -1 : last - k > 7 ? 7 : last - k, top = n - k - 1 < lim ? n - k - 1 : lim;
        __m256 in = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)top + 1), lane));
        __m256 x = _mm256_blendv_ps(ninf, _mm256_add_ps(_mm256_loadu_ps(si + k), _mm256_loadu_ps(bias + k)), in);
        _mm256_storeu_ps(si + k, x);
        mv = _mm256_max_ps(mv, x);
    }
    bm = vf_hmax(mv);
#else
    for (long k = 0; k < n; k++) {
        si[k] = k > last ? -INFINITY : si[k] + bias[k];
        bm = si[k] > bm ? si[k] : bm;
    }
#endif
    softmax_fold(si, n, bm, mx, sum, o, vd);
}

/* 1 when built with the vector tiles (AVX-512 or AVX2; without them torch's SDPA is faster: the caller asks) */
int irm_vectorised(void) {
#if IRM_VEC
    return 1;
#else
    return 0;
#endif
}

typedef struct {
    float *kt, *vb, *bias, *q, *s, *o;
} prefill_buffers;

static int prefill_alloc(prefill_buffers *p, long d, long Tp, long vd) {
    p->kt = (float *)irm_alloc(sizeof(float) * (size_t)(d * Tp + 1));  /* block jb: kt + jb d KB, [d, KB] */
    p->vb = (float *)irm_alloc(sizeof(float) * (size_t)(Tp * vd + 1)); /* one head's values, [Tp, vd] */
    p->bias = (float *)irm_alloc(sizeof(float) * (size_t)(Tp + 1));    /* 0: a key; -inf: none */
    p->q = (float *)irm_alloc(sizeof(float) * (size_t)(QS * d + 1));   /* a superblock's query rows, scaled */
    p->s = (float *)irm_alloc(sizeof(float) * (size_t)(QB * KB));
    p->o = (float *)irm_alloc(sizeof(float) * (size_t)(QS * vd + 1));  /* their running outputs */
    return p->kt && p->vb && p->bias && p->q && p->s && p->o;
}

static void prefill_free(prefill_buffers *p) { free(p->kt), free(p->vb), free(p->bias), free(p->q), free(p->s), free(p->o); }

int irm_prefill_attention(long B, long M, long T, long H, long nope, long rope, long vd,
                          const float *qn, long qn_b, long qn_m, long qn_h,
                          const float *qp, long qp_b, long qp_m, long qp_h,
                          const float *kn, long kn_b, long kn_t, long kn_h,
                          const float *kr, long kr_b, long kr_t,
                          const float *v, long v_b, long v_t, long v_h,
                          const int64_t *slots, const int64_t *qpos, const int64_t *qlen, float scale,
                          float *out, long o_b, long o_m, long o_h, int nthreads) {
    long d = nope + rope, nb = (T + KB - 1) / KB, Tp = nb * KB; /* key blocks, zeros past the last key */
    long nsb = (M + QS - 1) / QS, pairs = B * H;
    /* runs of superblocks per (sequence, head): one unless the pairs are too few for the threads */
    long runs = pairs >= 2 * nthreads ? 1 : (2 * nthreads + pairs - 1) / (pairs > 0 ? pairs : 1);
    runs = runs > nsb ? nsb : runs < 1 ? 1 : runs;
    int rc = 0;
#pragma omp parallel num_threads(nthreads) if (irm_team(nthreads, (double)B * M * T * H * (d + vd) / 2))
    {
        prefill_buffers buf;
        int ok = prefill_alloc(&buf, d, Tp, vd);
        if (!ok) {
#pragma omp atomic write
            rc = -1;
        }
        float *kt = buf.kt, *vb = buf.vb, *bias = buf.bias, *q = buf.q, *s = buf.s, *o = buf.o;
        unsigned int csr = irm_ftz_on();
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < pairs * runs; item++) {
            long b = item / (H * runs), h = item / runs % H, run = item % runs;
            long n = qlen[b] < M ? qlen[b] : M;
            const int64_t *pos = qpos + b * M;
            if (!ok)
                continue;
            if (run == 0)
                for (long i = n; i < M; i++) /* rows past the sequence's queries: zeros */
                    memset(out + b * o_b + i * o_m + h * o_h, 0, sizeof(float) * (size_t)vd);
            long sbs = (n + QS - 1) / QS, sb0 = run * sbs / runs, sb1 = (run + 1) * sbs / runs;
            if (sb0 >= sb1)
                continue;
            long kmax = 0; /* keys past every query's position are never read */
            for (long i = 0; i < n; i++) kmax = pos[i] + 1 > kmax ? pos[i] + 1 : kmax;
            kmax = kmax < T ? kmax : T;
            long kneed = 0; /* ... nor past this run's queries' */
            for (long i = sb0 * QS; i < n && i < sb1 * QS; i++) kneed = pos[i] + 1 > kneed ? pos[i] + 1 : kneed;
            kneed = kneed < kmax ? kneed : kmax;
            long kp = (kneed + KB - 1) / KB * KB;
            for (long j = 0; j < kp; j++) bias[j] = j < kmax && slots[b * T + j] != 0 ? 0.0f : -INFINITY;
            memset(kt, 0, sizeof(float) * (size_t)(d * kp));
            memset(vb, 0, sizeof(float) * (size_t)(kp * vd));
            for (long j = 0; j < kneed; j++) {
                float *dst = kt + j / KB * d * KB + j % KB;
                const float *src = kn + b * kn_b + j * kn_t + h * kn_h, *rsrc = kr + b * kr_b + j * kr_t;
                for (long e = 0; e < nope; e++) dst[e * KB] = src[e];
                for (long e = 0; e < rope; e++) dst[(nope + e) * KB] = rsrc[e];
                memcpy(vb + j * vd, v + b * v_b + j * v_t + h * v_h, sizeof(float) * (size_t)vd);
            }
            for (long s0 = sb0 * QS; s0 < n && s0 < sb1 * QS; s0 += QS) { /* a superblock of QS rows: each key block serves all its tiles */
                long rows_s = n - s0 < QS ? n - s0 : QS;
                float mx[QS], sum[QS];
                int64_t lo[QS / QB], hi[QS / QB], top = -1;
                for (long i = 0; i < QS; i++) {
                    float *qi = q + i * d;
                    mx[i] = -INFINITY, sum[i] = 0.0f;
                    if (i % QB == 0) lo[i / QB] = INT64_MAX, hi[i / QB] = -1;
                    if (i >= rows_s) { /* a row past the last query: zeros, never written out */
                        memset(qi, 0, sizeof(float) * (size_t)d);
                        continue;
                    }
                    const float *a = qn + b * qn_b + (s0 + i) * qn_m + h * qn_h, *c = qp + b * qp_b + (s0 + i) * qp_m + h * qp_h;
                    for (long e = 0; e < nope; e++) qi[e] = scale * a[e];
                    for (long e = 0; e < rope; e++) qi[nope + e] = scale * c[e];
                    int64_t p = pos[s0 + i];
                    lo[i / QB] = p < lo[i / QB] ? p : lo[i / QB];
                    hi[i / QB] = p > hi[i / QB] ? p : hi[i / QB];
                    top = p > top ? p : top;
                }
                memset(o, 0, sizeof(float) * (size_t)(QS * vd));
                long kend = top + 1 < kmax ? top + 1 : kmax;
                for (long j0 = 0; j0 < kend; j0 += KB) {
                    const float *ktb = kt + j0 / KB * d * KB;
                    for (long t = 0; t * QB < rows_s; t++) {
                        long i0 = t * QB, rows = rows_s - i0 < QB ? rows_s - i0 : QB;
                        long tend = hi[t] + 1 < kmax ? hi[t] + 1 : kmax; /* this tile's keys */
                        if (j0 >= tend)
                            continue;
                        long nk = tend - j0 < KB ? tend - j0 : KB;
                        scores(q + i0 * d, d, ktb, KB, nk, s);
                        int diagonal = j0 + nk - 1 > lo[t]; /* some key here is past some row's position */
                        for (long i = 0; i < rows; i++)
                            fold_row(s + i * KB, bias + j0, nk, diagonal ? pos[s0 + i0 + i] - j0 : KB, &mx[i0 + i],
                                     &sum[i0 + i], o + (i0 + i) * vd, vd);
                        for (long i = rows; i < QB; i++) memset(s + i * KB, 0, sizeof(float) * (size_t)nk);
                        values(o + i0 * vd, vd, s, vb + j0 * vd, vd, nk, vd);
                    }
                }
                for (long i = 0; i < rows_s; i++) {
                    float inv = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f; /* a row with no visible key: zeros */
                    float *dst = out + b * o_b + (s0 + i) * o_m + h * o_h;
                    for (long c = 0; c < vd; c++) dst[c] = o[i * vd + c] * inv;
                }
            }
        }
        irm_ftz_off(csr);
        prefill_free(&buf);
    }
    return rc;
}
