/* attention.c: causal grouped-query attention by position, single pass over K/V.
 *
 * Work units are (query t, kv head hk, key segment). A unit scores its keys for all G query heads
 * that share hk, so each K/V row is read once per group, not once per head, and keeps an online
 * softmax (running max m, sum of exponentials l, unnormalised output acc) over them.
 *
 * With few query positions (decode) there are too few (t, hk) pairs to keep every thread busy on
 * a long cache, so the keys are cut into fixed segments of KVREF_ATTN_SEGMENT and the segments'
 * (m, l, acc) are merged afterwards in segment order (the log-sum-exp merge). Segment boundaries
 * depend only on S, so results are the same for every thread count.
 */
#include <math.h>

#include "internal.h"

#define KVREF_ATTN_SEGMENT 256
#define KVREF_ATTN_SPLIT_MAX_T 4   /* split keys into segments when T <= this */
#define KVREF_ATTN_SEGMENT_UNITS_MIN 4 /* from this many segments on, a unit covers every kv head */

typedef struct {
    kvref_attn_args a;
    kvref_pool *pool;
    kvref_attn_unit_fn unit_fn;
    int64_t nseg;
    int64_t span, runs;        /* attn_segment_task: consecutive segments per unit, units per query */
    float *partial;            /* nseg > 1: [T, Hkv, nseg, G * (D + 2)] (m[G], l[G], acc[G, D]) */
    float *out;                /* [T, H, D] */
} attn_ctx;

/* floats of one (m, l, acc) state for G heads, rounded up to even */
static int64_t partial_floats(int64_t G, int64_t D) { return (G * (D + 2) + 1) / 2 * 2; }

static void attn_task(void *vctx, int64_t unit, int thread) {
    const attn_ctx *c = vctx;
    const kvref_attn_args *a = &c->a;
    const int64_t G = a->G, D = a->D;
    const int64_t seg = unit % c->nseg;
    const int64_t hk = (unit / c->nseg) % a->Hkv;
    const int64_t t = unit / (c->nseg * a->Hkv);
    const int64_t s0 = seg * KVREF_ATTN_SEGMENT;
    const int64_t s1 = (c->nseg == 1 || s0 + KVREF_ATTN_SEGMENT > a->S) ? a->S : s0 + KVREF_ATTN_SEGMENT;
    float *scratch = kvref_pool_scratch(c->pool, thread);
    float *mla;
    if (c->nseg > 1) {
        mla = c->partial + unit * G * (D + 2);
    } else {
        mla = scratch;
        scratch += partial_floats(G, D); /* the unit's int64 rows stay 8-byte aligned */
    }
    float *m = mla, *l = mla + G, *acc = mla + 2 * G;
    kvref_attn_state_init(G, D, m, l, acc);
    c->unit_fn(a, t, hk, s0, s1, m, l, acc, scratch);
    if (c->nseg == 1) {
        for (int64_t g = 0; g < G; g++) {
            float *o = c->out + (t * a->H + hk * G + g) * D;
            /* l > 0 iff some key was visible; a query that sees nothing gets zeros */
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
            for (int64_t i = 0; i < D; i++) o[i] = l[g] > 0.0f ? acc[g * D + i] * inv : 0.0f;
        }
    }
}

/* Decode over a long cache: one unit per (query, run of `span` consecutive segments) covering every
 * kv head, chunk by chunk, so each chunk's K/V rows (all heads: contiguous memory) are consumed
 * together and the cache streams from memory in order. attn_task's units read one kv head's part of
 * every row, a third of each row for SmolLM2, and walk the layer's K/V once per kv head. Each
 * (hk, segment) partial is the same sequence of chunk updates either way, so the results are
 * identical, whatever the span. The span makes two units per thread: a unit prefetches one chunk
 * ahead of the keys it scores, so only its first chunk waits on memory, and runs of segments that
 * long stream the rest behind the prefetches; two, not one, so a thread the host delays leaves work
 * for the others. Measured here (30 layers x 4096 float16 positions, cache cold, 2 threads, builds
 * run alternately): one unit per segment 5.8-6.5 ms, two per thread 4.3-5.0 ms, one per thread and
 * four per thread no different from two. */
static void attn_segment_task(void *vctx, int64_t unit, int thread) {
    const attn_ctx *c = vctx;
    const kvref_attn_args *a = &c->a;
    const int64_t G = a->G, D = a->D, nseg = c->nseg;
    const int64_t t = unit / c->runs, seg0 = unit % c->runs * c->span;
    const int64_t seg1 = seg0 + c->span < nseg ? seg0 + c->span : nseg;
    float *scratch = kvref_pool_scratch(c->pool, thread);
    for (int64_t seg = seg0; seg < seg1; seg++) {
        const int64_t s0 = seg * KVREF_ATTN_SEGMENT;
        const int64_t s1 = s0 + KVREF_ATTN_SEGMENT > a->S ? a->S : s0 + KVREF_ATTN_SEGMENT;
        for (int64_t hk = 0; hk < a->Hkv; hk++) {
            float *mla = c->partial + ((t * a->Hkv + hk) * nseg + seg) * G * (D + 2);
            kvref_attn_state_init(G, D, mla, mla + G, mla + 2 * G);
        }
        for (int64_t c0 = s0; c0 < s1; c0 += KVREF_ATTN_CHUNK) {
            const int64_t c1 = c0 + KVREF_ATTN_CHUNK > s1 ? s1 : c0 + KVREF_ATTN_CHUNK;
            for (int64_t hk = 0; hk < a->Hkv; hk++) {
                float *mla = c->partial + ((t * a->Hkv + hk) * nseg + seg) * G * (D + 2);
                c->unit_fn(a, t, hk, c0, c1, mla, mla + G, mla + 2 * G, scratch);
            }
        }
    }
}

/* out[t, hk*G + g] = sum_j acc_j exp(m_j - M) / sum_j l_j exp(m_j - M), M = max_j m_j */
static void merge_task(void *vctx, int64_t unit, int thread) {
    const attn_ctx *c = vctx;
    const kvref_attn_args *a = &c->a;
    const int64_t G = a->G, D = a->D, nseg = c->nseg;
    const int64_t hk = unit % a->Hkv, t = unit / a->Hkv;
    (void)thread;
    const float *base = c->partial + unit * nseg * G * (D + 2);
    for (int64_t g = 0; g < G; g++) {
        float *o = c->out + (t * a->H + hk * G + g) * D;
        float M = -INFINITY;
        for (int64_t j = 0; j < nseg; j++) {
            const float mj = base[j * G * (D + 2) + g];
            M = mj > M ? mj : M;
        }
        for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
        if (M == -INFINITY) continue;
        float L = 0.0f;
        for (int64_t j = 0; j < nseg; j++) {
            const float *p = base + j * G * (D + 2);
            if (p[g] == -INFINITY) continue;
            const float w = expf(p[g] - M);
            L += p[G + g] * w;
            for (int64_t i = 0; i < D; i++) o[i] += p[2 * G + g * D + i] * w;
        }
        const float inv = 1.0f / L;
        for (int64_t i = 0; i < D; i++) o[i] *= inv;
    }
}

static int mul_overflows(int64_t a, int64_t b) { return a > 0 && b > 0 && a > INT64_MAX / b; }

static int64_t n_segments(int64_t T, int64_t S) {
    return T <= KVREF_ATTN_SPLIT_MAX_T ? (S + KVREF_ATTN_SEGMENT - 1) / KVREF_ATTN_SEGMENT : 1;
}

size_t kvref_attention_scratch_bytes(int64_t G, int64_t D) {
    return (size_t)(kvref_attn_scratch_floats(G, D) + partial_floats(G, D)) * sizeof(float);
}

int64_t kvref_attention_partial_floats(int64_t T, int64_t Hkv, int64_t G, int64_t D, int64_t S) {
    const int64_t nseg = n_segments(T, S);
    return nseg > 1 ? T * Hkv * nseg * G * (D + 2) : 0;
}

void kvref_attention_run(kvref_pool *pool, const kvref_attn_args *a, float *partial, float *out) {
    attn_ctx c;
    c.a = *a;
    c.pool = pool;
    c.out = out;
    c.nseg = n_segments(a->T, a->S);
    c.partial = partial;
    c.unit_fn = kvref_pool_kernels(pool)->attn_unit;
    if (c.nseg >= KVREF_ATTN_SEGMENT_UNITS_MIN && a->Hkv > 1) {
        const int64_t units = 2 * kvref_pool_threads(pool);
        c.span = (c.nseg + units - 1) / units;
        c.runs = (c.nseg + c.span - 1) / c.span;
        kvref_pool_run(pool, attn_segment_task, &c, a->T * c.runs);
    } else
        kvref_pool_run(pool, attn_task, &c, a->T * a->Hkv * c.nseg);
    if (c.nseg > 1) kvref_pool_run(pool, merge_task, &c, a->T * a->Hkv);
}

int kvref_attention(kvref_pool *pool, const float *q, int64_t T, int64_t H, int64_t D, const kvref_kv *kv,
                    int64_t layer, int64_t S, const int64_t *q_positions, const int64_t *k_positions,
                    float *out) {
    if (pool == NULL || kv == NULL) return KVREF_ERR_NULL;
    if (T < 0 || H < 0 || D < 0 || S < 0 || layer < 0 || layer >= kv->n_layers) return KVREF_ERR_DIM;
    const int64_t Hkv = kv->n_kv_heads;
    int status = kvref_kv_check(kv, kv->n_layers, Hkv, D, S);
    if (status != KVREF_OK) return status;
    if (H % Hkv != 0) return KVREF_ERR_SHAPE;
    if (mul_overflows(T, H) || mul_overflows(T * H, D)) return KVREF_ERR_DIM;
    if (T == 0 || H == 0) return KVREF_OK;
    if (q == NULL || q_positions == NULL || out == NULL) return KVREF_ERR_NULL;
    if (S == 0) {
        for (int64_t i = 0; i < T * H * D; i++) out[i] = 0.0f; /* no key is visible */
        return KVREF_OK;
    }
    if (k_positions == NULL) return KVREF_ERR_NULL;

    const int64_t G = H / Hkv;
    kvref_attn_args a = {.q = q, .q_positions = q_positions, .k_positions = k_positions, .T = T, .H = H, .S = S,
                         .G = G, .scale = (float)(1.0 / sqrt((double)D))};
    kvref_kv_layer(kv, layer, &a);
    kvref_pool_lock(pool);
    status = kvref_pool_reserve(pool, kvref_attention_scratch_bytes(G, D));
    float *partial = NULL;
    const int64_t np = kvref_attention_partial_floats(T, Hkv, G, D, S);
    if (status == KVREF_OK && np > 0) {
        partial = kvref_pool_shared(pool, (size_t)np * sizeof(float));
        if (partial == NULL) status = KVREF_ERR_NOMEM;
    }
    if (status == KVREF_OK) kvref_attention_run(pool, &a, partial, out);
    kvref_pool_unlock(pool);
    return status;
}
