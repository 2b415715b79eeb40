/* MLA decode attention in the absorbed form, read straight from the latent pool (no gathered copy).
 *
 * One query per sequence: q [B, H, r + rope] (q_lat = q_nope absorbed through W_UK, then q_pe rotated
 * at the query's position), float32. The sequence's keys are pool rows [c_KV (r) | k_r (rope), ...]
 * at slots[b, 0..T-1] (slot 0 holds no row: skipped), k_r stored un-rotated and rotated here at each
 * key's position (cos/sin [T, rope/2] per sequence, or one table for all), its pairs interleaved
 * (x0, x1), (x2, x3), ... or split in halves. Then, per head, softmax(scale * (q_lat . c_KV + q_pe .
 * k_r)) over the keys and o_lat [B, H, r] = the probabilities times c_KV. All in float32 (the pool in
 * float32 or bfloat16). The torch backend computes the same with a gather, two batched products and a
 * softmax (model/attention/torch.py `_absorbed`); this reads each row twice from the pool (scores,
 * then values) in blocks of KB keys that stay in cache between the two.
 */
#include <math.h>

#include "common.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#define KB 8 /* keys gathered (and converted, rotated) per block */

static void load_row(const void *pool, int pool_bf, long ldp, int64_t slot, long n, float *dst) {
    if (pool_bf) {
        const uint16_t *src = (const uint16_t *)pool + slot * ldp;
        for (long i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)pool + slot * ldp, sizeof(float) * (size_t)n);
    }
}

static void rotate(float *k, long rope, const float *cos, const float *sin, int interleaved) {
    long half = rope / 2;
#if defined(__AVX512F__)
    if (rope % 16 == 0 && !interleaved) { /* halves: a = k[i], b = k[i + half], 16 pairs at a time */
        for (long i = 0; i < half; i += 16) {
            __mmask16 m = (__mmask16)(half - i >= 16 ? 0xffff : (1u << (half - i)) - 1);
            __m512 a = _mm512_maskz_loadu_ps(m, k + i), b = _mm512_maskz_loadu_ps(m, k + half + i);
            __m512 c = _mm512_maskz_loadu_ps(m, cos + i), sn = _mm512_maskz_loadu_ps(m, sin + i);
            _mm512_mask_storeu_ps(k + i, m, _mm512_fmsub_ps(a, c, _mm512_mul_ps(b, sn)));
            _mm512_mask_storeu_ps(k + half + i, m, _mm512_fmadd_ps(b, c, _mm512_mul_ps(a, sn)));
        }
        return;
    }
    if (rope % 16 == 0 && interleaved) { /* pairs (x0, x1), ...: 8 pairs a vector, cos/sin each spread to both */
        const __m512i spread = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        for (long i = 0; i < rope; i += 16) {
            __m512 v = _mm512_loadu_ps(k + i);
            __m512 c = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(_mm256_loadu_ps(cos + i / 2)));
            __m512 sn = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(_mm256_loadu_ps(sin + i / 2)));
            __m512 swapped = _mm512_permute_ps(v, 0xB1); /* (x1, x0), ... */
            /* even lanes a c - b s, odd lanes b c + a s: the swapped pair times s, negated on the even lanes */
            __m512 t = _mm512_mul_ps(swapped, sn);
            t = _mm512_mask_sub_ps(t, 0x5555, _mm512_setzero_ps(), t);
            _mm512_storeu_ps(k + i, _mm512_fmadd_ps(v, c, t));
        }
        return;
    }
#endif
    for (long i = 0; i < half; i++) {
        long ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
        float a = k[ia], b = k[ib], c = cos[i], s = sin[i];
        k[ia] = a * c - b * s;
        k[ib] = b * c + a * s;
    }
}

static inline float dot(const float *restrict a, const float *restrict b, long n) {
    float s = 0.0f;
    for (long i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out[k] = a . keys[k] for n <= KB keys of width w (stride w): the n sums run side by side, so the
 * multiply-adds of one are not waiting on each other (one sum at a time was latency-bound) */
static void dots(const float *restrict a, const float *restrict keys, long n, long w, float *out) {
#if defined(__AVX512F__)
    if (n == KB && w % 16 == 0) { /* a full block: the KB sums in registers (a variable count keeps them in memory) */
        dots8(a, keys, w, w, out);
        return;
    }
    __m512 acc[KB];
    for (long k = 0; k < n; k++) acc[k] = _mm512_setzero_ps();
    for (long i = 0; i < w; i += 16) {
        __mmask16 m = (__mmask16)(w - i >= 16 ? 0xffff : (1u << (w - i)) - 1);
        __m512 av = _mm512_maskz_loadu_ps(m, a + i);
        for (long k = 0; k < n; k++) acc[k] = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, keys + k * w + i), acc[k]);
    }
    for (long k = 0; k < n; k++) out[k] = _mm512_reduce_add_ps(acc[k]);
#else
    for (long k = 0; k < n; k++) out[k] = dot(a, keys + k * w, w);
#endif
}

#if defined(__AVX512F__)
/* out[k] = a . [c[k] (r) | kr + k * w (rope)] for a full block of KB keys, r and rope multiples of 16:
 * c_KV read where it lies (a float32 pool), the rotated k_r from the block buffer */
static void dots_at(const float *restrict a, const float *const *c, const float *restrict kr, long w, long r,
                    long rope, float *out) {
    const float *rot[KB] = {kr, kr + w, kr + 2 * w, kr + 3 * w, kr + 4 * w, kr + 5 * w, kr + 6 * w, kr + 7 * w};
    __m512 acc[KB];
    for (int k = 0; k < KB; k++) acc[k] = _mm512_setzero_ps();
    fma8(a, c, r, acc);
    fma8(a + r, rot, rope, acc);
    reduce8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7], out);
}

/* o[i] += sum_k p[k] * c[k][i] for i below r's last multiple of 64, n <= KB rows read where they lie:
 * each stretch of o loaded and stored once per block */
static void axpys_at(float *restrict o, const float *p, const float *const *c, long n, long r) {
    for (long i = 0; i + 64 <= r; i += 64) {
        __m512 a0 = _mm512_loadu_ps(o + i), a1 = _mm512_loadu_ps(o + i + 16), a2 = _mm512_loadu_ps(o + i + 32),
               a3 = _mm512_loadu_ps(o + i + 48);
        for (long k = 0; k < n; k++) {
            __m512 pk = _mm512_set1_ps(p[k]);
            const float *ck = c[k] + i;
            a0 = _mm512_fmadd_ps(pk, _mm512_loadu_ps(ck), a0);
            a1 = _mm512_fmadd_ps(pk, _mm512_loadu_ps(ck + 16), a1);
            a2 = _mm512_fmadd_ps(pk, _mm512_loadu_ps(ck + 32), a2);
            a3 = _mm512_fmadd_ps(pk, _mm512_loadu_ps(ck + 48), a3);
        }
        _mm512_storeu_ps(o + i, a0);
        _mm512_storeu_ps(o + i + 16, a1);
        _mm512_storeu_ps(o + i + 32, a2);
        _mm512_storeu_ps(o + i + 48, a3);
    }
}
#endif

/* o[i] += sum_k p[k] * keys[k][i], i < r: each stretch of o loaded and stored once per block */
static void axpys(float *restrict o, const float *p, const float *restrict keys, long n, long w, long r) {
#if defined(__AVX512F__)
    const float *rows[KB];
    for (long k = 0; k < n; k++) rows[k] = keys + k * w;
    axpys_at(o, p, rows, n, r);
    for (long i = r - r % 64; i < r; i += 16) {
        __mmask16 m = (__mmask16)(r - i >= 16 ? 0xffff : (1u << (r - i)) - 1);
        __m512 a = _mm512_maskz_loadu_ps(m, o + i);
        for (long k = 0; k < n; k++) a = _mm512_fmadd_ps(_mm512_set1_ps(p[k]), _mm512_maskz_loadu_ps(m, keys + k * w + i), a);
        _mm512_mask_storeu_ps(o + i, m, a);
    }
#else
    for (long k = 0; k < n; k++)
        for (long i = 0; i < r; i++) o[i] += p[k] * keys[k * w + i];
#endif
}

/* s[0..T) <- softmax(s), -inf entries (keys not seen) 0; all -inf: all 0 */
static void softmax(float *s, long T) {
#if defined(__AVX512F__)
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 mv = ninf;
    for (long j = 0; j < T; j += 16) {
        __mmask16 k = (__mmask16)(T - j >= 16 ? 0xffff : (1u << (T - j)) - 1);
        mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, s + j));
    }
    float m = _mm512_reduce_max_ps(mv);
    if (m == -INFINITY) {
        memset(s, 0, sizeof(float) * (size_t)T);
        return;
    }
    __m512 sum = _mm512_setzero_ps(), mb = _mm512_set1_ps(m);
    for (long j = 0; j < T; j += 16) {
        __mmask16 k = (__mmask16)(T - j >= 16 ? 0xffff : (1u << (T - j)) - 1);
        __m512 v = _mm512_mask_loadu_ps(ninf, k, s + j);
        __mmask16 seen = _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);
        __m512 e = _mm512_maskz_mov_ps(seen, exp_nonpositive(_mm512_sub_ps(v, mb)));
        _mm512_mask_storeu_ps(s + j, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (long j = 0; j < T; j += 16) {
        __mmask16 k = (__mmask16)(T - j >= 16 ? 0xffff : (1u << (T - j)) - 1);
        _mm512_mask_storeu_ps(s + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), inv));
    }
#else
    float m = -INFINITY, sum = 0.0f;
    for (long j = 0; j < T; j++) m = s[j] > m ? s[j] : m;
    if (m == -INFINITY) {
        memset(s, 0, sizeof(float) * (size_t)T);
        return;
    }
    for (long j = 0; j < T; j++) {
        float e = s[j] == -INFINITY ? 0.0f : expf(s[j] - m);
        s[j] = e;
        sum += e;
    }
    float inv = 1.0f / sum;
    for (long j = 0; j < T; j++) s[j] *= inv;
#endif
}

/* `own` (NULL: none): one more key per sequence after its pool rows, own + b * ldown = [c_KV | k_r]
 * in float32, k_r already rotated (a compiled step's new token, whose row is not in the pool yet).
 * Returns 0, or -1 when no memory could be had for the scores. */
int irm_mla_decode(const float *q, long B, long H, long r, long rope, const void *pool, int pool_bf, long ldp,
                   const int64_t *slots, long T, const float *cos, const float *sin, long cs_stride, int interleaved,
                   float scale, const float *own, long ldown, float *o) {
    long w = r + rope, half = rope / 2;
    long TS = T + (own != NULL); /* each head's scores: the pool's keys, then its own */
#if defined(__AVX512F__)
    /* float32 rows whose widths the vector loops cover are read in place (no block copy of c_KV) */
    const int in_place = !pool_bf && r % 64 == 0 && rope % 16 == 0;
#else
    const int in_place = 0;
#endif
    float *scores = (float *)malloc(sizeof(float) * (size_t)(H * (TS > 0 ? TS : 1)));
    float *kbuf = (float *)malloc(sizeof(float) * (size_t)(KB * w));
    if (!scores || !kbuf) {
        free(scores);
        free(kbuf);
        return -1;
    }
#if defined(__SSE2__)
    /* denormals flushed to zero while it runs (as oneDNN's kernels do): a real model's softmax has
     * probabilities far below FLT_MIN, and multiplying them at the denormal rate made a call ~2x slower */
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
#endif
    for (long b = 0; b < B; b++) {
        const float *qb = q + b * H * w;
        const int64_t *sb = slots + b * T;
        const float *cb = cos + b * cs_stride, *snb = sin + b * cs_stride;
        float *ob = o + b * H * r;
        /* scores: blocks of KB keys, each gathered once and dotted with every head */
        for (long j0 = 0; j0 < T; j0 += KB) {
            long n = T - j0 < KB ? T - j0 : KB;
            for (long k = j0 + KB; k < j0 + 2 * KB && k < T; k++) /* the next block's rows, asked for early */
                for (long c = 0; c < w * (pool_bf ? 2 : 4); c += 64)
                    __builtin_prefetch((const char *)pool + (sb[k] * ldp) * (pool_bf ? 2 : 4) + c);
            const float *at[KB]; /* each key's c_KV: in the pool (float32 rows, a full block) or in kbuf */
            int direct = in_place && n == KB;
            for (long k = 0; k < n; k++) {
                int64_t slot = sb[j0 + k];
                at[k] = kbuf + k * w;
                if (slot == 0) { /* no row: zeros (its score is -inf; a stale row could hold a NaN, and 0 * NaN is NaN) */
                    memset(kbuf + k * w, 0, sizeof(float) * (size_t)w);
                    continue;
                }
                if (direct) { /* c_KV read where it lies; only k_r copied, to be rotated */
                    at[k] = (const float *)pool + slot * ldp;
                    memcpy(kbuf + k * w + r, at[k] + r, sizeof(float) * (size_t)rope);
                } else {
                    load_row(pool, pool_bf, ldp, slot, w, kbuf + k * w);
                }
                rotate(kbuf + k * w + r, rope, cb + (j0 + k) * half, snb + (j0 + k) * half, interleaved);
            }
            for (long h = 0; h < H; h++) {
                float s[KB];
#if defined(__AVX512F__)
                if (direct)
                    dots_at(qb + h * w, at, kbuf + r, w, r, rope, s);
                else
#endif
                    dots(qb + h * w, kbuf, n, w, s);
                for (long k = 0; k < n; k++) scores[h * TS + j0 + k] = sb[j0 + k] == 0 ? -INFINITY : scale * s[k];
            }
        }
        if (own != NULL)
            for (long h = 0; h < H; h++) scores[h * TS + T] = scale * dot(qb + h * w, own + b * ldown, w);
        /* softmax per head (a row with no visible key gives zeros) */
        for (long h = 0; h < H; h++) softmax(scores + h * TS, TS);
        /* o_lat = probabilities times c_KV, the same blocks read again */
        memset(ob, 0, sizeof(float) * (size_t)(H * r));
        for (long j0 = 0; j0 < T; j0 += KB) {
            long n = T - j0 < KB ? T - j0 : KB;
            const float *at[KB];
            for (long k = 0; k < n; k++) {
                at[k] = kbuf + k * w;
                if (sb[j0 + k] == 0)
                    memset(kbuf + k * w, 0, sizeof(float) * (size_t)r);
                else if (in_place)
                    at[k] = (const float *)pool + sb[j0 + k] * ldp;
                else
                    load_row(pool, pool_bf, ldp, sb[j0 + k], r, kbuf + k * w);
            }
            for (long h = 0; h < H; h++) {
                float p[KB];
                for (long k = 0; k < n; k++) p[k] = sb[j0 + k] == 0 ? 0.0f : scores[h * TS + j0 + k];
#if defined(__AVX512F__)
                if (in_place)
                    axpys_at(ob + h * r, p, at, n, r);
                else
#endif
                    axpys(ob + h * r, p, kbuf, n, w, r);
            }
        }
        if (own != NULL)
            for (long h = 0; h < H; h++) {
                float p = scores[h * TS + T];
                axpys(ob + h * r, &p, own + b * ldown, 1, w, r);
            }
    }
    free(scores);
    free(kbuf);
#if defined(__SSE2__)
    _mm_setcsr(csr);
#endif
    return 0;
}
