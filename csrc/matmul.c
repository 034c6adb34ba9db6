/* matmul.c: projections on weights in their file format, and embedding lookup.
 *
 * Two strategies, chosen by shape only (never by thread count, so results do not depend on it):
 *   - few rows of x (decode): each weight row is read once per x row and dotted in registers,
 *     straight from its blocks (vec_dot);
 *   - many rows of x (prefill): a tile of KVREF_TILE_N weight rows is dequantized into the
 *     thread's scratch (bit-identical to the NumPy dequantizer) and multiplied against every row
 *     of x with a float32 GEMM kernel, so each weight block is decoded once per call.
 * Both split the N output rows into fixed units, so each y[t, n] is computed by the same
 * operations whichever thread, and however many threads, run the unit.
 */
#include "internal.h"

#define KVREF_GEMM_MIN_T 4     /* from this many x rows on, dequantize tiles and use the GEMM */
#define KVREF_VEC_UNIT_MIN 16  /* at least this many weight rows per unit on the vec_dot path */
#define KVREF_VEC_UNITS_PER_THREAD 4 /* long runs of rows keep the hardware prefetcher streaming;
                                       several per thread still let a busy thread's share move */
#ifndef KVREF_PREFETCH_ROWS
#define KVREF_PREFETCH_ROWS 4  /* vec_dot path: software prefetch distance, in weight rows */
#endif
#define KVREF_TILE_N 32        /* weight rows per unit (one dequantized tile) on the GEMM path */

typedef struct {
    const kvref_kernels *kk;
    kvref_pool *pool;
    const float *x;            /* [T, K] */
    const uint8_t *w;          /* [N, rb] */
    int32_t type;
    int64_t T, K, N, rb;
    int64_t unit_rows;         /* vec_dot path: rows per unit */
    float *y;                  /* [T, N] */
} mm_ctx;

static void mm_vec_unit(void *vctx, int64_t unit, int thread) {
    const mm_ctx *c = vctx;
    (void)thread;
    const kvref_vec_dot_fn dot = c->kk->vec_dot[c->type];
    const int64_t n0 = unit * c->unit_rows;
    const int64_t n1 = n0 + c->unit_rows < c->N ? n0 + c->unit_rows : c->N;
    for (int64_t n = n0; n < n1; n++) {
        /* decode streams each weight once from DRAM: ask for a row a few rows ahead, so the
         * prefetcher's ramp-up at the start of every unit does not stall the dot products */
        if (KVREF_PREFETCH_ROWS > 0 && n + KVREF_PREFETCH_ROWS < n1) {
            const uint8_t *ahead = c->w + (n + KVREF_PREFETCH_ROWS) * c->rb;
            for (int64_t b = 0; b < c->rb; b += 64) __builtin_prefetch(ahead + b, 0, 0);
        }
        for (int64_t t = 0; t < c->T; t++) c->y[t * c->N + n] = dot(c->K, c->w + n * c->rb, c->x + t * c->K);
    }
}

static void mm_tile_unit(void *vctx, int64_t unit, int thread) {
    const mm_ctx *c = vctx;
    const int64_t n0 = unit * KVREF_TILE_N;
    const int64_t nw = n0 + KVREF_TILE_N < c->N ? KVREF_TILE_N : c->N - n0;
    const float *tile;
    if (c->type == KVREF_TYPE_F32 && ((uintptr_t)c->w & 3) == 0) {
        tile = (const float *)(const void *)(c->w + n0 * c->rb); /* already aligned float32 rows */
    } else {
        float *buf = kvref_pool_scratch(c->pool, thread); /* [KVREF_TILE_N, K] */
        for (int64_t i = 0; i < nw; i++) c->kk->dequant[c->type](c->K, c->w + (n0 + i) * c->rb, buf + i * c->K);
        tile = buf;
    }
    c->kk->gemm_f32(c->K, c->x, c->T, tile, nw, c->y + n0, c->N);
}

int kvref_matmul(kvref_pool *pool, const float *x, int64_t T, int64_t K, const void *w,
                 int32_t w_type, int64_t w_nbytes, int64_t N, float *y) {
    if (pool == NULL) return KVREF_ERR_NULL;
    if (T < 0 || K < 0 || N < 0 || w_nbytes < 0) return KVREF_ERR_DIM;
    if (kvref_block_values(w_type) < 0) return KVREF_ERR_TYPE;
    const int64_t rb = kvref_row_nbytes(w_type, K);
    if (rb < 0) return KVREF_ERR_SHAPE;
    if (N > 0 && rb > 0 && N > INT64_MAX / rb) return KVREF_ERR_SIZE;
    if (w_nbytes != N * rb) return KVREF_ERR_SIZE;
    if (T == 0 || N == 0) return KVREF_OK;
    if (K == 0) {
        for (int64_t i = 0; i < T * N; i++) y[i] = 0.0f; /* an empty sum */
        return KVREF_OK;
    }
    if (x == NULL || w == NULL || y == NULL) return KVREF_ERR_NULL;

    kvref_pool_lock(pool);
    /* units only schedule rows: each y[t, n] is the same dot product whatever the unit size */
    const int64_t per_unit = (N + kvref_pool_threads(pool) * KVREF_VEC_UNITS_PER_THREAD - 1) /
                             (kvref_pool_threads(pool) * KVREF_VEC_UNITS_PER_THREAD);
    const int64_t unit_rows = per_unit < KVREF_VEC_UNIT_MIN ? KVREF_VEC_UNIT_MIN : per_unit;
    mm_ctx c = {kvref_pool_kernels(pool), pool, x, (const uint8_t *)w, w_type, T, K, N, rb, unit_rows, y};
    int status = KVREF_OK;
    if (T < KVREF_GEMM_MIN_T) {
        kvref_pool_run(pool, mm_vec_unit, &c, (N + unit_rows - 1) / unit_rows);
    } else {
        if (w_type != KVREF_TYPE_F32 || ((uintptr_t)w & 3) != 0) status = kvref_pool_reserve(pool, (size_t)KVREF_TILE_N * (size_t)K * sizeof(float));
        if (status == KVREF_OK) kvref_pool_run(pool, mm_tile_unit, &c, (N + KVREF_TILE_N - 1) / KVREF_TILE_N);
    }
    kvref_pool_unlock(pool);
    return status;
}

int kvref_embed(kvref_pool *pool, const void *table, int32_t type, int64_t table_nbytes, int64_t V,
                int64_t E, const int64_t *ids, int64_t T, float *out) {
    if (pool == NULL) return KVREF_ERR_NULL;
    if (V < 0 || E < 0 || T < 0 || table_nbytes < 0) return KVREF_ERR_DIM;
    if (kvref_block_values(type) < 0) return KVREF_ERR_TYPE;
    const int64_t rb = kvref_row_nbytes(type, E);
    if (rb < 0) return KVREF_ERR_SHAPE;
    if (V > 0 && rb > 0 && V > INT64_MAX / rb) return KVREF_ERR_SIZE;
    if (table_nbytes != V * rb) return KVREF_ERR_SIZE;
    if (T == 0 || E == 0) return KVREF_OK;
    if (table == NULL || ids == NULL || out == NULL) return KVREF_ERR_NULL;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= V) return KVREF_ERR_VALUE;
    /* the scalar dequantizers define the values; a row is E values, so SIMD would not pay */
    for (int64_t t = 0; t < T; t++) kvref_dequant_row(type, E, (const uint8_t *)table + ids[t] * rb, out + t * E);
    return KVREF_OK;
}
