/* attention.c: causal grouped-query attention by position, single pass over K/V.
 *
 * The work is (query t, kv head hk, key segment) states: the G query heads that share hk are
 * scored together, so each K/V row is read once per group, not once per head, with an online
 * softmax (running max m, sum of exponentials l, unnormalised output acc) over the keys. A work unit
 * covers one or several such states (attn_task).
 *
 * This file is the whole algorithm for every instruction set: the chunk loop, the masking by
 * position, the online-softmax update and the merge of segments. The kernel table supplies the
 * arithmetic of one chunk (internal.h, kvref_attn_kernels): the scores, the exponentials and their
 * sums, and the value sum; the SIMD kernels take the G heads of a group at once, so each K/V vector
 * is loaded once per group, and prefetch the next chunk's rows.
 *
 * With few query positions (decode) there are too few (t, hk) pairs to keep every thread busy on
 * a long cache, so the keys are cut into fixed segments of KVREF_ATTN_SEGMENT and the segments'
 * (m, l, acc) are merged afterwards in segment order (the log-sum-exp merge). Segment boundaries
 * depend only on S, so results are the same for every thread count.
 *
 * Non-finite values follow kvref.spec.ops.attention's rule: a query head with a non-finite score
 * over the keys it sees outputs NaN everywhere; otherwise output element i is NaN exactly when a
 * seen key's value element i is not finite; keys it does not see never touch it; no key seen
 * gives zeros. The arithmetic carries most of it: a NaN or +inf score makes the sum of
 * exponentials l NaN (exp(NaN), exp(inf - inf)), which the rescaling and the final 1 / l spread
 * over the head; a non-finite value makes its accumulator non-finite. What it cannot carry is done
 * by hand: the score kernels store a seen -inf score (it would look masked) as NaN
 * (kvref_attn_score_value), "no key seen" is l == 0 rather than l > 0 (which NaN fails), and a
 * non-finite output is written as NaN.
 *
 * Gemma 2's soft cap of the scores (a->softcap > 0) is applied here, between the kernels' scores and
 * the mask, for every instruction set alike: one libm tanhf per score, so the capped scores are the
 * same bits whichever kernel table scored them. A NaN score stays NaN through it.
 */
#include <math.h>

#include "internal.h"

#define KVREF_ATTN_SEGMENT 256
#define KVREF_ATTN_SPLIT_MAX_T 4   /* split keys into segments when T <= this */
#define KVREF_ATTN_SEGMENT_UNITS_MIN 4 /* from this many segments on, a unit covers every kv head */
#define KVREF_ATTN_QUERY_UNITS_MIN 4 /* unsplit keys: a unit covers every kv head from this many
                                        queries per thread on (all the run's jobs') */

/* Per-thread scratch of a unit: probabilities p [G, CHUNK], each head's new running max and sum of
 * exponentials [G] and [G] (floats), then the rows of a chunk and its lookahead as int64: row and
 * srow [CHUNK + LOOKAHEAD]. */
static int64_t unit_scratch_floats(int64_t G) {
    return G * KVREF_ATTN_CHUNK + 2 * G + 4 * (KVREF_ATTN_CHUNK + KVREF_ATTN_LOOKAHEAD) + 64;
}

/* Per-thread scratch of an I8 K's rounded query (after the unit's and the online-softmax states' 2H
 * floats): qe and qsum [H, D / group_size] each (at most [H, D]), then q8 [H, D] bytes. */
static int64_t query_scratch_floats(int64_t H, int64_t D) { return 2 * H * D + (H * D + 3) / 4; }

/* rintf(x) for |x| < 2**22 (ties to even), as two IEEE additions: x + 1.5 * 2**23 has a unit ulp.
 * Baseline x86-64 (SSE2) has no rounding instruction, and rintf there is a library call. */
static inline float round_even(float x) { return (x + 12582912.0f) - 12582912.0f; }

/* Heads h0 .. h1-1 of query row q [H, D] rounded for an I8 K's integer scoring (internal.h,
 * kvref_attn_score_fn), group by group: q8 [H, D], qe and qsum [H, D / group_size]. A group holding
 * a NaN or an infinity gets d = NaN (kvref_q8_scale), so every score of its head is NaN, as the
 * float scores would be non-finite. */
static void quantize_query(const kvref_attn_args *a, const float *q, int64_t h0, int64_t h1, int8_t *q8, float *qe,
                           int32_t *qsum) {
    const int64_t D = a->D, gs = a->group_size, ng = D / gs;
    for (int64_t h = h0; h < h1; h++)
        for (int64_t b = 0; b < ng; b++) {
            const float *x = q + h * D + b * gs;
            int8_t *xq = q8 + h * D + b * gs;
            float amax = 0.0f, d, id;
            int finite = 1;
            for (int64_t j = 0; j < gs; j++) {
                const float m = fabsf(x[j]);
                amax = m > amax ? m : amax;
                finite &= x[j] * 0.0f == 0.0f; /* NaN for NaN and infinities */
            }
            kvref_q8_scale(amax, finite, &d, &id);
            int32_t sum = 0;
            for (int64_t j = 0; j < gs; j++) {
                float v = round_even(x[j] * id); /* |v| <= 127 for finite x (internal.h) */
                v = v < 127.0f ? v : 127.0f;
                v = v > -127.0f ? v : -127.0f;  /* NaN has gone to 127 on the line above */
                xq[j] = (int8_t)v;
                sum += xq[j];
            }
            qe[h * ng + b] = d * a->scale;
            qsum[h * ng + b] = sum;
        }
}

/* The online-softmax state of no key seen, for the G heads of a group: running max m = -inf, sum of
 * exponentials l = 0, unnormalised output acc = 0; m, l [G], acc [G, D] (D: the values' width, Dv) */
static void state_init(int64_t G, int64_t D, float *m, float *l, float *acc) {
    for (int64_t g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int64_t i = 0; i < G * D; i++) acc[i] = 0.0f;
}

/* The first position a query at qpos sees: qpos - window + 1, or INT64_MIN without a window (and
 * where that start would lie below INT64_MIN) */
static int64_t window_start(int64_t qpos, int64_t window) {
    return window == 0 || qpos < INT64_MIN + window ? INT64_MIN : qpos - (window - 1);
}

/* How many of the keys kp [n] a query sees (klo <= kp[s] <= qpos). As kvref_attn_hidden, key s is
 * hidden iff its offset kp[s] - klo exceeds qpos - klo as unsigned numbers; SSE2, all that baseline
 * x86-64 has, cannot compare uint64 lanes, so the comparison is spelled as the borrow of a
 * subtraction (Hacker's Delight 2-13), which it can vectorize. */
static int64_t visible_keys(const int64_t *kp, int64_t n, int64_t qpos, int64_t klo) {
    const uint64_t span = (uint64_t)qpos - (uint64_t)klo;
    uint64_t hidden = 0;
    for (int64_t s = 0; s < n; s++) {
        const uint64_t off = (uint64_t)kp[s] - (uint64_t)klo;
        hidden += ((~span & off) | (~(span ^ off) & (span - off))) >> 63; /* span < off */
    }
    return n - (int64_t)hidden;
}

/* A unit's place in query t's keys: the chunk it is at (kvref_attn_chunk, pointed at a kv head by
 * chunk_update) and its scratch. */
typedef struct {
    kvref_attn_chunk c;
    int64_t t;
    int64_t k_head, v_head;    /* bytes from one kv head's K (V) vector to the next one's in a slot */
    int64_t s_head;            /* I8 scales from one kv head's to the next one's */
    int64_t ks_head, vs_head;  /* KIVI4: K group params, V pairs, from one kv head's to the next one's */
    float *p, *mnew, *sum;     /* [G, CHUNK], [G], [G] */
    int64_t *row, *srow;       /* [CHUNK + LOOKAHEAD] each: c.row, c.srow */
    int64_t lookahead;         /* keys past a chunk whose rows the kernels get to prefetch */
    int8_t *q8;                /* an I8 K's rounded query t, by head: [H, D] (NULL for other K types) */
    float *qe;                 /* [H, D / group_size] */
    int32_t *qsum;             /* [H, D / group_size] */
} attn_cursor;

/* scratch: unit_scratch_floats(G) floats, 8-byte aligned; qscratch: query_scratch_floats(H, D) floats */
static void cursor_init(attn_cursor *u, const kvref_attn_args *a, int64_t t, float *scratch, float *qscratch) {
    const int64_t G = a->G, D = a->D;
    u->t = t;
    u->k_head = kvref_kv_vector_bytes(a->k_type, D);
    u->v_head = kvref_kv_vector_bytes(a->v_type, D);
    u->s_head = a->group_size > 0 ? D / a->group_size : 0;
    u->ks_head = a->k_type == KVREF_TYPE_KIVI4 ? 2 * D : u->s_head;
    u->vs_head = a->v_type == KVREF_TYPE_KIVI4 ? 2 * u->s_head : u->s_head;
    u->p = scratch;
    u->mnew = u->p + G * KVREF_ATTN_CHUNK;
    u->sum = u->mnew + G;
    u->row = (int64_t *)(void *)(u->sum + G);
    u->srow = u->row + KVREF_ATTN_CHUNK + KVREF_ATTN_LOOKAHEAD;
    u->c.row = u->row;
    u->c.srow = u->srow;
    u->c.qpos = a->q_positions[t];
    u->c.klo = window_start(u->c.qpos, a->window);
    /* Few queries (decode) read each K/V row once, from memory: the kernels prefetch a chunk ahead.
     * Many queries (prefill) read a chunk's rows query after query, from cache after the first, and
     * the prefetches only cost issue slots: Gemma 3's 512-query causal attention ran 5-9 % faster
     * without them, over 512 and over 4,096 cached positions. */
    u->lookahead = a->T <= KVREF_ATTN_SPLIT_MAX_T ? KVREF_ATTN_LOOKAHEAD : 0;
    u->q8 = NULL;
    if (a->k_type == KVREF_TYPE_I8) {
        u->qe = qscratch;
        u->qsum = (int32_t *)(void *)(qscratch + a->H * D);
        u->q8 = (int8_t *)(void *)(qscratch + 2 * a->H * D);
    }
}

/* Moves the cursor to the chunk of keys [c0, c0 + n): which are visible, and the rows of its keys
 * and of those the kernels prefetch. Returns 0 when no key of the chunk is visible: the chunk
 * would leave every state as it was. */
static int cursor_seek(attn_cursor *u, const kvref_attn_args *a, int64_t c0, int64_t n) {
    kvref_attn_chunk *c = &u->c;
    const int64_t *kp = a->k_positions + c0;
    const int64_t nvis = visible_keys(kp, n, c->qpos, c->klo);
    if (nvis == 0) return 0;
    c->n = n;
    c->kp = kp;
    c->all = nvis == n;
    c->nrows = a->S - c0 < n + u->lookahead ? a->S - c0 : n + u->lookahead;
    kvref_attn_rows(a, c0, c->nrows, u->row, u->srow);
    return 1;
}

/* out [G, D] = acc / l for the G heads of a group (out may be acc): zeros for a head that saw no key
 * (l = 0: a seen key adds exp(0) = 1 to l, or NaN), NaN where the quotient is not finite (a
 * non-finite value, or l NaN from a non-finite score): the spec's outputs are finite or NaN.
 * sinks [G] (the group's heads' sink logits) or NULL: each joins its head's denominator as one more
 * exponential, exp(sink - M) beside l exp(m - M), M = max(m, sink), with no value; a non-finite
 * sink makes its head NaN, as a non-finite score does. m [G]: the running maxima l and acc are
 * relative to. */
static void normalise(int64_t G, int64_t D, const float *m, const float *l, const float *sinks, const float *acc,
                      float *out) {
    for (int64_t g = 0; g < G; g++) {
        float denom = l[g], rescale = 1.0f;
        if (sinks != NULL && !isfinite(sinks[g])) denom = NAN;
        else if (sinks != NULL && l[g] != 0.0f) {
            const float M = m[g] > sinks[g] ? m[g] : sinks[g]; /* m NaN-free: -inf or a seen score's max */
            rescale = expf(m[g] - M);
            denom = l[g] * rescale + expf(sinks[g] - M);
        }
        const float inv = denom != 0.0f ? rescale / denom : 0.0f;
        for (int64_t i = 0; i < D; i++) {
            const float o = denom != 0.0f ? acc[g * D + i] * inv : 0.0f;
            out[g * D + i] = isfinite(o) ? o : NAN;
        }
    }
}

/* out [T, H, D] of queries that see no key: zeros, or NaN for a head whose sink logit is not finite */
static void no_key_seen(int64_t T, int64_t H, int64_t D, const float *sinks, float *out) {
    for (int64_t i = 0; i < T * H * D; i++) out[i] = sinks != NULL && !isfinite(sinks[i / D % H]) ? NAN : 0.0f;
}

/* the sink logits of kv head hk's G query heads, or NULL */
static const float *group_sinks(const kvref_attn_args *a, int64_t hk) {
    return a->sinks != NULL ? a->sinks + hk * a->G : NULL;
}

/* The cursor's chunk for the G query heads of kv head hk: an online-softmax update of their state
 * (m, l [G], acc [G, Dv], relative to m; state_init is the state of no key seen). Each head's
 * running max moves once per chunk, rescaling what was accumulated, then probability x value is
 * added. A unit applies this to the chunks of its keys in order from a multiple of
 * KVREF_ATTN_CHUNK, so a state is the same, bit for bit, however the keys were cut into segments
 * and units (and whichever thread ran them). */
static void chunk_update(const kvref_attn_kernels *ak, const kvref_attn_args *a, attn_cursor *u, int64_t hk,
                         float *m, float *l, float *acc) {
    const int64_t G = a->G, D = a->D, C = KVREF_ATTN_CHUNK;
    kvref_attn_chunk *c = &u->c;
    float *p = u->p;
    c->q = a->q + (u->t * a->H + hk * G) * D;
    c->k = a->k + hk * u->k_head;
    c->v = a->v + hk * u->v_head;
    c->k_scales = a->k_scales != NULL ? a->k_scales + hk * u->ks_head : NULL;
    c->v_scales = a->v_scales != NULL ? a->v_scales + hk * u->vs_head : NULL;
    c->k_residual = a->k_residual != NULL ? a->k_residual + hk * D : NULL;
    if (u->q8 != NULL) {
        c->q8 = u->q8 + hk * G * D;
        c->qe = u->qe + hk * G * u->s_head;
        c->qsum = u->qsum + hk * G * u->s_head;
    }
    ak->score(a, c, p); /* a seen -inf score is stored as NaN (kvref_attn_score_value) */
    if (a->softcap > 0.0f) /* Gemma 2: every score squashed into (-softcap, softcap) before the mask */
        for (int64_t g = 0; g < G; g++)
            for (int64_t s = 0; s < c->n; s++) p[g * C + s] = kvref_soft_cap_value(p[g * C + s], a->softcap);
    if (!c->all) /* masked keys get probability exp(-inf) = 0 */
        for (int64_t s = 0; s < c->n; s++)
            if (kvref_attn_hidden(c, s))
                for (int64_t g = 0; g < G; g++) p[g * C + s] = -INFINITY;
    ak->exp(G, c->n, m, p, u->mnew, u->sum);
    for (int64_t g = 0; g < G; g++) {
        const float alpha = expf(m[g] - u->mnew[g]); /* 0 while nothing was seen (m = -inf) */
        l[g] = l[g] * alpha + u->sum[g];
        if (alpha != 1.0f)
            for (int64_t i = 0; i < a->Dv; i++) acc[g * a->Dv + i] *= alpha;
        m[g] = u->mnew[g];
    }
    ak->values(a, c, p, acc);
}

/* the jobs of one run, and the pool that runs them */
typedef struct {
    kvref_pool *pool;
    kvref_attn_job *jobs;
    int64_t n;
} attn_batch;

/* the job whose units [first, first + count) hold `unit`, first = jobs[j].unit0 (merge: merge0),
 * and the unit's index among its job's */
static kvref_attn_job *job_of(const attn_batch *b, int merge, int64_t *unit) {
    int64_t lo = 0, hi = b->n - 1;
    while (lo < hi) { /* the last job whose first unit is <= unit */
        const int64_t mid = (lo + hi + 1) / 2;
        if ((merge ? b->jobs[mid].merge0 : b->jobs[mid].unit0) <= *unit) lo = mid;
        else hi = mid - 1;
    }
    *unit -= merge ? b->jobs[lo].merge0 : b->jobs[lo].unit0;
    return &b->jobs[lo];
}

/* The state of query t, kv head hk, segment seg: in the partials when the keys are split;
 * otherwise m, l in the unit's ml [heads, 2, G] (hk0: the unit's first kv head) and acc in out,
 * where the unit normalises it at the end. */
static void state_of(const kvref_attn_job *c, int64_t t, int64_t hk, int64_t seg, float *ml, int64_t hk0, float **m,
                     float **l, float **acc) {
    const int64_t G = c->a.G, D = c->a.Dv; /* the state holds values */
    if (c->nseg > 1) {
        *m = c->partial + ((t * c->a.Hkv + hk) * c->nlive + seg - c->seg_lo) * G * (D + 2);
        *acc = *m + 2 * G;
    } else {
        *m = ml + (hk - hk0) * 2 * G;
        *acc = c->out + (t * c->a.H + hk * G) * D;
    }
    *l = *m + G;
}

/* One unit: query t, the kv heads hk0 .. hk0 + heads - 1 and the key segments seg0 .. seg1 - 1,
 * chunk by chunk; a chunk's visibility and rows are found once for all the unit's kv heads.
 *
 * Few queries (decode) over a long cache: a unit covers every kv head of a run of `span`
 * segments, so each chunk's K/V rows (all heads: contiguous memory) are consumed together and the
 * cache streams from memory in order; a unit of one kv head reads one head's part of every row, a
 * third of each row for SmolLM2, and walks the layer's K/V once per kv head. The span makes two
 * units per thread: a unit prefetches one chunk ahead of the keys it scores, so only its first
 * chunk waits on memory, and runs of segments that long stream the rest behind the prefetches;
 * two, not one, so a thread the host delays leaves work for the others (one and four per thread
 * measured no faster than two). Many queries (prefill, or the short caches of a batch's
 * sequences): a unit covers every kv head of one query when the run's queries still make several
 * units per thread, and reads whole slots, so the cache streams in order. Each (t, hk, segment)
 * state is the same sequence of chunk updates whatever the unit, so the results are identical for
 * any split. */
static void attn_task(void *vctx, int64_t unit, int thread) {
    const attn_batch *batch = vctx;
    const kvref_attn_job *c = job_of(batch, 0, &unit);
    const kvref_attn_args *a = &c->a;
    const int64_t G = a->G, D = a->D, nseg = c->nseg, blocks = a->Hkv / c->heads;
    const int64_t run = unit % c->runs, hk0 = unit / c->runs % blocks * c->heads, t = unit / (c->runs * blocks);
    const int64_t hk1 = hk0 + c->heads, seg0 = c->seg_lo + run * c->span;
    const int64_t seg1 = seg0 + c->span < c->seg_lo + c->nlive ? seg0 + c->span : c->seg_lo + c->nlive;
    float *scratch = kvref_pool_scratch(batch->pool, thread), *ml = scratch + unit_scratch_floats(G), *m, *l, *acc;
    attn_cursor u;
    cursor_init(&u, a, t, scratch, ml + 2 * a->H);
    if (u.q8 != NULL) quantize_query(a, a->q + t * a->H * D, hk0 * G, hk1 * G, u.q8, u.qe, u.qsum);
    for (int64_t seg = seg0; seg < seg1; seg++) {
        const int64_t s0 = seg * KVREF_ATTN_SEGMENT < c->k_begin ? c->k_begin : seg * KVREF_ATTN_SEGMENT;
        const int64_t s1 = nseg == 1 || (seg + 1) * KVREF_ATTN_SEGMENT > c->k_end ? c->k_end : (seg + 1) * KVREF_ATTN_SEGMENT;
        for (int64_t hk = hk0; hk < hk1; hk++) {
            state_of(c, t, hk, seg, ml, hk0, &m, &l, &acc);
            state_init(G, a->Dv, m, l, acc);
        }
        for (int64_t c0 = s0; c0 < s1; c0 += KVREF_ATTN_CHUNK) {
            if (!cursor_seek(&u, a, c0, s1 - c0 < KVREF_ATTN_CHUNK ? s1 - c0 : KVREF_ATTN_CHUNK)) continue;
            for (int64_t hk = hk0; hk < hk1; hk++) {
                state_of(c, t, hk, seg, ml, hk0, &m, &l, &acc);
                chunk_update(c->kernels, a, &u, hk, m, l, acc);
            }
        }
    }
    if (nseg == 1)
        for (int64_t hk = hk0; hk < hk1; hk++) {
            state_of(c, t, hk, 0, ml, hk0, &m, &l, &acc);
            normalise(G, a->Dv, m, l, group_sinks(a, hk), acc, acc);
        }
}

/* out[t, hk*G + g] = sum_j acc_j exp(m_j - M) / sum_j l_j exp(m_j - M), M = max_j m_j, over the
 * segments j that saw a key (l_j != 0; a segment that saw only NaN scores has m_j = -inf and l_j NaN,
 * and its NaN weight exp(-inf - M) or l_j carries into L). */
static void merge_task(void *vctx, int64_t unit, int thread) {
    const kvref_attn_job *c = job_of(vctx, 1, &unit);
    const kvref_attn_args *a = &c->a;
    const int64_t G = a->G, D = a->Dv, nseg = c->nlive, stride = G * (D + 2); /* D: the values' width */
    const int64_t hk = unit % a->Hkv, t = unit / a->Hkv;
    (void)thread;
    const float *base = c->partial + unit * nseg * stride;
    for (int64_t g = 0; g < G; g++) {
        float *o = c->out + (t * a->H + hk * G + g) * D;
        float M = -INFINITY, L = 0.0f;
        for (int64_t j = 0; j < nseg; j++) {
            const float mj = base[j * stride + g], lj = base[j * stride + G + g];
            M = lj != 0.0f && mj > M ? mj : M;
        }
        for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
        for (int64_t j = 0; j < nseg; j++) {
            const float *p = base + j * stride;
            if (p[G + g] == 0.0f) continue; /* no key seen in this segment */
            const float w = expf(p[g] - M);
            L += p[G + g] * w;
            for (int64_t i = 0; i < D; i++) o[i] += p[2 * G + g * D + i] * w;
        }
        const float *sink = group_sinks(a, hk);
        normalise(1, D, &M, &L, sink != NULL ? sink + g : NULL, o, o);
    }
}

static int mul_overflows(int64_t a, int64_t b) { return a > 0 && b > 0 && a > INT64_MAX / b; }

static int64_t n_segments(int64_t T, int64_t S) {
    return T <= KVREF_ATTN_SPLIT_MAX_T ? (S + KVREF_ATTN_SEGMENT - 1) / KVREF_ATTN_SEGMENT : 1;
}

/* The keys [k_begin, k_end) of chunks holding a position some query sees (some key in
 * [min window start, max query position]); a chunk outside it would leave every state as it was,
 * so skipping it changes no result. Reads the positions only, never K/V. 0 when no key is visible. */
static int live_keys(const kvref_attn_args *a, int64_t *k_begin, int64_t *k_end) {
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int64_t t = 0; t < a->T; t++) {
        const int64_t p = a->q_positions[t], start = window_start(p, a->window);
        lo = start < lo ? start : lo;
        hi = p > hi ? p : hi;
    }
    int64_t first = -1, last = -1;
    for (int64_t c0 = 0; c0 < a->S; c0 += KVREF_ATTN_CHUNK) {
        const int64_t n = a->S - c0 < KVREF_ATTN_CHUNK ? a->S - c0 : KVREF_ATTN_CHUNK;
        if (visible_keys(a->k_positions + c0, n, hi, lo) == 0) continue;
        first = first < 0 ? c0 : first;
        last = c0 + n;
    }
    *k_begin = first;
    *k_end = last;
    return first >= 0;
}

size_t kvref_attention_scratch_bytes(int64_t H, int64_t G, int64_t D) {
    return (size_t)(unit_scratch_floats(G) + 2 * H + query_scratch_floats(H, D)) * sizeof(float);
}

int64_t kvref_attention_partial_floats(int64_t T, int64_t Hkv, int64_t G, int64_t D, int64_t S) {
    const int64_t split = T < KVREF_ATTN_SPLIT_MAX_T ? T : KVREF_ATTN_SPLIT_MAX_T; /* the most queries split */
    const int64_t nseg = n_segments(split, S);
    return nseg > 1 ? split * Hkv * nseg * G * (D + 2) : 0;
}

/* How job c's work is cut into units, in a run of `queries` queries in all; returns how many (0
 * when no query sees any key: then its output is zeros, written here). */
static int64_t job_plan(kvref_attn_job *c, int64_t threads, int64_t queries, const kvref_kernels *kk) {
    const kvref_attn_args *a = &c->a;
    c->nseg = n_segments(a->T, a->S);
    if (!live_keys(a, &c->k_begin, &c->k_end)) { /* no query sees any key */
        no_key_seen(a->T, a->H, a->Dv, a->sinks, c->out);
        c->nseg = 1;
        return 0;
    }
    c->seg_lo = c->nseg > 1 ? c->k_begin / KVREF_ATTN_SEGMENT : 0;
    c->nlive = c->nseg > 1 ? (c->k_end + KVREF_ATTN_SEGMENT - 1) / KVREF_ATTN_SEGMENT - c->seg_lo : 1;
    c->kernels = &kk->attn;
    const int i8 = a->k_type == KVREF_TYPE_I8 || a->v_type == KVREF_TYPE_I8;
    if (i8 && a->group_size % c->kernels->i8_lanes != 0) c->kernels = &kvref_kernels_scalar.attn;
    const int kivi = a->k_type == KVREF_TYPE_KIVI4 || a->v_type == KVREF_TYPE_KIVI4;
    if (kivi && (c->kernels->kivi_lanes == 0 || a->group_size % c->kernels->kivi_lanes != 0 ||
                 a->D % c->kernels->kivi_lanes != 0))
        c->kernels = &kvref_kernels_scalar.attn;
    c->heads = 1; /* a unit per (query, kv head, segment) */
    c->span = 1;
    c->runs = c->nlive;
    if (c->nlive >= KVREF_ATTN_SEGMENT_UNITS_MIN) { /* runs of segments, every kv head */
        c->heads = a->Hkv;
        c->span = (c->nlive + 2 * threads - 1) / (2 * threads);
        c->runs = (c->nlive + c->span - 1) / c->span;
    } else if (c->nseg == 1 && queries >= KVREF_ATTN_QUERY_UNITS_MIN * threads)
        c->heads = a->Hkv; /* a unit per query */
    return a->T * (a->Hkv / c->heads) * c->runs;
}

void kvref_attention_run(kvref_pool *pool, kvref_attn_job *jobs, int64_t n) {
    const int64_t threads = kvref_pool_threads(pool);
    const kvref_kernels *kk = kvref_pool_kernels(pool);
    int64_t units = 0, merges = 0, queries = 0;
    for (int64_t j = 0; j < n; j++) queries += jobs[j].a.T;
    for (int64_t j = 0; j < n; j++) {
        jobs[j].unit0 = units;
        jobs[j].merge0 = merges;
        units += job_plan(&jobs[j], threads, queries, kk);
        merges += jobs[j].nseg > 1 ? jobs[j].a.T * jobs[j].a.Hkv : 0;
    }
    attn_batch batch = {pool, jobs, n};
    if (units > 0) kvref_pool_run(pool, attn_task, &batch, units);
    if (merges > 0) kvref_pool_run(pool, merge_task, &batch, merges);
}

int kvref_attention(kvref_pool *pool, const float *q, int64_t T, int64_t H, int64_t D, const kvref_kv *kv,
                    int64_t layer, int64_t S, const int64_t *q_positions, const int64_t *k_positions,
                    int64_t window, float softcap, float scale, const float *sinks, float *out) {
    if (pool == NULL || kv == NULL) return KVREF_ERR_NULL;
    if (T < 0 || H < 0 || D < 0 || S < 0 || layer < 0 || layer >= kv->n_layers) return KVREF_ERR_DIM;
    if (window < 0 || !isfinite(scale) || !(softcap >= 0.0f) || isinf(softcap)) return KVREF_ERR_VALUE;
    const int64_t Hkv = kv->n_kv_heads;
    int status = kvref_kv_check(kv, kv->n_layers, Hkv, D, 0);
    const int64_t ring = status == KVREF_OK ? kvref_kv_ring(kv, layer) : 0;
    if (status == KVREF_OK && ring == 0) status = kvref_kv_check(kv, kv->n_layers, Hkv, D, S); /* S positions */
    if (status == KVREF_OK && S > ring && ring > 0) status = KVREF_ERR_DIM; /* key s is the ring's slot s */
    if (status != KVREF_OK) return status;
    if (H % Hkv != 0) return KVREF_ERR_SHAPE;
    if (mul_overflows(T, H) || mul_overflows(T * H, D)) return KVREF_ERR_DIM;
    if (T == 0 || H == 0) return KVREF_OK;
    if (q == NULL || q_positions == NULL || out == NULL) return KVREF_ERR_NULL;
    const int64_t Dv = kv->v_dim > 0 ? kv->v_dim : D;
    if (S == 0) {
        no_key_seen(T, H, Dv, sinks, out);
        return KVREF_OK;
    }
    if (k_positions == NULL) return KVREF_ERR_NULL;

    const int64_t G = H / Hkv;
    kvref_attn_args a = {.q = q, .q_positions = q_positions, .k_positions = k_positions, .T = T, .H = H, .S = S,
                         .G = G, .window = window, .scale = scale, .softcap = softcap, .sinks = sinks};
    kvref_kv_layer(kv, layer, &a);
    kvref_pool_lock(pool);
    status = kvref_pool_reserve(pool, kvref_attention_scratch_bytes(H, G, D));
    float *partial = NULL;
    const int64_t np = kvref_attention_partial_floats(T, Hkv, G, Dv, S);
    if (status == KVREF_OK && np > 0) {
        partial = kvref_pool_shared(pool, (size_t)np * sizeof(float));
        if (partial == NULL) status = KVREF_ERR_NOMEM;
    }
    kvref_attn_job job = {.a = a, .partial = partial, .out = out};
    if (status == KVREF_OK) kvref_attention_run(pool, &job, 1);
    kvref_pool_unlock(pool);
    return status;
}
