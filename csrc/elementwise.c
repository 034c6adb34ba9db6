/* elementwise.c: RMSNorm, RoPE, SwiGLU, GeGLU, gpt-oss's clamped SwiGLU and the soft cap.
 *
 * Each output element depends only on its own row (RMSNorm, RoPE) or its own index (SwiGLU), so
 * large calls are split over rows/ranges and every element is computed identically whichever
 * thread runs it. A decode step's calls are one unit and run on the calling thread.
 */
#include <math.h>

#include "internal.h"

#define KVREF_NORM_UNIT_ROWS 16
#define KVREF_GLU_UNIT 16384

/* ---- RMSNorm ------------------------------------------------------------------------------ */

typedef struct {
    const float *x, *weight;   /* [T, E], [E] */
    double eps;
    int64_t T, E;
    float *out;                /* [T, E] */
} norm_ctx;

void kvref_rms_norm_row(const float *x, int64_t E, const float *weight, double eps, float *out) {
    /* double: no overflow, and a sum of E squares exact to ~1e-16 relative. Eight partial sums, not
     * one chain: a chain waits on the add latency at every element, which made the norms of a
     * Gemma 3 prefill (four per layer, and QK-norm per head) several percent of it */
    double part[8] = {0.0};
    int64_t i = 0;
    for (; i + 8 <= E; i += 8)
        for (int j = 0; j < 8; j++) part[j] += (double)x[i + j] * (double)x[i + j];
    for (; i < E; i++) part[0] += (double)x[i] * (double)x[i];
    const double ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    const double r = 1.0 / sqrt(ss / (double)E + eps);
    for (i = 0; i < E; i++) out[i] = (float)((double)x[i] * r) * weight[i];
}

static void norm_task(void *vctx, int64_t unit, int thread) {
    const norm_ctx *c = vctx;
    (void)thread;
    const int64_t t0 = unit * KVREF_NORM_UNIT_ROWS;
    const int64_t t1 = t0 + KVREF_NORM_UNIT_ROWS < c->T ? t0 + KVREF_NORM_UNIT_ROWS : c->T;
    for (int64_t t = t0; t < t1; t++) kvref_rms_norm_row(c->x + t * c->E, c->E, c->weight, c->eps, c->out + t * c->E);
}

int kvref_rms_norm(kvref_pool *pool, const float *x, int64_t T, int64_t E, const float *weight,
                   double eps, float *out) {
    if (pool == NULL) return KVREF_ERR_NULL;
    if (T < 0 || E < 0) return KVREF_ERR_DIM;
    if (!(eps >= 0.0) || isinf(eps)) return KVREF_ERR_VALUE;
    if (T == 0 || E == 0) return KVREF_OK;
    if (x == NULL || weight == NULL || out == NULL) return KVREF_ERR_NULL;
    norm_ctx c = {x, weight, eps, T, E, out};
    kvref_pool_lock(pool);
    kvref_pool_run(pool, norm_task, &c, (T + KVREF_NORM_UNIT_ROWS - 1) / KVREF_NORM_UNIT_ROWS);
    kvref_pool_unlock(pool);
    return KVREF_OK;
}

/* ---- RoPE --------------------------------------------------------------------------------- */

typedef struct {
    kvref_pool *pool;
    const float *x;            /* [T, nh, D] */
    const int64_t *positions;  /* [T] */
    const double *inv_freq;    /* [D/2]: pair i turns by position * inv_freq[i] */
    int64_t T, nh, D;
    float *out;                /* [T, nh, D] */
} rope_ctx;

void kvref_rope_cos_sin(int64_t D, const double *inv_freq, int64_t position, double *cs) {
    const int64_t half = D / 2;
    const double p = (double)position;
    for (int64_t i = 0; i < half; i++) {
        const double angle = p * inv_freq[i];
        cs[i] = cos(angle);
        cs[half + i] = sin(angle);
    }
}

void kvref_rope_row(const float *x, int64_t nh, int64_t D, const double *cs, float *out) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < nh; h++) {
        const float *xh = x + h * D;
        float *o = out + h * D;
        for (int64_t i = 0; i < half; i++) {
            const double even = xh[2 * i], odd = xh[2 * i + 1];
            o[2 * i] = (float)(even * cs[i] - odd * cs[half + i]);
            o[2 * i + 1] = (float)(even * cs[half + i] + odd * cs[i]);
        }
    }
}

static void rope_task(void *vctx, int64_t t, int thread) {
    const rope_ctx *c = vctx;
    double *cs = kvref_pool_scratch(c->pool, thread); /* [D/2] cos, then [D/2] sin */
    kvref_rope_cos_sin(c->D, c->inv_freq, c->positions[t], cs);
    kvref_rope_row(c->x + t * c->nh * c->D, c->nh, c->D, cs, c->out + t * c->nh * c->D);
}

int kvref_rope(kvref_pool *pool, const float *x, int64_t T, int64_t nh, int64_t D,
               const int64_t *positions, const double *inv_freq, float *out) {
    if (pool == NULL) return KVREF_ERR_NULL;
    if (T < 0 || nh < 0 || D < 0) return KVREF_ERR_DIM;
    if (D % 2 != 0) return KVREF_ERR_SHAPE;
    if (T == 0 || nh == 0 || D == 0) return KVREF_OK;
    if (x == NULL || positions == NULL || inv_freq == NULL || out == NULL) return KVREF_ERR_NULL;
    for (int64_t i = 0; i < D / 2; i++)
        if (!isfinite(inv_freq[i])) return KVREF_ERR_VALUE;
    kvref_pool_lock(pool);
    const int status = kvref_pool_reserve(pool, (size_t)D * sizeof(double));
    if (status == KVREF_OK) {
        rope_ctx c = {pool, x, positions, inv_freq, T, nh, D, out};
        kvref_pool_run(pool, rope_task, &c, T);
    }
    kvref_pool_unlock(pool);
    return status;
}

/* ---- SwiGLU and GeGLU ---------------------------------------------------------------------- */

typedef struct {
    kvref_glu_fn glu;          /* the kernel table's swiglu, geglu or swiglu_oai */
    const float *gate, *up;    /* [n] */
    int64_t n;
    float *out;                /* [n] */
} glu_ctx;

static void glu_task(void *vctx, int64_t unit, int thread) {
    const glu_ctx *c = vctx;
    (void)thread;
    const int64_t i0 = unit * KVREF_GLU_UNIT;
    const int64_t n = i0 + KVREF_GLU_UNIT < c->n ? KVREF_GLU_UNIT : c->n - i0;
    c->glu(n, c->gate + i0, c->up + i0, c->out + i0);
}

static int glu(kvref_pool *pool, int32_t gate_kind, const float *gate, const float *up, int64_t n, float *out) {
    if (pool == NULL) return KVREF_ERR_NULL;
    if (n < 0) return KVREF_ERR_DIM;
    if (n == 0) return KVREF_OK;
    if (gate == NULL || up == NULL || out == NULL) return KVREF_ERR_NULL;
    kvref_pool_lock(pool);
    const kvref_kernels *kk = kvref_pool_kernels(pool);
    glu_ctx c = {kvref_gate_fn(kk, gate_kind), gate, up, n, out};
    kvref_pool_run(pool, glu_task, &c, (n + KVREF_GLU_UNIT - 1) / KVREF_GLU_UNIT);
    kvref_pool_unlock(pool);
    return KVREF_OK;
}

int kvref_swiglu(kvref_pool *pool, const float *gate, const float *up, int64_t n, float *out) {
    return glu(pool, KVREF_GATE_SILU, gate, up, n, out);
}

int kvref_geglu(kvref_pool *pool, const float *gate, const float *up, int64_t n, float *out) {
    return glu(pool, KVREF_GATE_GELU_TANH, gate, up, n, out);
}

int kvref_swiglu_oai(kvref_pool *pool, const float *gate, const float *up, int64_t n, float *out) {
    return glu(pool, KVREF_GATE_SWIGLU_OAI, gate, up, n, out);
}

/* ---- soft cap ------------------------------------------------------------------------------ */

typedef struct {
    const float *x;            /* [n] */
    int64_t n;
    float cap;
    float *out;                /* [n] */
} cap_ctx;

static void cap_task(void *vctx, int64_t unit, int thread) {
    const cap_ctx *c = vctx;
    (void)thread;
    const int64_t i0 = unit * KVREF_GLU_UNIT, i1 = i0 + KVREF_GLU_UNIT < c->n ? i0 + KVREF_GLU_UNIT : c->n;
    for (int64_t i = i0; i < i1; i++) c->out[i] = kvref_soft_cap_value(c->x[i], c->cap);
}

void kvref_soft_cap_run(kvref_pool *pool, const float *x, int64_t n, float cap, float *out) {
    cap_ctx c = {x, n, cap, out};
    if (n <= KVREF_GLU_UNIT) cap_task(&c, 0, 0); /* one unit (a decode step's logits): the calling thread */
    else kvref_pool_run(pool, cap_task, &c, (n + KVREF_GLU_UNIT - 1) / KVREF_GLU_UNIT);
}

int kvref_soft_cap(kvref_pool *pool, const float *x, int64_t n, float cap, float *out) {
    if (pool == NULL) return KVREF_ERR_NULL;
    if (n < 0) return KVREF_ERR_DIM;
    if (!(cap > 0.0f) || isinf(cap)) return KVREF_ERR_VALUE;
    if (n == 0) return KVREF_OK;
    if (x == NULL || out == NULL) return KVREF_ERR_NULL;
    kvref_pool_lock(pool);
    kvref_soft_cap_run(pool, x, n, cap, out);
    kvref_pool_unlock(pool);
    return KVREF_OK;
}
