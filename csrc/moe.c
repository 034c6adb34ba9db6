/* moe.c: a mixture of experts' MLP in the fused forward, and its router.
 *
 * kvref/spec/decoder.py's `moe` step for step, with the kernels the decoder calls on the native
 * backend: the router's projection (kvref_matmul), kvref_route, the experts' projections as
 * kvref_matmul_experts computes them (the rows grouped by expert, kvref_group_by_expert, and each
 * expert's rows one kvref_matmul, so each routed expert's weights stream once per pass), the gate
 * kernel, and the weighted sum in routing order. With exact activations its output is therefore
 * bit for bit the decoder's on the same kernels; with int8 activations each projection is the int8
 * mode's (kvref_matmul_int8), reading the packed copies.
 *
 * Shape legend as kvref.h; X experts, k of them per position, R = T k rows (row t k + j: position t
 * through its j-th expert), Fx an expert's hidden width, Fs the shared expert's.
 */
#define _POSIX_C_SOURCE 200809L /* platform.h */

#include <stdlib.h>

#include "internal.h"
#include "platform.h"

struct kvref_moe_state {
    int64_t rows;              /* T the buffers hold */
    float *logits;             /* [T, X] router logits */
    int64_t *experts;          /* [T, k] each position's experts, best first */
    float *weights;            /* [T, k] their weights */
    float *route;              /* [2 X + G] one row's scores, choices and group scores (route_row) */
    int64_t *ids;              /* [G] the best groups of a row */
    int64_t *first, *placed;   /* [X + 1], [X]: kvref_group_by_expert's */
    int64_t *order;            /* [R] the row in each slot (rows grouped by expert) */
    int64_t *slot;             /* [R] the slot of each row */
    float *xs;                 /* [R, E] the rows' inputs by slot; then their experts' outputs */
    float *gate, *up;          /* [R, max(Fx, Fs)] hidden, by slot (the shared expert's: by position) */
    float *y;                  /* [T, E] the routed experts' weighted sum */
};

/* ---- the router ------------------------------------------------------------------------------ */

int64_t kvref_top_ids(const float *row, int64_t V, int64_t k, int64_t *ids) {
    int64_t n = 0;
    for (int64_t v = 0; v < V; v++) {
        const float x = row[v];
        if (x != x || (n == k && !(x > row[ids[k - 1]]))) continue;
        int64_t i = n < k ? n++ : k - 1;
        for (; i > 0 && x > row[ids[i - 1]]; i--) ids[i] = ids[i - 1];
        ids[i] = v;
    }
    return n;
}

/* scores [X] of one row of logits: softmax over the row (its max subtracted; a NaN or +inf makes
 * every score NaN, a row of -inf has none: zeros) or each logit's sigmoid, as kvref.spec.ops */
static void scores_row(const float *logits, int64_t X, int32_t score, float *scores) {
    if (score == KVREF_ROUTER_SIGMOID) {
        for (int64_t i = 0; i < X; i++) scores[i] = 0.5f * (1.0f + tanhf(0.5f * logits[i]));
        return;
    }
    float max = -INFINITY;
    int nan = 0;
    for (int64_t i = 0; i < X; i++) {
        nan |= isnan(logits[i]);
        max = logits[i] > max ? logits[i] : max;
    }
    if (nan || max == INFINITY || max == -INFINITY) {
        for (int64_t i = 0; i < X; i++) scores[i] = max == -INFINITY && !nan ? 0.0f : NAN;
        return;
    }
    float total = 0.0f;
    for (int64_t i = 0; i < X; i++) {
        scores[i] = expf(logits[i] - max);
        total += scores[i];
    }
    for (int64_t i = 0; i < X; i++) scores[i] = scores[i] / total;
}

/* ids [k] of the k largest of v [n], best first: of equal values the lower id first, NaN after every
 * number, in id order (the order of a stable sort of -v, which the spec takes) */
static void top_k(const float *v, int64_t n, int64_t k, int64_t *ids) {
    for (int64_t i = 0, m = kvref_top_ids(v, n, k, ids); m < k; i++)
        if (isnan(v[i])) ids[m++] = i;
}

/* choice [X] with every expert outside the row's G_used best groups set to -inf (grouped top-k,
 * DeepSeek): a group scores its best choice, or its two best summed; a group holding a NaN scores NaN */
static void best_groups_only(const kvref_router *r, float *choice, float *group_scores, int64_t *ids) {
    const int64_t G = r->n_groups, size = r->n_experts / G;
    for (int64_t g = 0; g < G; g++) {
        float best = -INFINITY, second = -INFINITY;
        int nan = 0;
        for (int64_t i = g * size; i < (g + 1) * size; i++) {
            const float x = choice[i];
            nan |= isnan(x);
            if (x > best) {
                second = best;
                best = x;
            } else if (x > second) {
                second = x;
            }
        }
        group_scores[g] = nan ? NAN : r->group_score == KVREF_GROUP_MAX || size == 1 ? best : second + best;
    }
    top_k(group_scores, G, r->n_groups_used, ids);
    for (int64_t g = 0; g < G; g++) group_scores[g] = 0.0f; /* now: 1 for a kept group */
    for (int64_t j = 0; j < r->n_groups_used; j++) group_scores[ids[j]] = 1.0f;
    for (int64_t i = 0; i < r->n_experts; i++)
        if (group_scores[i / size] == 0.0f) choice[i] = -INFINITY;
}

/* one position's routing: logits [X] -> experts [k], weights [k]; scratch [2 X + G], ids [G] */
static void route_row(const kvref_router *r, const float *logits, const float *selection_bias, float *scratch,
                      int64_t *ids, int64_t *experts, float *weights) {
    const int64_t X = r->n_experts, k = r->n_used;
    float *scores = scratch, *choice = scratch + X;
    scores_row(logits, X, r->score, scores);
    for (int64_t i = 0; i < X; i++) choice[i] = selection_bias == NULL ? scores[i] : scores[i] + selection_bias[i];
    if (r->n_groups > 1) best_groups_only(r, choice, choice + X, ids);
    top_k(choice, X, k, experts);
    for (int64_t j = 0; j < k; j++) weights[j] = scores[experts[j]]; /* the unbiased scores of the chosen */
    if (r->normalize) {
        float total = weights[0];
        for (int64_t j = 1; j < k; j++) total += weights[j];
        for (int64_t j = 0; j < k; j++) weights[j] = weights[j] / total;
    }
    for (int64_t j = 0; j < k; j++) weights[j] = weights[j] * r->scaling;
}

int kvref_router_check(const kvref_router *r) {
    if (r == NULL) return KVREF_ERR_NULL;
    if (r->n_experts < 1 || r->n_experts > (INT64_C(1) << 24) || r->n_used < 1 || r->n_used > r->n_experts ||
        r->n_groups < 1 || r->n_experts % r->n_groups != 0 || r->n_groups_used < 1 || r->n_groups_used > r->n_groups)
        return KVREF_ERR_VALUE;
    if ((r->score != KVREF_ROUTER_SOFTMAX && r->score != KVREF_ROUTER_SIGMOID) ||
        (r->group_score != KVREF_GROUP_TOP2_SUM && r->group_score != KVREF_GROUP_MAX) ||
        (r->normalize != 0 && r->normalize != 1) || !isfinite(r->scaling))
        return KVREF_ERR_VALUE;
    /* a row's k choices come from its G_used groups: they must hold k experts */
    return r->n_groups_used * (r->n_experts / r->n_groups) >= r->n_used ? KVREF_OK : KVREF_ERR_VALUE;
}

int kvref_route(const float *logits, int64_t T, const float *selection_bias, const kvref_router *router,
                int64_t *experts, float *weights) {
    int status = kvref_router_check(router);
    if (status != KVREF_OK) return status;
    if (T < 0 || T > (INT64_C(1) << 24)) return KVREF_ERR_DIM;
    if (T == 0) return KVREF_OK;
    if (logits == NULL || experts == NULL || weights == NULL) return KVREF_ERR_NULL;
    const int64_t X = router->n_experts, k = router->n_used;
    float *scratch = malloc((size_t)(2 * X + router->n_groups) * sizeof(float));
    int64_t *ids = malloc((size_t)router->n_groups * sizeof(int64_t));
    if (scratch != NULL && ids != NULL)
        for (int64_t t = 0; t < T; t++)
            route_row(router, logits + t * X, selection_bias, scratch, ids, experts + t * k, weights + t * k);
    status = scratch != NULL && ids != NULL ? KVREF_OK : KVREF_ERR_NOMEM;
    free(scratch);
    free(ids);
    return status;
}

/* ---- the experts ----------------------------------------------------------------------------- */

/* y [T, N] = x [T, K] @ W.T, W [N, K] at w in `type` blocks (packed: its packed copy, or NULL), as
 * kvref_matmul computes it, or with int8 as kvref_matmul_int8 does (from the packed copy when there
 * is one: the packed kernels at any T compute the 8-bit GEMM's sums) */
static void project(kvref_pool *pool, int int8, const float *x, int64_t T, int64_t K, const uint8_t *w,
                    const uint8_t *packed, int32_t type, int64_t N, float *y) {
    if (int8 && packed != NULL) {
        kvref_mv mv = {x, NULL, NULL, NULL, T, K, 1, {{w, packed, type, N, y, N}}, 0, NULL};
        kvref_quantize_rows(pool, x, T, K, &mv.xqs, &mv.xds, &mv.xsum);
        kvref_mv_run(pool, &mv);
    } else if (int8) {
        kvref_matmul_int8_run(pool, x, T, K, w, type, N, y);
    } else {
        kvref_matmul_run(pool, x, T, K, w, type, N, y);
    }
}

/* bytes from one expert's packed copy to the next: its own, rounded up to keep each 64-byte aligned */
static int64_t expert_packed_nbytes(int32_t type, int64_t N, int64_t K) { return (kvref_packed_nbytes(type, N, K) + 63) & ~INT64_C(63); }

/* ys [R, N] = xs [R, K] through the stack w of X experts [N, K]: the slots of expert e (grouped by
 * kvref_group_by_expert into s->first) are one projection of its matrix, read once; an expert
 * no row chose is never read. Returns the bytes of the experts' matrices read (their packed copies'
 * where those are read). */
static int64_t project_experts(kvref_pool *pool, int int8, const kvref_moe_state *s, int64_t X, const float *xs,
                            const kvref_tensor *w, float *ys) {
    const int64_t K = w->cols, N = w->rows / X, rb = kvref_row_nbytes(w->type, K);
    const int64_t pb = expert_packed_nbytes(w->type, N, K);
    int64_t read = 0;
    for (int64_t e = 0; e < X; e++) {
        const int64_t n = s->first[e + 1] - s->first[e];
        if (n == 0) continue;
        project(pool, int8, xs + s->first[e] * K, n, K, (const uint8_t *)w->data + e * N * rb,
                w->packed != NULL ? (const uint8_t *)w->packed + e * pb : NULL, w->type, N, ys + s->first[e] * N);
        read += int8 && w->packed != NULL ? kvref_packed_nbytes(w->type, N, K) : N * rb;
    }
    return read;
}

/* rows [R, N] by slot += bias [X, N] of each slot's expert (gpt-oss) */
static void add_expert_bias(const kvref_moe_state *s, int64_t R, const float *bias, int64_t N, float *rows) {
    for (int64_t slot = 0; slot < R; slot++) {
        const float *b = bias + s->experts[s->order[slot]] * N;
        float *y = rows + slot * N;
        for (int64_t i = 0; i < N; i++) y[i] = y[i] + b[i];
    }
}

/* gate [n, F] = act(gate) * up, row by row (the kernel is elementwise: any split gives the same) */
static void gated_rows(kvref_glu_fn glu, int64_t n, int64_t F, float *gate, const float *up) {
    for (int64_t r = 0; r < n; r++) glu(F, gate + r * F, up + r * F, gate + r * F);
}

/* the shared expert (DeepSeek) of T positions xb [T, E] -> s->xs [T, E]: a dense gated MLP */
static void shared_expert(kvref_pool *pool, const kvref_model_desc *c, const kvref_moe_layer *m, int int8,
                          const float *xb, int64_t T, kvref_moe_state *s) {
    const int64_t E = c->d_model, Fs = c->shared_d_ff;
    const kvref_tensor *g = &m->shared_gate, *u = &m->shared_up, *d = &m->shared_down;
    project(pool, int8, xb, T, E, g->data, g->packed, g->type, Fs, s->gate);
    project(pool, int8, xb, T, E, u->data, u->packed, u->type, Fs, s->up);
    gated_rows(kvref_gate_fn(kvref_pool_kernels(pool), c->gate), T, Fs, s->gate, s->up);
    project(pool, int8, s->gate, T, Fs, d->data, d->packed, d->type, E, s->xs);
}

int64_t kvref_moe_run(kvref_pool *pool, const kvref_model_desc *c, const kvref_moe_layer *m, int int8, float *xb,
                      int64_t T, kvref_moe_state *s) {
    const kvref_router *r = &c->router;
    const int64_t X = r->n_experts, k = r->n_used, E = c->d_model, Fx = c->expert_d_ff, R = T * k;
    /* route: logits = xb @ router.T (+ bias), then each position's experts and weights */
    project(pool, int8, xb, T, E, m->router.data, m->router.packed, m->router.type, X, s->logits);
    if (m->router_bias != NULL)
        for (int64_t i = 0; i < T * X; i++) s->logits[i] = s->logits[i] + m->router_bias[i % X];
    for (int64_t t = 0; t < T; t++)
        route_row(r, s->logits + t * X, m->selection_bias, s->route, s->ids, s->experts + t * k, s->weights + t * k);
    /* rows grouped by expert: each routed expert's weights stream once */
    memset(s->first, 0, (size_t)(X + 1) * sizeof(int64_t));
    memset(s->placed, 0, (size_t)X * sizeof(int64_t));
    kvref_group_by_expert(s->experts, R, X, s->first, s->placed, s->order);
    for (int64_t slot = 0; slot < R; slot++) {
        s->slot[s->order[slot]] = slot;
        memcpy(s->xs + slot * E, xb + s->order[slot] / k * E, (size_t)E * sizeof(float)); /* row t k + j is x[t] */
    }
    /* each row through its expert: down(act(gate x [+ b]) * (up x [+ b])) [+ b] */
    int64_t read = project_experts(pool, int8, s, X, s->xs, &m->gate, s->gate);
    read += project_experts(pool, int8, s, X, s->xs, &m->up, s->up);
    if (m->gate_bias != NULL) {
        add_expert_bias(s, R, m->gate_bias, Fx, s->gate);
        add_expert_bias(s, R, m->up_bias, Fx, s->up);
    }
    gated_rows(kvref_gate_fn(kvref_pool_kernels(pool), c->gate), R, Fx, s->gate, s->up);
    read += project_experts(pool, int8, s, X, s->gate, &m->down, s->xs);
    if (m->down_bias != NULL) add_expert_bias(s, R, m->down_bias, E, s->xs);
    /* y[t] = sum_j out[t k + j] * weight[t, j], added in routing order (best first), as the decoder adds */
    for (int64_t t = 0; t < T; t++) {
        float *y = s->y + t * E;
        for (int64_t j = 0; j < k; j++) {
            const float *out = s->xs + s->slot[t * k + j] * E, w = s->weights[t * k + j];
            for (int64_t i = 0; i < E; i++) y[i] = j == 0 ? out[i] * w : y[i] + out[i] * w;
        }
    }
    if (m->shared_gate.data == NULL) {
        memcpy(xb, s->y, (size_t)(T * E) * sizeof(float));
        return read;
    }
    shared_expert(pool, c, m, int8, xb, T, s); /* -> s->xs [T, E] */
    for (int64_t i = 0; i < T * E; i++) xb[i] = s->y[i] + s->xs[i];
    return read;
}

/* ---- checks and buffers ---------------------------------------------------------------------- */

int kvref_moe_check(const kvref_model_desc *c, const kvref_layer_desc *lw) {
    const kvref_moe_layer *m = lw->moe;
    const int64_t X = c->router.n_experts, E = c->d_model, Fx = c->expert_d_ff, Fs = c->shared_d_ff;
    if (X == 0) return KVREF_ERR_VALUE; /* a mixture layer needs the model's router */
    if (lw->w_gate.data != NULL || lw->w_up.data != NULL || lw->w_down.data != NULL) return KVREF_ERR_VALUE;
    if ((m->gate_bias == NULL) != (m->up_bias == NULL) || (m->gate_bias == NULL) != (m->down_bias == NULL))
        return KVREF_ERR_NULL;
    const struct { const kvref_tensor *t; int64_t rows, cols; } expect[] = {
        {&m->router, X, E}, {&m->gate, X * Fx, E}, {&m->up, X * Fx, E}, {&m->down, X * E, Fx},
        {&m->shared_gate, Fs, E}, {&m->shared_up, Fs, E}, {&m->shared_down, E, Fs}};
    const size_t n = Fs > 0 ? 7 : 4;
    if (Fs == 0 && (m->shared_gate.data != NULL || m->shared_up.data != NULL || m->shared_down.data != NULL))
        return KVREF_ERR_VALUE;
    int status = KVREF_OK;
    for (size_t i = 0; status == KVREF_OK && i < n; i++)
        status = kvref_check_projection(expect[i].t, expect[i].rows, expect[i].cols);
    return status;
}

int kvref_moe_packed_all(const kvref_layer_desc *lw) {
    const kvref_moe_layer *m = lw->moe;
    const kvref_tensor *ts[] = {&m->router, &m->gate, &m->up, &m->down, &m->shared_gate, &m->shared_up,
                                &m->shared_down};
    int all = 1;
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
        all &= ts[i]->data == NULL || !kvref_packable(ts[i]->type) || ts[i]->packed != NULL;
    return all;
}

void kvref_moe_state_destroy(kvref_moe_state *s) {
    if (s == NULL) return;
    void *bufs[] = {s->logits, s->experts, s->weights, s->route, s->ids, s->first, s->placed, s->order, s->slot,
                    s->xs, s->gate, s->up, s->y};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) kvref_aligned_free(bufs[i]);
    free(s);
}

/* n items of `size` bytes, 64-byte aligned (released with kvref_aligned_free) */
static void *alloc64(int64_t n, size_t size) { return kvref_aligned_alloc((size_t)n * size); }

int kvref_moe_reserve(kvref_moe_state **ps, const kvref_model_desc *c, int64_t T) {
    if (c->router.n_experts == 0 || (*ps != NULL && (*ps)->rows >= T)) return KVREF_OK;
    const int64_t rows = *ps != NULL && 2 * (*ps)->rows > T ? 2 * (*ps)->rows : T;
    const int64_t X = c->router.n_experts, k = c->router.n_used, G = c->router.n_groups, E = c->d_model;
    const int64_t R = rows * k, F = c->expert_d_ff > c->shared_d_ff ? c->expert_d_ff : c->shared_d_ff;
    kvref_moe_state *s = calloc(1, sizeof *s);
    if (s == NULL) return KVREF_ERR_NOMEM;
    s->rows = rows;
    s->logits = alloc64(rows * X, sizeof(float));
    s->experts = alloc64(R, sizeof(int64_t));
    s->weights = alloc64(R, sizeof(float));
    s->route = alloc64(2 * X + G, sizeof(float));
    s->ids = alloc64(G, sizeof(int64_t));
    s->first = alloc64(X + 1, sizeof(int64_t));
    s->placed = alloc64(X, sizeof(int64_t));
    s->order = alloc64(R, sizeof(int64_t));
    s->slot = alloc64(R, sizeof(int64_t));
    s->xs = alloc64(R * E, sizeof(float));
    s->gate = alloc64(R * F, sizeof(float));
    s->up = alloc64(R * F, sizeof(float));
    s->y = alloc64(rows * E, sizeof(float));
    if (!s->logits || !s->experts || !s->weights || !s->route || !s->ids || !s->first || !s->placed || !s->order ||
        !s->slot || !s->xs || !s->gate || !s->up || !s->y) {
        kvref_moe_state_destroy(s);
        return KVREF_ERR_NOMEM;
    }
    kvref_moe_state_destroy(*ps);
    *ps = s;
    return KVREF_OK;
}
