/* A whole decode step of a float32 MLA model in one call: B tokens, one per sequence,
 * from their embedding rows to the final norm's hidden states, every layer's new pool row written.
 *
 * The other sources' kernels do the work (irm_linear, irm_rms_norm, irm_heads_linear, irm_mla_decode,
 * irm_moe, irm_silu_mul); this file strings them together with the small steps between them (RoPE
 * of the queries, the router's choice, the residual sums), so that a step of a small model pays one
 * call from Python instead of a few hundred tensor operations' dispatch. It computes what
 * DeepseekModel.forward computes for a decode batch (irminsul/model/deepseek.py, mla.py, layers.py),
 * in the same order of operations but for the sums inside the products; model/native_step.py builds
 * the model description below from a loaded model and is tested against the eager forward pass.
 */
#include "common.h"

int irm_linear(const void *x, int x_bf, long rows, long ldx, const void *w, int w_bf, long out, long in, long ld,
               const void *bias, int bias_bf, void *y, int y_bf, long ldy, int nthreads);
int irm_heads_linear(const void *x, int x_bf, long rows, long ldx, long xh, long H, const void *w, int w_bf, long wh,
                     long out, long in, long ld, void *y, int y_bf, long ldy, long yh, int nthreads);
void irm_rms_norm(const float *x, long n, long d, long ldx, const float *w, float eps, float *out, long ldo,
                  int nthreads);
void irm_silu_mul(const float *gu, long n, long inner, long ldg, float *out, long ldo, int nthreads);
int irm_mla_decode(const float *q, long B, long H, long r, long rope, const void *pool, int pool_bf, long ldp,
                   const int64_t *slots, long T, const float *cos, const float *sin, long cs_stride, int interleaved,
                   float scale, const float *own, long ldown, float *o, int nthreads);
int irm_moe(const float *x, long n, long H, long ldx, const int64_t *ids, const float *weights, long k, long E,
            long I, const float *gu, long gu0, long gu1, long gu2, const float *dn, long dn0, long dn1, long dn2,
            float *out, long ldo, int nthreads);

/* One decoder layer's weights, float32; every product's weight [out, in] with its rows contiguous. */
typedef struct {
    const float *in_norm;            /* [hidden] */
    const float *in_w, *in_b;        /* q (or q_a) and kv_a as one product [q_in + r + rope, hidden]; bias or NULL */
    const float *q_norm, *q_b;       /* with a q LoRA: q_a's norm [q_lora], q_b [heads * (nope + rope), q_lora] */
    const float *kv_norm;            /* [r] */
    const float *w_uk;               /* [heads, r, nope] */
    const float *w_uv;               /* head h's [v, r] at w_uv + h * uv_head, its rows r apart */
    long uv_head;
    const float *o_w, *o_b;          /* [hidden, heads * v]; bias or NULL */
    const float *post_norm;          /* [hidden] */
    const float *mlp_gu, *mlp_dn;    /* the dense MLP, or the shared experts: gate|up [2I, hidden], down [hidden, I] */
    long mlp_inner;                  /* I (0: no such MLP) */
    const float *router, *router_bias; /* [E, hidden], [E] or NULL; router NULL: a dense layer */
    const float *ex_gu, *ex_dn;      /* the routed experts' stacks, as irm_moe reads them */
    long gu0, gu1, gu2, dn0, dn1, dn2, ex_inner;
} irm_step_layer;

typedef struct {
    long layers, hidden, heads, nope, rope, v, r, q_lora;
    long experts, topk, n_group, topk_group;
    int sigmoid;          /* routing scores: 1 sigmoid (V3), 0 softmax (V2) */
    int group_limited;    /* topk_method other than greedy: experts of the best topk_group groups only */
    int norm_topk;        /* the k weights normalised to sum 1 */
    int in_interleaved;   /* q_pe and k_r pairs as the checkpoint projects them: 1 (x0, x1), ..., 0 halves */
    int out_interleaved;  /* ... as the pool caches k_r and the decode kernel reads them */
    float routed_scale, eps, scale;
    const float *embed;   /* token t's row: embed[t * embed_s0 + i * embed_s1] */
    long embed_s0, embed_s1;
    const float *final_norm;
    const float *lm_head; /* [vocab, hidden], or NULL: the caller computes the logits */
    long vocab;
    const irm_step_layer *layer;
} irm_step_model;

long irm_step_sizes(int which) { return which == 0 ? (long)sizeof(irm_step_model) : (long)sizeof(irm_step_layer); }

static long widest_inner(const irm_step_model *m) {
    long w = 1;
    for (long l = 0; l < m->layers; l++)
        if (m->layer[l].mlp_inner > w) w = m->layer[l].mlp_inner;
    return w;
}

/* floats of work space irm_decode_step needs for B tokens */
long irm_step_work(const irm_step_model *m, long B) {
    long qk = m->nope + m->rope, q_in = m->q_lora ? m->q_lora : m->heads * qk, lat = m->r + m->rope;
    long per = 4 * m->hidden + (q_in + lat) + m->heads * (qk + lat + m->r + m->v) + 3 * widest_inner(m) +
               (m->experts + 1) + 3 * m->topk; /* (the expert ids int64: two floats each) */
    return B * per + 2 * (m->experts + 1) + 64;
}

/* y [B, ldy] = x [B, ldx] times w [out, ld]^T (+ bias): irm_linear for up to IRM_MAX_ROWS (8) rows; more
 * (B <= 64) with the vectors three outputs at a time over every row (common.h dots3), each weight row read
 * once for all of them (irm_linear 8 rows at a time would read it B / 8 times) */
static int lin(const float *x, long B, long ldx, const float *w, long out, long in, long ld, const float *bias, float *y,
               long ldy, int nthreads) {
#if IRM_VEC
    if (B > 8 && B <= 64) {
        long tiles = out / 3;
#pragma omp parallel for num_threads(nthreads) if (irm_team(nthreads, (double)out * in * B)) schedule(static)
        for (long t = 0; t < tiles; t++) {
            float acc[3 * 64];
            dots3(x, B, ldx, w + t * 3 * ld, ld, in, acc, B, 0);
            for (int j = 0; j < 3; j++)
                for (long b = 0; b < B; b++) y[b * ldy + t * 3 + j] = acc[j * B + b] + (bias ? bias[t * 3 + j] : 0.0f);
        }
        if (tiles * 3 == out) return 0;
        w += tiles * 3 * ld, y += tiles * 3, bias = bias ? bias + tiles * 3 : NULL, out -= tiles * 3;
    }
#endif
    for (long b = 0; b < B; b += 8)
        if (irm_linear(x + b * ldx, 0, B - b < 8 ? B - b : 8, ldx, w, 0, out, in, ld, bias, 0, y + b * ldy, 0, ldy,
                       nthreads))
            return -1;
    return 0;
}

/* irm_heads_linear over any number of rows: more than 8 head by head through lin */
static int heads_lin(const float *x, long B, long ldx, long xh, long heads, const float *w, long wh, long out, long in,
                     long ld, float *y, long ldy, long yh, int nthreads) {
    if (B > 8) {
        for (long h = 0; h < heads; h++)
            if (lin(x + h * xh, B, ldx, w + h * wh, out, in, ld, NULL, y + h * yh, ldy, nthreads)) return -1;
        return 0;
    }
    for (long b = 0; b < B; b += 8)
        if (irm_heads_linear(x + b * ldx, 0, B - b < 8 ? B - b : 8, ldx, xh, heads, w, 0, wh, out, in, ld, y + b * ldy,
                             0, ldy, yh, nthreads))
            return -1;
    return 0;
}

/* (a, b) pairs of x in one layout rotated by cos/sin, written in the other: a c - b s, b c + a s */
static void rope(const float *x, float *y, long dim, const float *cos, const float *sin, int in_il, int out_il) {
    long half = dim / 2;
    for (long i = 0; i < half; i++) {
        float a = in_il ? x[2 * i] : x[i], b = in_il ? x[2 * i + 1] : x[half + i];
        float ya = a * cos[i] - b * sin[i], yb = b * cos[i] + a * sin[i];
        if (out_il)
            y[2 * i] = ya, y[2 * i + 1] = yb;
        else
            y[i] = ya, y[half + i] = yb;
    }
}

/* the router's choice for one token (layers.py Router): ids / weights [k] from the logits [E] */
static void route(const irm_step_model *m, const float *bias, const float *logits, float *scores, float *choice,
                  int64_t *ids, float *weights) {
    long E = m->experts, k = m->topk;
    if (m->sigmoid) {
        for (long e = 0; e < E; e++) {
            scores[e] = 1.0f / (1.0f + expf(-logits[e]));
            choice[e] = scores[e] + (bias ? bias[e] : 0.0f);
        }
    } else {
        float top = -INFINITY, sum = 0.0f;
        for (long e = 0; e < E; e++) top = logits[e] > top ? logits[e] : top;
        for (long e = 0; e < E; e++) sum += scores[e] = expf(logits[e] - top);
        for (long e = 0; e < E; e++) choice[e] = scores[e] /= sum;
    }
    if (m->group_limited && m->n_group > 1) {
        long per = E / m->n_group;
        float gs[256];
        int keep[256];
        for (long g = 0; g < m->n_group; g++) {
            const float *c = choice + g * per;
            if (m->sigmoid) { /* the sum of its best two (one for groups of one) */
                float b1 = -INFINITY, b2 = -INFINITY;
                for (long j = 0; j < per; j++)
                    if (c[j] > b1)
                        b2 = b1, b1 = c[j];
                    else if (c[j] > b2)
                        b2 = c[j];
                gs[g] = per >= 2 ? b1 + b2 : b1;
            } else {
                float b1 = -INFINITY;
                for (long j = 0; j < per; j++) b1 = c[j] > b1 ? c[j] : b1;
                gs[g] = b1;
            }
            keep[g] = 0;
        }
        for (long t = 0; t < m->topk_group; t++) {
            long best = -1;
            for (long g = 0; g < m->n_group; g++)
                if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
            keep[best] = 1;
        }
        float fill = m->sigmoid ? -INFINITY : 0.0f;
        for (long e = 0; e < E; e++)
            if (!keep[e / per]) choice[e] = fill;
    }
    float sum = 0.0f;
    for (long j = 0; j < k; j++) { /* the k best, the lower id first among equals */
        long best = -1;
        for (long e = 0; e < E; e++) {
            int taken = 0;
            for (long i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
        }
        ids[j] = best;
        sum += weights[j] = scores[best];
    }
    for (long j = 0; j < k; j++)
        weights[j] = (m->norm_topk ? weights[j] / (sum + 1e-20f) : weights[j]) * m->routed_scale;
}

/* B tokens, one per sequence: tokens[b] at position pos[b]; the sequence's slots [b, 0..T) (slots[b * T + p]
 * holds position p's row, 0: none; pos[b] < T), its new row written at slots[b * T + pos[b]] of each layer
 * (pool + layer * layer_stride + slot * ldp, float32 rows [c_KV | k_r]); cos/sin [>= T, rope / 2] the model's
 * table (position p's at row p). work: irm_step_work(m, B) floats. hidden [B, m->hidden]: the final norm's
 * output; logits [B, m->vocab] (or NULL: not computed) the LM head's, where the model has one here.
 * Returns 0, or -1 for B < 1 or a kernel that found no memory. */
int irm_decode_step(const irm_step_model *m, long B, const int64_t *tokens, const int64_t *pos, float *pool,
                    long layer_stride, long ldp, const int64_t *slots, long T, const float *cos, const float *sin,
                    float *work, float *hidden, float *logits, int nthreads) {
    const long H = m->hidden, heads = m->heads, nope = m->nope, rp = m->rope, r = m->r, qk = nope + rp,
               lat = r + rp, half = rp / 2;
    const long q_in = m->q_lora ? m->q_lora : heads * qk, wide = widest_inner(m), E = m->experts, k = m->topk;
    if (B < 1 || k > 64 || m->n_group > 256) return -1;
    float *x = work, *h = x + B * H, *t = h + B * H, *t2 = t + B * H, *qkv = t2 + B * H, *qb = qkv + B * (q_in + lat),
          *qd = qb + B * heads * qk, *olat = qd + B * heads * lat, *vo = olat + B * heads * r,
          *gu = vo + B * heads * m->v, *act = gu + 2 * B * wide, *lg = act + B * wide, *sc = lg + B * (E + 1),
          *wt = sc + 2 * (E + 1);
    int64_t *ids = (int64_t *)(((uintptr_t)(wt + B * k) + 7) & ~(uintptr_t)7);
    for (long b = 0; b < B; b++)
        for (long i = 0; i < H; i++) x[b * H + i] = m->embed[tokens[b] * m->embed_s0 + i * m->embed_s1];
    for (long l = 0; l < m->layers; l++) {
        const irm_step_layer *L = &m->layer[l];
        float *rows = pool + l * layer_stride;
        /* attention: the two input products, the latent row, the queries */
        irm_rms_norm(x, B, H, H, L->in_norm, m->eps, h, H, nthreads);
        if (lin(h, B, H, L->in_w, q_in + lat, H, H, L->in_b, qkv, q_in + lat, nthreads)) return -1;
        const float *q = qkv;
        long ldq = q_in + lat;
        if (m->q_lora) {
            irm_rms_norm(qkv, B, q_in, q_in + lat, L->q_norm, 1e-6f, qkv, q_in + lat, nthreads); /* (in place) */
            if (lin(qkv, B, q_in + lat, L->q_b, heads * qk, q_in, q_in, NULL, qb, heads * qk, nthreads))
                return -1;
            q = qb, ldq = heads * qk;
        }
        for (long b = 0; b < B; b++) {
            const float *c = cos + pos[b] * half, *s = sin + pos[b] * half, *kv = qkv + b * (q_in + lat) + q_in;
            float *row = rows + slots[b * T + pos[b]] * ldp;
            irm_rms_norm(kv, 1, r, r, L->kv_norm, 1e-6f, row, r, 1);
            if (m->in_interleaved == m->out_interleaved)
                memcpy(row + r, kv + r, sizeof(float) * (size_t)rp);
            else /* the pairs moved to the cache's layout, un-rotated */
                for (long i = 0; i < half; i++) {
                    float a = m->in_interleaved ? kv[r + 2 * i] : kv[r + i];
                    float bb = m->in_interleaved ? kv[r + 2 * i + 1] : kv[r + half + i];
                    if (m->out_interleaved)
                        row[r + 2 * i] = a, row[r + 2 * i + 1] = bb;
                    else
                        row[r + i] = a, row[r + half + i] = bb;
                }
            for (long hd = 0; hd < heads; hd++)
                rope(q + b * ldq + hd * qk + nope, qd + (b * heads + hd) * lat + r, rp, c, s, m->in_interleaved,
                     m->out_interleaved);
        }
        /* q_lat = q_nope W_UK, attention over the pool, o = o_lat W_UV, o_proj */
        if (heads_lin(q, B, ldq, qk, heads, L->w_uk, r * nope, r, nope, nope, qd, heads * lat, lat, nthreads))
            return -1;
        if (irm_mla_decode(qd, B, heads, r, rp, rows, 0, ldp, slots, T, cos, sin, 0, m->out_interleaved, m->scale,
                           NULL, 0, olat, nthreads))
            return -1;
        if (heads_lin(olat, B, heads * r, r, heads, L->w_uv, L->uv_head, m->v, r, r, vo, heads * m->v, m->v, nthreads))
            return -1;
        if (lin(vo, B, heads * m->v, L->o_w, H, heads * m->v, heads * m->v, L->o_b, t, H, nthreads))
            return -1;
        for (long i = 0; i < B * H; i++) x[i] += t[i];
        /* the MLP: routed experts and shared ones, or a dense one */
        irm_rms_norm(x, B, H, H, L->post_norm, m->eps, h, H, nthreads);
        if (L->router) {
            if (lin(h, B, H, L->router, E, H, H, NULL, lg, E, nthreads)) return -1;
            for (long b = 0; b < B; b++)
                route(m, L->router_bias, lg + b * E, sc, sc + E, ids + b * k, wt + b * k);
            if (irm_moe(h, B, H, H, ids, wt, k, E, L->ex_inner, L->ex_gu, L->gu0, L->gu1, L->gu2, L->ex_dn, L->dn0,
                        L->dn1, L->dn2, t, H, nthreads))
                return -1;
        }
        if (L->mlp_inner) { /* (beside the routed experts' sum in t, or alone) */
            long I = L->mlp_inner;
            float *out = L->router ? t2 : t;
            if (lin(h, B, H, L->mlp_gu, 2 * I, H, H, NULL, gu, 2 * I, nthreads)) return -1;
            irm_silu_mul(gu, B, I, 2 * I, act, I, nthreads);
            if (lin(act, B, I, L->mlp_dn, H, I, I, NULL, out, H, nthreads)) return -1;
            if (L->router)
                for (long i = 0; i < B * H; i++) t[i] += t2[i];
        }
        for (long i = 0; i < B * H; i++) x[i] += t[i];
    }
    irm_rms_norm(x, B, H, H, m->final_norm, m->eps, hidden, H, nthreads);
    if (logits && m->lm_head && lin(hidden, B, H, m->lm_head, m->vocab, H, H, NULL, logits, m->vocab, nthreads))
        return -1;
    return 0;
}
