/* MLA decode attention in the absorbed form, read straight from the latent pool (no gathered copy).
 *
 * One query per sequence: q [B, H, r + rope] (q_lat = q_nope absorbed through W_UK, then q_pe rotated
 * at the query's position), float32. The sequence's keys are pool rows [c_KV (r) | k_r (rope), ...]
 * at slots[b, 0..T-1] (slot 0 holds no row: skipped), k_r stored un-rotated and rotated here at each
 * key's position (cos/sin [T, rope/2] per sequence, or one table for all), its pairs interleaved
 * (x0, x1), (x2, x3), ... or split in halves. Then, per head, softmax(scale * (q_lat . c_KV + q_pe .
 * k_r)) over the keys and o_lat [B, H, r] = the probabilities times c_KV. All in float32 (the pool in
 * float32 or bfloat16). The torch backend computes the same with a gather, two batched products and a
 * softmax (model/attention/reference.py `_absorbed`).
 *
 * Keys go in blocks of KB, each read from the pool once: scored against every head, folded into a
 * running softmax (each head's maximum and sum so far, its output rescaled when the maximum grows, as
 * flash attention's), and summed into the outputs while the block is still in cache. With vectors
 * (simd.h: AVX-512 or AVX2) and widths in multiples of their IRM_W lanes the products run in register
 * tiles: scores 4 heads x SK keys (each key's chunk loaded once for four heads, each head's for SK
 * keys), sums 4 heads x NV_TILE vectors of outputs (one load of a key's chunk serves four heads, the
 * sums stay in registers across the block); SK and NV_TILE fit the build's vector registers. The threads share the
 * sequences and groups of their heads.
 */
#include <math.h>

#include "common.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#define KB 32 /* keys per block */

/* n bfloat16 values as float32 */
static void bf16_row(const uint16_t *src, long n, float *dst) {
    long i = 0;
#if IRM_VEC
    for (; i + IRM_W <= n; i += IRM_W) vf_store(dst + i, vf_load_bf16(src + i));
#endif
    for (; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* dst[0..rope) = the k_r at src (float32, or bfloat16 when bf) rotated by cos/sin: read straight from
 * the row (a copy first, then a masked reload of it, stalled on the copy's stores) */
static void rotate(float *dst, const void *src, int bf, long rope, const float *cos, const float *sin, int interleaved) {
    long half = rope / 2;
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LOAD16(off, m)                                                                                             \
    (bf ? _mm512_castsi512_ps(_mm512_slli_epi32(                                                                   \
              _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)src + (off))), 16))               \
        : _mm512_maskz_loadu_ps(m, (const float *)src + (off)))
    if (rope % 16 == 0 && !interleaved) { /* halves: a = k[i], b = k[i + half], 16 pairs at a time */
        for (long i = 0; i < half; i += 16) {
            __mmask16 m = (__mmask16)(half - i >= 16 ? 0xffff : (1u << (half - i)) - 1);
            __m512 a = LOAD16(i, m), b = LOAD16(half + i, m);
            __m512 c = _mm512_maskz_loadu_ps(m, cos + i), sn = _mm512_maskz_loadu_ps(m, sin + i);
            _mm512_mask_storeu_ps(dst + i, m, _mm512_fmsub_ps(a, c, _mm512_mul_ps(b, sn)));
            _mm512_mask_storeu_ps(dst + half + i, m, _mm512_fmadd_ps(b, c, _mm512_mul_ps(a, sn)));
        }
        return;
    }
    if (rope % 16 == 0 && interleaved) { /* pairs (x0, x1), ...: 8 pairs a vector, cos/sin each spread to both */
        const __m512i spread = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        for (long i = 0; i < rope; i += 16) {
            __m512 v = LOAD16(i, 0xffff);
            __m512 c = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(_mm256_loadu_ps(cos + i / 2)));
            __m512 sn = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(_mm256_loadu_ps(sin + i / 2)));
            __m512 swapped = _mm512_permute_ps(v, 0xB1); /* (x1, x0), ... */
            /* even lanes a c - b s, odd lanes b c + a s: the swapped pair times s, negated on the even lanes */
            __m512 t = _mm512_mul_ps(swapped, sn);
            t = _mm512_mask_sub_ps(t, 0x5555, _mm512_setzero_ps(), t);
            _mm512_storeu_ps(dst + i, _mm512_fmadd_ps(v, c, t));
        }
        return;
    }
#undef LOAD16
#elif IRM_VEC && IRM_W == 8
#define LOAD8(off) (bf ? vf_load_bf16((const uint16_t *)src + (off)) : _mm256_loadu_ps((const float *)src + (off)))
    if (rope % 16 == 0 && !interleaved) { /* halves: a = k[i], b = k[i + half], 8 pairs at a time */
        for (long i = 0; i < half; i += 8) {
            __m256 a = LOAD8(i), b = LOAD8(half + i), c = _mm256_loadu_ps(cos + i), sn = _mm256_loadu_ps(sin + i);
            _mm256_storeu_ps(dst + i, _mm256_fmsub_ps(a, c, _mm256_mul_ps(b, sn)));
            _mm256_storeu_ps(dst + half + i, _mm256_fmadd_ps(b, c, _mm256_mul_ps(a, sn)));
        }
        return;
    }
    if (rope % 8 == 0 && interleaved) { /* pairs (x0, x1), ...: 4 pairs a vector, cos/sin each spread to both */
        const __m256i spread = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
        const __m256 even = _mm256_castsi256_ps(_mm256_setr_epi32((int)0x80000000, 0, (int)0x80000000, 0,
                                                                  (int)0x80000000, 0, (int)0x80000000, 0));
        for (long i = 0; i < rope; i += 8) {
            __m256 v = LOAD8(i);
            __m256 c = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(cos + i / 2)), spread);
            __m256 sn = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(sin + i / 2)), spread);
            /* even lanes a c - b s, odd lanes b c + a s: the swapped pair times s, its sign flipped on the even lanes */
            __m256 t = _mm256_xor_ps(_mm256_mul_ps(_mm256_permute_ps(v, 0xB1), sn), even);
            _mm256_storeu_ps(dst + i, _mm256_fmadd_ps(v, c, t));
        }
        return;
    }
#undef LOAD8
#endif
    for (long i = 0; i < half; i++) {
        long ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
        float a = bf ? bf16_to_f32(((const uint16_t *)src)[ia]) : ((const float *)src)[ia];
        float b = bf ? bf16_to_f32(((const uint16_t *)src)[ib]) : ((const float *)src)[ib];
        float c = cos[i], s = sin[i];
        dst[ia] = a * c - b * s;
        dst[ib] = b * c + a * s;
    }
}

static inline float dot(const float *restrict a, const float *restrict b, long n) {
    float s = 0.0f;
    for (long i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

#if IRM_VEC
/* The register tiles, sized to the vector registers: SK keys a score tile (4 heads x SK sums) and NV
 * vectors of outputs a value tile (4 heads x NV sums), 4 each with AVX-512's 32 registers, 2 each
 * with AVX2's 16 (4 x 4 sums and their loads would not fit: the compiler spills them). Each (head,
 * key) sum and each output is summed in the same order whatever the tile, so every build's tiles
 * compute what the plain loops compute up to the sums' order within a vector. */
#if IRM_W == 16
#define SK 4
#define NV_TILE 4
#else
#define SK 2
#define NV_TILE 2
#endif

/* s[h * KB + k] = q_h . [c[k] | kr[k]] for 4 heads (q_h = q + h * w) and SK keys, r and rope
 * multiples of IRM_W: 4 x SK sums in registers, each chunk of a key loaded once for the four heads */
static void scores_tile(const float *q, long w, long r, long rope, const float *const *c, const float *const *kr,
                        float *s) {
    vf a[4 * SK];
    for (int i = 0; i < 4 * SK; i++) a[i] = vf_zero();
    for (int part = 0; part < 2; part++) {
        const float *const *rows = part ? kr : c;
        const float *qp = q + (part ? r : 0);
        long n = part ? rope : r;
        for (long i = 0; i < n; i += IRM_W) {
            vf kv[SK];
            for (int k = 0; k < SK; k++) kv[k] = vf_load(rows[k] + i);
            for (int h = 0; h < 4; h++) {
                vf qh = vf_load(qp + h * w + i);
                for (int k = 0; k < SK; k++) a[SK * h + k] = vf_fma(qh, kv[k], a[SK * h + k]);
            }
        }
    }
    float t[8];
    for (int g = 0; g < 4 * SK; g += 8) { /* eight sums at a time: 8 / SK heads of SK keys */
        vf_reduce8(a[g], a[g + 1], a[g + 2], a[g + 3], a[g + 4], a[g + 5], a[g + 6], a[g + 7], t);
        for (int j = 0; j < 8; j++) s[(g + j) / SK * KB + (g + j) % SK] = t[j];
    }
}

/* o_h[i0 .. i0 + IRM_W * NV) += sum_k p_h[k] c[k][..] for 4 heads (o_h = o + h * r, p_h = p + h * KB),
 * n keys: the 4 x NV sums held in registers across the keys, each key's chunk loaded once */
#define VALUES_TILE(NAME, NV)                                                                              \
    static void NAME(float *o, long r, const float *p, const float *const *c, long n, long i0) {           \
        vf a[4][NV];                                                                                       \
        for (int h = 0; h < 4; h++)                                                                        \
            for (int v = 0; v < NV; v++) a[h][v] = vf_load(o + h * r + i0 + IRM_W * v);                    \
        for (long k = 0; k < n; k++) {                                                                     \
            vf ck[NV];                                                                                     \
            for (int v = 0; v < NV; v++) ck[v] = vf_load(c[k] + i0 + IRM_W * v);                           \
            for (int h = 0; h < 4; h++) {                                                                  \
                vf ph = vf_set1(p[h * KB + k]);                                                            \
                for (int v = 0; v < NV; v++) a[h][v] = vf_fma(ph, ck[v], a[h][v]);                         \
            }                                                                                              \
        }                                                                                                  \
        for (int h = 0; h < 4; h++)                                                                        \
            for (int v = 0; v < NV; v++) vf_store(o + h * r + i0 + IRM_W * v, a[h][v]);                    \
    }
VALUES_TILE(values_tile, NV_TILE)
VALUES_TILE(values_4x1w, 1)
#endif

static void scale_row(float *o, long n, float a) {
    for (long i = 0; i < n; i++) o[i] *= a;
}

/* One sequence's attention for heads h0 .. h1 (h0 a multiple of 4, so a head takes the same register
 * tile, and computes the same, however the heads are grouped), into ob = o + b * H * r. `buf` holds
 * the thread's buffers (decode_buffers). */
typedef struct {
    float *s, *mx, *kbuf, *cbuf, *zero;
} decode_buffers;

static int buffers_alloc(decode_buffers *d, long H, long r, long rope, long w, int pool_bf) {
    d->s = (float *)irm_alloc(sizeof(float) * (size_t)(H * KB));     /* a block's scores, then probabilities */
    d->mx = (float *)irm_alloc(sizeof(float) * (size_t)(2 * H));     /* each head's maximum so far, then its sum */
    d->kbuf = (float *)irm_alloc(sizeof(float) * (size_t)(KB * (rope > 0 ? rope : 1)));  /* rotated k_r */
    d->cbuf = pool_bf ? (float *)irm_alloc(sizeof(float) * (size_t)(KB * (r > 0 ? r : 1))) : NULL;
    d->zero = (float *)irm_calloc((size_t)(w > 0 ? w : 1), sizeof(float)); /* the row of a key not there */
    return d->s && d->mx && d->kbuf && (!pool_bf || d->cbuf) && d->zero;
}

static void buffers_free(decode_buffers *d) { free(d->s), free(d->mx), free(d->kbuf), free(d->cbuf), free(d->zero); }

static void decode_heads(const float *q, long b, long H, long h0, long h1, long r, long rope, const void *pool,
                         int pool_bf, long ldp, const int64_t *slots, long T, const float *cos, const float *sin,
                         long cs_stride, int interleaved, float scale, const float *own, long ldown, float *o,
                         const decode_buffers *buf) {
    long w = r + rope, half = rope / 2, keys = T + (own != NULL);
#if IRM_VEC
    const int tiles = r % IRM_W == 0 && rope % IRM_W == 0; /* the register tiles cover these widths */
#else
    const int tiles = 0;
#endif
    const long esize = pool_bf ? 2 : 4;
    float *s = buf->s, *mx = buf->mx, *sum = buf->mx + H, *kbuf = buf->kbuf, *cbuf = buf->cbuf, *zero = buf->zero;
    const float *qb = q + b * H * w;
    const int64_t *sb = slots + b * T;
    const float *cb = cos + b * cs_stride, *snb = sin + b * cs_stride;
    float *ob = o + b * H * r;
    memset(ob + h0 * r, 0, sizeof(float) * (size_t)((h1 - h0) * r));
    for (long h = h0; h < h1; h++) mx[h] = -INFINITY, sum[h] = 0.0f;
    for (long j0 = 0; j0 < keys; j0 += KB) {
        long n = keys - j0 < KB ? keys - j0 : KB;
        long np = tiles ? (n + 3) & ~3L : n; /* the tiles take keys 4 (a multiple of SK) at a time: the rest are absent keys */
        for (long j = j0 + KB; j < j0 + 2 * KB && j < T; j++) /* the next block's rows, asked for early */
            for (long at = 0; at < w * esize; at += 64)
                __builtin_prefetch((const char *)pool + sb[j] * ldp * esize + at);
        const float *c[KB], *kr[KB];
        char seen[KB];
        for (long k = 0; k < np; k++) {
            long j = j0 + k;
            c[k] = zero, kr[k] = zero, seen[k] = 0;
            if (k >= n || (j < T && sb[j] == 0)) /* no row: zeros (a stale row could hold a NaN, and 0 * NaN is NaN) */
                continue;
            seen[k] = 1;
            if (j == T) { /* the token's own row */
                c[k] = own + b * ldown, kr[k] = c[k] + r;
                continue;
            }
            const void *kr_row;
            if (pool_bf) { /* c_KV converted, k_r rotated from the row */
                const uint16_t *row = (const uint16_t *)pool + sb[j] * ldp;
                bf16_row(row, r, cbuf + k * r);
                c[k] = cbuf + k * r, kr_row = row + r;
            } else { /* c_KV read where it lies */
                c[k] = (const float *)pool + sb[j] * ldp, kr_row = c[k] + r;
            }
            rotate(kbuf + k * rope, kr_row, pool_bf, rope, cb + j * half, snb + j * half, interleaved);
            kr[k] = kbuf + k * rope;
        }
        /* scores */
        long ht = h0;
#if IRM_VEC
        if (tiles)
            for (; ht + 4 <= h1; ht += 4)
                for (long k = 0; k < np; k += SK) scores_tile(qb + ht * w, w, r, rope, c + k, kr + k, s + ht * KB + k);
#endif
        for (long h = ht; h < h1; h++)
            for (long k = 0; k < np; k++) s[h * KB + k] = dot(qb + h * w, c[k], r) + dot(qb + h * w + r, kr[k], rope);
        /* the running softmax: each head's maximum, its output rescaled when that grows */
        for (long h = h0; h < h1; h++) {
            float *sh = s + h * KB, bm = -INFINITY;
            for (long k = 0; k < np; k++) {
                sh[k] = seen[k] ? scale * sh[k] : -INFINITY;
                bm = sh[k] > bm ? sh[k] : bm;
            }
            softmax_fold(sh, np, bm, &mx[h], &sum[h], ob + h * r, r);
        }
        /* the outputs: probabilities times c_KV */
        ht = h0;
#if IRM_VEC
        if (tiles)
            for (; ht + 4 <= h1; ht += 4) {
                long i = 0;
                for (; i + NV_TILE * IRM_W <= r; i += NV_TILE * IRM_W) values_tile(ob + ht * r, r, s + ht * KB, c, np, i);
                for (; i < r; i += IRM_W) values_4x1w(ob + ht * r, r, s + ht * KB, c, np, i);
            }
#endif
        for (long h = ht; h < h1; h++)
            for (long k = 0; k < np; k++) {
                float p = s[h * KB + k];
                if (p != 0.0f)
                    for (long i = 0; i < r; i++) ob[h * r + i] += p * c[k][i];
            }
    }
    for (long h = h0; h < h1; h++) /* a head with no visible key keeps zeros */
        scale_row(ob + h * r, r, sum[h] > 0.0f ? 1.0f / sum[h] : 0.0f);
}

/* `own` (NULL: none): one more key per sequence after its pool rows, own + b * ldown = [c_KV | k_r]
 * in float32, k_r already rotated (a compiled step's new token, whose row is not in the pool yet).
 * The work is shared among nthreads threads by sequence and group of heads (groups of a multiple of
 * 4 heads: as many as it takes to give each thread work; each group converts and rotates the
 * sequence's keys for itself). Returns 0, or -1 when no memory could be had for the buffers. */
int irm_mla_decode(const float *q, long B, long H, long r, long rope, const void *pool, int pool_bf, long ldp,
                   const int64_t *slots, long T, const float *cos, const float *sin, long cs_stride, int interleaved,
                   float scale, const float *own, long ldown, float *o, int nthreads) {
    long w = r + rope, keys = T + (own != NULL);
    long quads = (H + 3) / 4, per = (nthreads + B - 1) / (B > 0 ? B : 1); /* head groups a sequence wants */
    long groups = per < 1 ? 1 : per > quads ? quads : per, gh = (quads + groups - 1) / groups * 4;
    groups = (H + gh - 1) / gh;
    int rc = 0;
#pragma omp parallel num_threads(nthreads) if (irm_team(nthreads, (double)B * keys * H * (w + r)))
    {
        decode_buffers buf;
        int ok = buffers_alloc(&buf, H, r, rope, w, pool_bf);
        if (!ok) {
#pragma omp atomic write
            rc = -1;
        }
        unsigned int csr = irm_ftz_on();
#pragma omp for schedule(static)
        for (long item = 0; item < B * groups; item++) {
            long b = item / groups, h0 = item % groups * gh, h1 = h0 + gh < H ? h0 + gh : H;
            if (ok)
                decode_heads(q, b, H, h0, h1, r, rope, pool, pool_bf, ldp, slots, T, cos, sin, cs_stride, interleaved,
                             scale, own, ldown, o, &buf);
        }
        irm_ftz_off(csr);
        buffers_free(&buf);
    }
    return rc;
}
