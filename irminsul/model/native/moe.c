/* Routed experts of a few tokens in one call, float32: out[t] = sum_j w[t, j] * E_j(x[t]) with
 * E(x) = (silu(x . W_gate) * (x . W_up)) . W_down, e = ids[t, j].
 *
 * A decode step of 32 sequences gives each of the bundled model's 8 experts a handful of rows; in
 * torch each expert is ~10 operations (find its rows, gather, two products, silu * up, weigh, add
 * back): far more time in dispatch than in the products. Here the assignments are sorted by expert in C,
 * and each expert's rows, gathered 8 at a time, go through its two products and silu * up: the
 * products read the expert's weights where MoE.stacked() keeps them, gate|up [E, H, 2I] and down
 * [E, I, H], either input-major (element [e, i, o] at e*s0 + i*s1 + o, s2 = 1: eight rows times
 * 32 outputs summed in registers) or out-major (s1 = 1: dot products). Sums in float32 in another
 * order than torch's products (as oneDNN's and MKL's differ among themselves). irm_moe_bf16 is the
 * same for a bfloat16 model (out-major stacks only). The products' vector paths: simd.h's (AVX-512 or
 * AVX2); a build without them takes the plain loops.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define RB 8 /* rows per block */
#if defined(__AVX512F__)
#define TILE_OUT 32 /* outputs of product()'s input-major register tile (8 rows x 2 vectors) */
#else
#define TILE_OUT 8 /* (8 rows x 1 vector: AVX2's 16 registers hold no more) */
#endif
#define RB_BF16 64 /* ... in irm_moe_bf16, whose products read each weight row once for all of them */

void irm_silu_mul(const float *gu, long n, long inner, long ldg, float *out, long ldo, int nthreads); /* elementwise.c */

/* c[r][o] = sum_i a[r][i] * w[i*si + o*so], r < R <= RB, o0 <= o < o1 of the product's `out` outputs; a
 * rows of `in` at stride lda. The path is chosen by the whole product's shape, and o0 (and o1, unless it
 * is `out`) is a multiple of SLICE: an output's sum is the same whichever slice computes it. */
static void product(const float *restrict a, long R, long in, long lda, const float *restrict w, long si, long so,
                    long out, long o0, long o1, float *restrict c, long ldc) {
#if IRM_VEC
    if (so == 1 && R == 1 && out % IRM_W == 0) { /* input-major, one row (a decode step's token): 4 vectors of sums */
        long o = o0;
        for (; o + 4 * IRM_W <= o1; o += 4 * IRM_W) {
            vf c0 = vf_zero(), c1 = c0, c2 = c0, c3 = c0;
            const float *wp = w + o;
            for (long i = 0; i < in; i++, wp += si) {
                vf x = vf_set1(a[i]);
                c0 = vf_fma(x, vf_load(wp), c0);
                c1 = vf_fma(x, vf_load(wp + IRM_W), c1);
                c2 = vf_fma(x, vf_load(wp + 2 * IRM_W), c2);
                c3 = vf_fma(x, vf_load(wp + 3 * IRM_W), c3);
            }
            vf_store(c + o, c0), vf_store(c + o + IRM_W, c1), vf_store(c + o + 2 * IRM_W, c2);
            vf_store(c + o + 3 * IRM_W, c3);
        }
        for (; o < o1; o += IRM_W) {
            vf c0 = vf_zero();
            const float *wp = w + o;
            for (long i = 0; i < in; i++, wp += si) c0 = vf_fma(vf_set1(a[i]), vf_load(wp), c0);
            vf_store(c + o, c0);
        }
        return;
    }
#if defined(__AVX512F__)
    if (so == 1 && R == RB && out % TILE_OUT == 0) { /* input-major, a full block: 8 x 32 sums in registers */
        for (long o = o0; o < o1; o += 32) {
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
#else
    if (so == 1 && R == RB && out % TILE_OUT == 0) { /* input-major, a full block: 8 rows x 8 sums in registers */
        for (long o = o0; o < o1; o += IRM_W) {
            vf acc[RB];
            for (int r = 0; r < RB; r++) acc[r] = vf_zero();
            const float *wp = w + o;
            for (long i = 0; i < in; i++, wp += si) {
                vf wv = vf_load(wp);
                for (int r = 0; r < RB; r++) acc[r] = vf_fma(vf_set1(a[r * lda + i]), wv, acc[r]);
            }
            for (int r = 0; r < RB; r++) vf_store(c + r * ldc + o, acc[r]);
        }
        return;
    }
#endif
    if (si == 1 && in % IRM_W == 0 && out % 8 == 0) { /* out-major: eight outputs' dot products at a time, folded together */
        for (long r = 0; r < R; r++) {
            const float *ar = a + r * lda;
            for (long o = o0; o < o1; o += 8) dots8(ar, w + o * so, so, in, c + r * ldc + o);
        }
        return;
    }
    if (si == 1 && in % IRM_W == 0) { /* out-major: each output a dot product per row */
        for (long o = o0; o < o1; o++) {
            const float *wo = w + o * so;
            vf acc[RB];
            for (long r = 0; r < R; r++) acc[r] = vf_zero();
            for (long i = 0; i < in; i += IRM_W) {
                vf wv = vf_load(wo + i);
                for (long r = 0; r < R; r++) acc[r] = vf_fma(vf_load(a + r * lda + i), wv, acc[r]);
            }
            for (long r = 0; r < R; r++) c[r * ldc + o] = vf_hsum(acc[r]);
        }
        return;
    }
#endif
    (void)out;
    for (long r = 0; r < R; r++) {
        float *cr = c + r * ldc;
        for (long o = o0; o < o1; o++) cr[o] = 0.0f;
        for (long i = 0; i < in; i++) {
            float x = a[r * lda + i];
            const float *wi = w + i * si;
            for (long o = o0; o < o1; o++) cr[o] += x * wi[o * so];
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

/* The assignments in blocks of up to `rb` rows of one expert each (expert e's run cut into pieces):
 * block i is expert blk[i].e's sorted assignments order[blk[i].at .. + blk[i].R). Returns the count. */
typedef struct {
    long e, at, R;
} expert_block;

static long expert_blocks(const long *start, long E, long rb, expert_block *blk) {
    long nb = 0;
    for (long e = 0; e < E; e++)
        for (long b = start[e]; b < start[e + 1]; b += rb)
            blk[nb].e = e, blk[nb].at = b, blk[nb].R = start[e + 1] - b < rb ? start[e + 1] - b : rb, nb++;
    return nb;
}

/* acc[j] = sum over token t's k assignments, by expert (then by assignment), of weights[a] * y[row[a]][j],
 * j < H: each token's sum in one order whatever the threads */
static void token_sum(long t, long k, const int64_t *ids, const float *weights, const long *row, const float *y,
                      long H, float *acc) {
    long a_sorted[64];
    long kk = k < 64 ? k : 64;
    for (long j = 0; j < kk; j++) { /* insertion sort of the token's assignments by (expert, index) */
        long a = t * k + j, at = j;
        while (at > 0 && ids[a_sorted[at - 1]] > ids[a]) a_sorted[at] = a_sorted[at - 1], at--;
        a_sorted[at] = a;
    }
    for (long j = 0; j < H; j++) acc[j] = 0.0f;
    for (long m = 0; m < kk; m++) {
        long a = a_sorted[m];
        float wt = weights[a];
        const float *yr = y + row[a] * H;
        for (long j = 0; j < H; j++) acc[j] += wt * yr[j];
    }
}

#define SLICE 64 /* outputs per piece of work: a multiple of the product paths' 32 and 8 */

/* x [n, H] (row stride ldx), ids / weights [n, k]; gate_up element [e, i, o] at gu + e*gu0 + i*gu1 + o*gu2
 * (i < H, o < 2I), down [e, i, o] at dn + e*dn0 + i*dn1 + o*dn2 (i < I, o < H); out [n, H] (stride ldo),
 * overwritten; k at most 64. The threads share the blocks of an expert's rows, then slices of SLICE
 * outputs of each block's products, then the tokens' sums. Returns 0, or -1 without memory for its
 * buffers (out untouched), -2 for an expert id outside [0, E). */
int irm_moe(const float *x, long n, long H, long ldx, const int64_t *ids, const float *weights, long k, long E,
            long I, const float *gu, long gu0, long gu1, long gu2, const float *dn, long dn0, long dn1, long dn2,
            float *out, long ldo, int nthreads) {
    long nk = n * k;
    if (k > 64) return -1;
    for (long a = 0; a < nk; a++)
        if (ids[a] < 0 || ids[a] >= E) return -2;
    long nbmax = nk / RB + E + 1;
    long *start = (long *)calloc((size_t)E + 1, sizeof(long));
    long *order = (long *)malloc(sizeof(long) * (size_t)(nk > 0 ? nk : 1));
    long *row = (long *)malloc(sizeof(long) * (size_t)(nk > 0 ? nk : 1)); /* assignment -> its row of y */
    expert_block *blk = (expert_block *)malloc(sizeof(expert_block) * (size_t)nbmax);
    int rc = -1;
    float *xs = NULL, *h = NULL, *act = NULL, *y = NULL;
    if (!start || !order || !row || !blk || sort_by_expert(ids, nk, E, start, order) != 0) goto done;
    long nb = expert_blocks(start, E, RB, blk), rows = nb * RB; /* each block RB rows (a short one padded with zeros) */
    xs = (float *)irm_alloc(sizeof(float) * (size_t)(rows * H + 1));
    h = (float *)irm_alloc(sizeof(float) * (size_t)(rows * 2 * I + 1));
    act = (float *)irm_alloc(sizeof(float) * (size_t)(rows * I + 1));
    y = (float *)irm_alloc(sizeof(float) * (size_t)(rows * H + 1));
    if (!xs || !h || !act || !y) goto done;
    for (long i = 0; i < nb; i++)
        for (long r = 0; r < blk[i].R; r++) row[order[blk[i].at + r]] = i * RB + r;
    long gslices = (2 * I + SLICE - 1) / SLICE, dslices = (H + SLICE - 1) / SLICE;
#pragma omp parallel num_threads(nthreads) if (irm_team(nthreads, (double)nk * 3 * H * I))
    {
#pragma omp for schedule(static)
        for (long i = 0; i < nb; i++)
            for (long r = 0; r < RB; r++) /* (a short block's missing rows are zeros: the 8-row kernel runs on 2+) */
                if (r < blk[i].R)
                    memcpy(xs + (i * RB + r) * H, x + (order[blk[i].at + r] / k) * ldx, sizeof(float) * (size_t)H);
                else
                    memset(xs + (i * RB + r) * H, 0, sizeof(float) * (size_t)H);
        long RRg = (IRM_VEC && gu2 == 1 && (2 * I) % TILE_OUT == 0) ? RB : -1,
             RRd = (IRM_VEC && dn2 == 1 && H % TILE_OUT == 0) ? RB : -1;
#pragma omp for schedule(static)
        for (long item = 0; item < nb * gslices; item++) {
            long i = item / gslices, o0 = item % gslices * SLICE, o1 = o0 + SLICE < 2 * I ? o0 + SLICE : 2 * I;
            product(xs + i * RB * H, RRg > 0 && blk[i].R > 1 ? RRg : blk[i].R, H, H, gu + blk[i].e * gu0, gu1, gu2, 2 * I, o0, o1,
                    h + i * RB * 2 * I, 2 * I);
        }
#pragma omp for schedule(static)
        for (long i = 0; i < nb; i++) {
            long R = RRg > 0 && blk[i].R > 1 ? RRg : blk[i].R;
            irm_silu_mul(h + i * RB * 2 * I, R, I, 2 * I, act + i * RB * I, I, 1);
            /* (the down kernel may read all RB rows: a short block's missing ones are zeros) */
            memset(act + (i * RB + R) * I, 0, sizeof(float) * (size_t)((RB - R) * I));
        }
#pragma omp for schedule(static)
        for (long item = 0; item < nb * dslices; item++) {
            long i = item / dslices, o0 = item % dslices * SLICE, o1 = o0 + SLICE < H ? o0 + SLICE : H;
            product(act + i * RB * I, RRd > 0 && blk[i].R > 1 ? RRd : blk[i].R, I, I, dn + blk[i].e * dn0, dn1, dn2, H, o0, o1,
                    y + i * RB * H, H);
        }
#pragma omp for schedule(static)
        for (long t = 0; t < n; t++) token_sum(t, k, ids, weights, row, y, H, out + t * ldo);
    }
    rc = 0;
done:
    free(start), free(order), free(row), free(blk), free(xs), free(h), free(act), free(y);
    return rc;
}

/* Outputs the widened products take at a time (common.h dots3 or widen_dots): three for R >= 3 rows where
 * the vectors are AVX2's (three outputs left in the slice), else one. */
#if IRM_VEC && !defined(__AVX512F__)
#define WIDEN3(R, left) ((R) >= 3 && (left) >= 3 ? 3 : 1)
#else
#define WIDEN3(R, left) 1
#endif

int irm_moe_has_bf16(void) { return 1; } /* irm_moe_bf16 is built for every CPU */

/* irm_moe for a bfloat16 model: x [n, H] bf16 (row stride ldx), ids / weights (float32) [n, k], out [n, H]
 * bf16 (stride ldo), overwritten; gate_up and down bf16 and out-major (each output's weights contiguous
 * along the input): gate|up output o of expert e at gu + e*gu0 + o*gu2 (H elements), down output o at
 * dn + e*dn0 + o*dn2 (I elements). The products: with AVX512-BF16 common.h's bf16_dots (vdpbf16ps over
 * the rows interleaved), elsewhere widen_dots (the rows in float32, the weights widened as they are
 * read); bf16 products, float32 sums either way. gate|up in float32, silu * up rounded to bf16 for the
 * down product (as torch's bf16 experts round it), the weighted outputs summed in float32 and rounded
 * once. An expert's rows go 64 at a time (RB_BF16), so its weights are read once for them all; the
 * threads share them as irm_moe's. Returns 0, -1 without memory, -2 for an expert id outside [0, E). */
int irm_moe_bf16(const uint16_t *x, long n, long H, long ldx, const int64_t *ids, const float *weights, long k,
                 long E, long I, const uint16_t *gu, long gu0, long gu2, const uint16_t *dn, long dn0, long dn2,
                 uint16_t *out, long ldo, int nthreads) {
    long nk = n * k;
    if (k > 64) return -1;
    for (long a = 0; a < nk; a++)
        if (ids[a] < 0 || ids[a] >= E) return -2;
    long nbmax = nk / RB_BF16 + E + 1, rows = nk > 0 ? nk : 1;
#if defined(__AVX512BF16__)
    long H32 = (H + 31) / 32 * 32, I32 = (I + 31) / 32 * 32;
#endif
    long *start = (long *)calloc((size_t)E + 1, sizeof(long));
    long *order = (long *)malloc(sizeof(long) * (size_t)rows);
    long *row = (long *)malloc(sizeof(long) * (size_t)rows);
    expert_block *blk = (expert_block *)malloc(sizeof(expert_block) * (size_t)nbmax);
    /* rows in sorted order: block i's from row blk[i].at (its interleaved ones at blk[i].at * H32 or * I32) */
#if defined(__AVX512BF16__)
    uint16_t *xs = (uint16_t *)irm_alloc(sizeof(uint16_t) * (size_t)(rows * H));
    uint16_t *xi = (uint16_t *)irm_alloc(sizeof(uint16_t) * (size_t)(rows * H32));
    uint16_t *ab = (uint16_t *)irm_alloc(sizeof(uint16_t) * (size_t)(rows * I));
    uint16_t *ai = (uint16_t *)irm_alloc(sizeof(uint16_t) * (size_t)(rows * I32));
    int have = xs && xi && ab && ai;
#else
    float *xf = (float *)irm_alloc(sizeof(float) * (size_t)(rows * H)); /* the rows in float32 */
    int have = xf != NULL;
#endif
    float *h = (float *)irm_alloc(sizeof(float) * (size_t)(rows * 2 * I));
    float *act = (float *)irm_alloc(sizeof(float) * (size_t)(rows * I));
    float *y = (float *)irm_alloc(sizeof(float) * (size_t)(rows * H));
    float *acc = (float *)irm_alloc(sizeof(float) * (size_t)((n > 0 ? n : 1) * H));
    int rc = -1;
    if (!start || !order || !row || !blk || !have || !h || !act || !y || !acc) goto done;
    if (sort_by_expert(ids, nk, E, start, order) != 0) goto done;
    long nb = expert_blocks(start, E, RB_BF16, blk);
    for (long p = 0; p < nk; p++) row[order[p]] = p;
    long gslices = (2 * I + SLICE - 1) / SLICE, dslices = (H + SLICE - 1) / SLICE;
#pragma omp parallel num_threads(nthreads) if (irm_team(nthreads, (double)nk * 3 * H * I))
    {
#pragma omp for schedule(static)
        for (long i = 0; i < nb; i++) {
            long at = blk[i].at, R = blk[i].R;
#if defined(__AVX512BF16__)
            for (long r = 0; r < R; r++) memcpy(xs + (at + r) * H, x + (order[at + r] / k) * ldx, sizeof(uint16_t) * (size_t)H);
            bf16_interleave(xs + at * H, R, H, H, xi + at * H32);
#else
            for (long r = 0; r < R; r++) {
                const uint16_t *src = x + (order[at + r] / k) * ldx;
                for (long j = 0; j < H; j++) xf[(at + r) * H + j] = bf16_to_f32(src[j]);
            }
#endif
        }
#pragma omp for schedule(static)
        for (long item = 0; item < nb * gslices; item++) {
            long i = item / gslices, o0 = item % gslices * SLICE, o1 = o0 + SLICE < 2 * I ? o0 + SLICE : 2 * I;
            long at = blk[i].at, R = blk[i].R;
            float d[3 * RB_BF16];
            for (long o = o0; o < o1;) {
#if defined(__AVX512BF16__)
                bf16_dots(xi + at * H32, R, gu + blk[i].e * gu0 + o * gu2, H, d);
                long m = 1;
#else
                long m = WIDEN3(R, o1 - o);
                if (m == 3)
                    dots3(xf + at * H, R, H, gu + blk[i].e * gu0 + o * gu2, gu2, H, d, RB_BF16, 1);
                else
                    widen_dots(xf + at * H, R, H, gu + blk[i].e * gu0 + o * gu2, H, d);
#endif
                for (long j = 0; j < m; j++, o++)
                    for (long r = 0; r < R; r++) h[(at + r) * 2 * I + o] = d[j * RB_BF16 + r];
            }
        }
#pragma omp for schedule(static)
        for (long i = 0; i < nb; i++) {
            long at = blk[i].at, R = blk[i].R;
            irm_silu_mul(h + at * 2 * I, R, I, 2 * I, act + at * I, I, 1);
#if defined(__AVX512BF16__)
            for (long j = 0; j < R * I; j++) ab[at * I + j] = f32_to_bf16(act[at * I + j]);
            bf16_interleave(ab + at * I, R, I, I, ai + at * I32);
#else
            for (long j = 0; j < R * I; j++) act[at * I + j] = bf16_to_f32(f32_to_bf16(act[at * I + j]));
#endif
        }
#pragma omp for schedule(static)
        for (long item = 0; item < nb * dslices; item++) {
            long i = item / dslices, o0 = item % dslices * SLICE, o1 = o0 + SLICE < H ? o0 + SLICE : H;
            long at = blk[i].at, R = blk[i].R;
            float d[3 * RB_BF16];
            for (long o = o0; o < o1;) {
#if defined(__AVX512BF16__)
                bf16_dots(ai + at * I32, R, dn + blk[i].e * dn0 + o * dn2, I, d);
                long m = 1;
#else
                long m = WIDEN3(R, o1 - o);
                if (m == 3)
                    dots3(act + at * I, R, I, dn + blk[i].e * dn0 + o * dn2, dn2, I, d, RB_BF16, 1);
                else
                    widen_dots(act + at * I, R, I, dn + blk[i].e * dn0 + o * dn2, I, d);
#endif
                for (long j = 0; j < m; j++, o++)
                    for (long r = 0; r < R; r++) y[(at + r) * H + o] = d[j * RB_BF16 + r];
            }
        }
#pragma omp for schedule(static)
        for (long t = 0; t < n; t++) {
            token_sum(t, k, ids, weights, row, y, H, acc + t * H);
            for (long j = 0; j < H; j++) out[t * ldo + j] = f32_to_bf16(acc[t * H + j]);
        }
    }
    rc = 0;
done:
#if defined(__AVX512BF16__)
    free(xs), free(xi), free(ab), free(ai);
#else
    free(xf);
#endif
    free(start), free(order), free(row), free(blk), free(h), free(act), free(y), free(acc);
    return rc;
}
