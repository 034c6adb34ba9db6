/* matmul.c: projections on weights in their file format, and embedding lookup.
 *
 * Two strategies, chosen by shape only (never by thread count, so results do not depend on it):
 *   - few rows of x (decode, batched decode): each weight row is read and decoded in registers
 *     once for all rows of x and dotted with each (vec_dot_rows), every row of x getting exactly its
 *     single-row result (vec_dot);
 *   - many rows of x (prefill): a tile of KVREF_TILE_N weight rows is dequantized into the
 *     thread's scratch (bit-identical to the NumPy dequantizer), stored transposed, and multiplied
 *     against every row of x with a float32 GEMM kernel, so each weight block is decoded once per
 *     call.
 * Both split the N output rows into fixed units, so each y[t, n] is computed by the same
 * operations whichever thread, and however many threads, run the unit.
 */
#include <stdlib.h>

#include "internal.h"

#define KVREF_VEC_UNIT_MIN 16  /* at least this many weight rows per unit on the vec_dot path */
#define KVREF_VEC_UNITS_PER_THREAD 2 /* long runs of rows keep the hardware prefetcher streaming
                                       (SmolLM2 decode, 2 threads: 4 units a thread ~8% slower in
                                       both modes, 1 as fast as 2 with wider swings); two still let
                                       a busy thread's share move */
#ifndef KVREF_PREFETCH_ROWS
#define KVREF_PREFETCH_ROWS 4  /* vec_dot path: software prefetch distance, in weight rows */
#endif

/* decode streams each weight once from DRAM: ask for a row a few rows ahead, so the prefetcher's
 * ramp-up at the start of every unit does not stall the dot products */
static inline void prefetch_row(const uint8_t *w, int64_t n, int64_t n1, int64_t rb) {
    if (KVREF_PREFETCH_ROWS > 0 && n + KVREF_PREFETCH_ROWS < n1) {
        const uint8_t *ahead = w + (n + KVREF_PREFETCH_ROWS) * rb;
        for (int64_t b = 0; b < rb; b += 64) KVREF_PREFETCH(ahead + b, 0);
    }
}

/* rows per vec_dot unit for `rows` rows in all, whole packed groups (internal.h): units only
 * schedule rows, each y[t, n] is the same dot product whatever the unit size */
static int64_t vec_unit_rows(kvref_pool *pool, int64_t rows) {
    const int64_t parts = kvref_pool_threads(pool) * KVREF_VEC_UNITS_PER_THREAD;
    const int64_t per_unit = (rows + parts - 1) / parts;
    _Static_assert(KVREF_VEC_UNIT_MIN % KVREF_PACK_ROWS == 0, "units of whole groups");
    return per_unit < KVREF_VEC_UNIT_MIN ? KVREF_VEC_UNIT_MIN : (per_unit + KVREF_PACK_ROWS - 1) / KVREF_PACK_ROWS * KVREF_PACK_ROWS;
}

typedef struct {
    const kvref_kernels *kk;
    kvref_pool *pool;
    const float *x;            /* [T, K] */
    const uint8_t *w;          /* [N, rb] */
    int32_t type;
    int64_t T, K, N, rb;
    float *y;                  /* [T, N] */
} mm_ctx;

/* The tile is k-major, tile[k, i] = W[n0 + i, k]: the GEMM kernels' inner step multiplies one x
 * value by a contiguous row of KVREF_TILE_N weights (outer products, no horizontal sums). Sixteen
 * rows at a time are dequantized into a staging buffer, then transposed into their columns in
 * 16 x 16 blocks (a column at a time would touch a cache line per value). Rows past the last
 * weight row are zero, so the kernels' full vectors stay finite. */
static void mm_tile_unit(void *vctx, int64_t unit, int thread) {
    const mm_ctx *c = vctx;
    const int64_t K = c->K, n0 = unit * KVREF_TILE_N;
    const int64_t nw = n0 + KVREF_TILE_N < c->N ? KVREF_TILE_N : c->N - n0;
    float *tile = kvref_pool_scratch(c->pool, thread); /* [K, KVREF_TILE_N] */
    float *rows = tile + K * KVREF_TILE_N;             /* [16, K] */
    for (int64_t h = 0; h < KVREF_TILE_N; h += 16) {
        for (int64_t i = 0; i < 16; i++) {
            if (h + i < nw) c->kk->dequant[c->type](K, c->w + (n0 + h + i) * c->rb, rows + i * K);
            else memset(rows + i * K, 0, (size_t)K * sizeof(float));
        }
        c->kk->tile_columns(K, rows, tile + h);
    }
    c->kk->gemm_f32(K, c->x, c->T, tile, nw, c->y + n0, c->N);
}

size_t kvref_matmul_scratch_bytes(int64_t T, int64_t K) {
    if (T < KVREF_GEMM_MIN_T) return 0;
    _Static_assert(KVREF_Q8_TILE_SCRATCH(1) <= (KVREF_TILE_N + 16) * sizeof(float), "an 8-bit tile fits");
    return (size_t)(KVREF_TILE_N + 16) * (size_t)K * sizeof(float); /* the tile, then the staging rows */
}

void kvref_matmul_run(kvref_pool *pool, const float *x, int64_t T, int64_t K, const uint8_t *w,
                      int32_t type, int64_t N, float *y) {
    if (T == 0 || N == 0) return;
    if (K == 0) {
        for (int64_t i = 0; i < T * N; i++) y[i] = 0.0f; /* an empty sum */
        return;
    }
    if (T < KVREF_GEMM_MIN_T) {
        const kvref_mv mv = {x, NULL, NULL, NULL, T, K, 1, {{w, NULL, type, N, y, N}}, 0, NULL};
        kvref_mv_run(pool, &mv);
        return;
    }
    mm_ctx c = {kvref_pool_kernels(pool), pool, x, w, type, T, K, N, kvref_row_nbytes(type, K), y};
    kvref_pool_run(pool, mm_tile_unit, &c, (N + KVREF_TILE_N - 1) / KVREF_TILE_N);
}

static int check_matmul(kvref_pool *pool, const float *x, int64_t T, int64_t K, const void *w,
                        int32_t w_type, int64_t w_nbytes, int64_t N, float *y) {
    if (pool == NULL) return KVREF_ERR_NULL;
    if (T < 0 || K < 0 || N < 0 || w_nbytes < 0) return KVREF_ERR_DIM;
    if (kvref_block_values(w_type) < 0) return KVREF_ERR_TYPE;
    const int64_t rb = kvref_row_nbytes(w_type, K);
    if (rb < 0) return KVREF_ERR_SHAPE;
    if (N > 0 && rb > 0 && N > INT64_MAX / rb) return KVREF_ERR_SIZE;
    if (w_nbytes != N * rb) return KVREF_ERR_SIZE;
    if (T == 0 || N == 0) return KVREF_OK;
    if (K > 0 && (x == NULL || w == NULL)) return KVREF_ERR_NULL;
    if (y == NULL) return KVREF_ERR_NULL;
    return -1; /* checked, and there is work to do */
}

int kvref_matmul(kvref_pool *pool, const float *x, int64_t T, int64_t K, const void *w,
                 int32_t w_type, int64_t w_nbytes, int64_t N, float *y) {
    const int checked = check_matmul(pool, x, T, K, w, w_type, w_nbytes, N, y);
    if (checked >= 0) return checked;
    kvref_pool_lock(pool);
    int status = kvref_pool_reserve(pool, kvref_matmul_scratch_bytes(T, K));
    if (status == KVREF_OK) kvref_matmul_run(pool, x, T, K, (const uint8_t *)w, w_type, N, y);
    kvref_pool_unlock(pool);
    return status;
}

/* ---- a mixture of experts' projection ------------------------------------------------------ */

int64_t kvref_group_by_expert(const int64_t *experts, int64_t R, int64_t X, int64_t *first, int64_t *placed,
                              int64_t *order) {
    for (int64_t r = 0; r < R; r++) first[experts[r] + 1]++;
    int64_t most = 0;
    for (int64_t e = 0; e < X; e++) {
        most = first[e + 1] > most ? first[e + 1] : most;
        first[e + 1] += first[e];
    }
    for (int64_t r = 0; r < R; r++) order[first[experts[r]] + placed[experts[r]]++] = r;
    return most;
}

int kvref_matmul_experts(kvref_pool *pool, const float *x, int64_t R, int64_t K, const int64_t *experts,
                         const void *w, int32_t w_type, int64_t w_nbytes, int64_t X, int64_t N, float *y) {
    if (pool == NULL) return KVREF_ERR_NULL;
    if (R < 0 || K < 0 || N < 0 || X < 0 || w_nbytes < 0) return KVREF_ERR_DIM;
    if (kvref_block_values(w_type) < 0) return KVREF_ERR_TYPE;
    const int64_t rb = kvref_row_nbytes(w_type, K);
    if (rb < 0) return KVREF_ERR_SHAPE;
    if (X > 0 && N > 0 && rb > 0 && (N > INT64_MAX / rb || X > INT64_MAX / (N * rb))) return KVREF_ERR_SIZE;
    const int64_t expert_bytes = N * rb; /* one expert's matrix */
    if (w_nbytes != X * expert_bytes) return KVREF_ERR_SIZE;
    if (R == 0 || N == 0) return KVREF_OK;
    if (experts == NULL || y == NULL || (K > 0 && (x == NULL || w == NULL))) return KVREF_ERR_NULL;
    for (int64_t r = 0; r < R; r++)
        if (experts[r] < 0 || experts[r] >= X) return KVREF_ERR_VALUE;
    if (K == 0) { /* empty sums: nothing of x or w to read */
        for (int64_t i = 0; i < R * N; i++) y[i] = 0.0f;
        return KVREF_OK;
    }
    if ((uint64_t)R > SIZE_MAX / sizeof(float) / (uint64_t)(K + N + 2)) return KVREF_ERR_SIZE;
    int64_t *first = calloc((size_t)X + 1, sizeof(int64_t));
    int64_t *placed = calloc((size_t)X, sizeof(int64_t));
    int64_t *order = malloc((size_t)R * sizeof(int64_t));
    float *xs = malloc((size_t)R * (size_t)K * sizeof(float)); /* [R, K]: x's rows, grouped by expert */
    float *ys = malloc((size_t)R * (size_t)N * sizeof(float)); /* [R, N]: their outputs, in the same order */
    int status = first && placed && order && xs && ys ? KVREF_OK : KVREF_ERR_NOMEM;
    if (status == KVREF_OK) {
        const int64_t most = kvref_group_by_expert(experts, R, X, first, placed, order);
        for (int64_t slot = 0; slot < R; slot++) memcpy(xs + slot * K, x + order[slot] * K, (size_t)K * sizeof(float));
        kvref_pool_lock(pool);
        status = kvref_pool_reserve(pool, kvref_matmul_scratch_bytes(most, K));
        for (int64_t e = 0; status == KVREF_OK && e < X; e++) { /* each expert's weights stream once */
            const int64_t n = first[e + 1] - first[e];
            if (n > 0)
                kvref_matmul_run(pool, xs + first[e] * K, n, K, (const uint8_t *)w + e * expert_bytes, w_type, N,
                                 ys + first[e] * N);
        }
        kvref_pool_unlock(pool);
    }
    if (status == KVREF_OK)
        for (int64_t slot = 0; slot < R; slot++) memcpy(y + order[slot] * N, ys + slot * N, (size_t)N * sizeof(float));
    free(first);
    free(placed);
    free(order);
    free(xs);
    free(ys);
    return status;
}

/* ---- 8-bit activations ------------------------------------------------------------------- */

typedef struct {
    const kvref_kernels *kk;
    kvref_pool *pool;
    const uint8_t *xu;         /* [T, K]: x's 8-bit values + 128 */
    const float *xds;          /* [T, K/32, 2] */
    const uint8_t *w;          /* [N, rb] */
    int32_t type;
    int64_t T, K, N, rb;
    float *y;                  /* [T, N] */
} q8_ctx;

/* nw <= KVREF_TILE_N rows of w (rb bytes each) -> an 8-bit tile (internal.h), rows nw.. zero */
void kvref_q8_tile_ref(int32_t type, int64_t K, const uint8_t *w, int64_t rb, int64_t nw, uint8_t *tile) {
    const int64_t bv = kvref_q8_tile_values(type);
    for (int64_t n = 0; n < KVREF_TILE_N; n++)
        for (int64_t b = 0; b < K / bv; b++) {
            uint8_t *rec = tile + b * KVREF_Q8_TILE_RECORD(bv);
            int8_t q[32] = {0};
            float d = 0.0f, m = 0.0f;
            if (n < nw) kvref_q8_weight_block(type, w + n * rb, b, q, &d, &m);
            int32_t sum = 0;
            for (int j = 0; j < bv; j++) sum += q[j];
            const int32_t zero = -128 * sum;
            for (int s = 0; s < bv / 4; s++) memcpy(rec + s * 4 * KVREF_TILE_N + 4 * n, q + 4 * s, 4);
            memcpy(rec + KVREF_Q8_TILE_ZERO(bv) + 4 * n, &zero, 4);
            memcpy(rec + KVREF_Q8_TILE_D(bv) + 4 * n, &d, 4);
            memcpy(rec + KVREF_Q8_TILE_M(bv) + 4 * n, &m, 4);
        }
}

static void mm_q8_tile_unit(void *vctx, int64_t unit, int thread) {
    const q8_ctx *c = vctx;
    const int64_t n0 = unit * KVREF_TILE_N;
    const int64_t nw = n0 + KVREF_TILE_N < c->N ? KVREF_TILE_N : c->N - n0;
    uint8_t *tile = kvref_pool_scratch(c->pool, thread); /* KVREF_Q8_TILE_SCRATCH: less than a float tile */
    if (c->kk->q8_tile != NULL && kvref_q8_tile_values(c->type) == 32) c->kk->q8_tile(c->type, c->K, c->w + n0 * c->rb, c->rb, nw, tile);
    else kvref_q8_tile_ref(c->type, c->K, c->w + n0 * c->rb, c->rb, nw, tile);
    const int affine = c->type == KVREF_TYPE_Q4_1 || c->type == KVREF_TYPE_Q4_K;
    c->kk->gemm_q8(c->K, c->xu, c->xds, c->T, tile, kvref_q8_tile_values(c->type), nw, affine, c->y + n0, c->N);
}

#define Q8_ROWS_PER_UNIT 16     /* rows of x a thread rounds to 8 bits at a time */

typedef struct {
    const kvref_kernels *kk;
    const float *x;            /* [T, K] */
    int64_t T, K;
    int8_t *qs;                /* [T, K] */
    float *ds;                 /* [T, K/32, 2] */
    int32_t *xsum;             /* [T, K/16], or NULL: q stored + 128 for the GEMM */
} quantize_ctx;

void kvref_block_sums(int64_t K, const int8_t *qs, int32_t *xsum) {
    for (int64_t h = 0; h < K / 16; h++) {
        int32_t sum = 0;
        for (int j = 0; j < 16; j++) sum += qs[16 * h + j];
        xsum[h] = sum;
    }
}

/* rows of x -> 8-bit blocks: with their integer sums for the packed kernels, or stored + 128 as
 * the GEMM reads them */
static void quantize_unit(void *vctx, int64_t unit, int thread) {
    const quantize_ctx *c = vctx;
    (void)thread;
    const int64_t t0 = unit * Q8_ROWS_PER_UNIT, t1 = t0 + Q8_ROWS_PER_UNIT < c->T ? t0 + Q8_ROWS_PER_UNIT : c->T;
    for (int64_t t = t0; t < t1; t++) {
        c->kk->quantize_q8(c->K, c->x + t * c->K, c->qs + t * c->K, c->ds + t * (c->K / 16));
        if (c->xsum != NULL) kvref_block_sums(c->K, c->qs + t * c->K, c->xsum + t * (c->K / 16));
    }
    if (c->xsum != NULL) return;
    uint8_t *xu = (uint8_t *)c->qs;
    for (int64_t i = t0 * c->K; i < t1 * c->K; i++) xu[i] ^= 0x80; /* q + 128 in two's complement */
}

size_t kvref_matmul_int8_shared_bytes(int64_t T, int64_t K) {
    /* qs [T, K] int8, ds [T, K/32, 2] float32 and xsum [T, K/16] int32: 16 bytes per 32 values */
    return (size_t)T * (size_t)K * 2;
}

void kvref_quantize_rows(kvref_pool *pool, const float *x, int64_t T, int64_t K, const int8_t **qs, const float **ds,
                         const int32_t **xsum) {
    int8_t *q = kvref_pool_shared(pool, kvref_matmul_int8_shared_bytes(T, K)); /* reserved: no allocation */
    float *d = (float *)(void *)(q + T * K);
    int32_t *sums = (int32_t *)(void *)(d + T * (K / 16));
    quantize_ctx qc = {kvref_pool_kernels(pool), x, T, K, q, d, sums};
    if (T < Q8_ROWS_PER_UNIT) quantize_unit(&qc, 0, 0); /* decode: not worth a dispatch */
    else kvref_pool_run(pool, quantize_unit, &qc, (T + Q8_ROWS_PER_UNIT - 1) / Q8_ROWS_PER_UNIT);
    *qs = q, *ds = d, *xsum = sums;
}

/* ---- packed weights (internal.h) ------------------------------------------------------------ */

/* row r of a record from a legacy block (Q4_0, Q4_1, Q5_0, Q8_0), byte for byte: a block's nibble
 * byte j is values j and j + 16, which is what the record's nibble vectors hold at 4r + j % 4 of
 * vector j / 4; Q8_0's bytes move with their sign bit flipped (+ 128) */
static void pack_legacy_row(int32_t type, const uint8_t *block, int r, uint8_t *rec) {
    uint8_t *vals = rec + kvref_pack_values_at(type), *planes = rec + kvref_pack_planes_at(type);
    memcpy(rec + 2 * r, block, 2); /* d, and Q4_1's m, stay float16 */
    if (type == KVREF_TYPE_Q8_0) {
        for (int v = 0; v < 8; v++) {
            uint32_t four;
            memcpy(&four, block + 2 + 4 * v, 4);
            four ^= 0x80808080u;
            memcpy(vals + 64 * v + 4 * r, &four, 4);
        }
        return;
    }
    if (type == KVREF_TYPE_Q4_1) memcpy(rec + 32 + 2 * r, block + 2, 2);
    const int at = type == KVREF_TYPE_Q4_0 ? 2 : type == KVREF_TYPE_Q4_1 ? 4 : 6; /* the nibble bytes */
    for (int j = 0; j < 4; j++) memcpy(vals + 64 * j + 4 * r, block + at + 4 * j, 4);
    if (type == KVREF_TYPE_Q5_0) { /* bits 4v .. 4v+3 of qh are bits 4r .. 4r+3 of mask v */
        const uint32_t qh = kvref_q5_high_bits(block);
        for (int v = 0; v < 8; v++) planes[8 * v + r / 2] |= (uint8_t)((qh >> (4 * v) & 15) << (4 * (r % 2)));
    }
}

/* row r of a K-quant's super-block s into its span: the header's fields as in the file, the record's
 * values one by one */
static void pack_kquant_row(int32_t type, const uint8_t *row, int64_t s, int r, uint8_t *span) {
    const uint8_t *w = row + s * (type == KVREF_TYPE_Q4_K ? BYTES_Q4_K : BYTES_Q6_K);
    if (type == KVREF_TYPE_Q4_K) {
        memcpy(span + 2 * r, w, 2);      /* d */
        memcpy(span + 32 + 2 * r, w + 2, 2); /* dmin */
        for (int k = 0; k < 12; k++) span[64 + 16 * k + r] = w[4 + k]; /* the scales and mins' bytes, plane k */
    } else {
        memcpy(span + 2 * r, w + 208, 2); /* d */
        for (int j = 0; j < 16; j++) span[32 + 16 * j + r] = w[192 + j];
    }
    for (int64_t b = 0; b < 8; b++) {
        uint8_t *rec = span + kvref_pack_header_bytes(type) + b * kvref_pack_record_bytes(type);
        uint8_t *vals = rec + kvref_pack_values_at(type), *planes = rec + kvref_pack_planes_at(type);
        int8_t q[32];
        float d, m;
        if (type == KVREF_TYPE_Q4_K) kvref_q8_weight_block(type, row, 8 * s + b, q, &d, &m);
        else for (int h = 0; h < 2; h++) kvref_q8_weight_block(type, row, 16 * s + 2 * b + h, q + 16 * h, &d, &m); /* sub-blocks of 16 */
        for (int k = 0; k < 32; k++) {
            const int v = k / 4, lane = 4 * r + k % 4;
            const uint8_t u = (uint8_t)(q[k] + kvref_pack_bias(type));
            vals[64 * (v % 4) + lane] |= (uint8_t)((u & 15) << (v < 4 ? 0 : 4));
            if (type == KVREF_TYPE_Q6_K) planes[64 * (v / 4) + lane] |= (uint8_t)((u >> 4) << (2 * (v % 4)));
        }
    }
}

void kvref_pack_group(int32_t type, int64_t K, const uint8_t *w, int64_t rb, int64_t nr, uint8_t *group) {
    memset(group, 0, (size_t)kvref_pack_group_bytes(type, K));
    if (kvref_pack_kquant(type)) {
        for (int64_t s = 0; s < K / QK_K; s++)
            for (int r = 0; r < nr; r++) pack_kquant_row(type, w + r * rb, s, r, group + s * kvref_pack_span_bytes(type));
        return;
    }
    for (int64_t b = 0; b < K / 32; b++)
        for (int r = 0; r < nr; r++)
            pack_legacy_row(type, w + r * rb + b * kvref_q8_block_bytes(type), r, (uint8_t *)kvref_pack_record(type, group, b));
}

/* The inverse of pack_legacy_row: block b of row r, as the file stores it */
static void unpack_legacy_row(int32_t type, const uint8_t *rec, int r, uint8_t *block) {
    const uint8_t *vals = rec + kvref_pack_values_at(type), *planes = rec + kvref_pack_planes_at(type);
    memcpy(block, rec + 2 * r, 2);
    if (type == KVREF_TYPE_Q8_0) {
        for (int v = 0; v < 8; v++) {
            uint32_t four;
            memcpy(&four, vals + 64 * v + 4 * r, 4);
            four ^= 0x80808080u;
            memcpy(block + 2 + 4 * v, &four, 4);
        }
        return;
    }
    if (type == KVREF_TYPE_Q4_1) memcpy(block + 2, rec + 32 + 2 * r, 2);
    const int at = type == KVREF_TYPE_Q4_0 ? 2 : type == KVREF_TYPE_Q4_1 ? 4 : 6;
    for (int j = 0; j < 4; j++) memcpy(block + at + 4 * j, vals + 64 * j + 4 * r, 4);
    if (type == KVREF_TYPE_Q5_0) {
        uint32_t qh = 0;
        for (int v = 0; v < 8; v++) qh |= (uint32_t)(planes[8 * v + r / 2] >> (4 * (r % 2)) & 15) << (4 * v);
        memcpy(block + 2, &qh, 4);
    }
}

/* The inverse of pack_kquant_row: super-block s of row r from its span, into the zeroed file row */
static void unpack_kquant_row(int32_t type, const uint8_t *span, int64_t s, int r, uint8_t *row) {
    uint8_t *w = row + s * (type == KVREF_TYPE_Q4_K ? BYTES_Q4_K : BYTES_Q6_K);
    if (type == KVREF_TYPE_Q4_K) {
        memcpy(w, span + 2 * r, 2);
        memcpy(w + 2, span + 32 + 2 * r, 2);
        for (int k = 0; k < 12; k++) w[4 + k] = span[64 + 16 * k + r];
    } else {
        memcpy(w + 208, span + 2 * r, 2);
        for (int j = 0; j < 16; j++) w[192 + j] = span[32 + 16 * j + r];
    }
    for (int64_t b = 0; b < 8; b++) {
        const uint8_t *rec = span + kvref_pack_header_bytes(type) + b * kvref_pack_record_bytes(type);
        const uint8_t *vals = rec + kvref_pack_values_at(type), *planes = rec + kvref_pack_planes_at(type);
        for (int k = 0; k < 32; k++) {
            const int v = k / 4, lane = 4 * r + k % 4;
            int u = vals[64 * (v % 4) + lane] >> (v < 4 ? 0 : 4) & 15;
            if (type == KVREF_TYPE_Q4_K) { /* sub-block b: value k in the nibble 4 (b % 2) of byte k */
                w[16 + 32 * (b / 2) + k] |= (uint8_t)(u << (4 * (b % 2)));
                continue;
            }
            u |= (planes[64 * (v / 4) + lane] >> (2 * (v % 4)) & 3) << 4; /* Q6_K: u = q + 32, 6 bits */
            const int j = (int)(2 * b + k / 16), i = k % 16; /* value i of sub-block j, as kvref_q8_weight_block reads it */
            const int half = j / 8, g = j % 8 / 2, l0 = 16 * (j % 2);
            w[64 * half + 32 * (g % 2) + l0 + i] |= (uint8_t)((u & 15) << (4 * (g / 2)));
            w[128 + 32 * half + l0 + i] |= (uint8_t)((u >> 4) << (2 * g));
        }
    }
}

void kvref_unpack_row(int32_t type, int64_t K, const uint8_t *group, int r, uint8_t *row) {
    if (kvref_pack_kquant(type)) {
        memset(row, 0, (size_t)kvref_row_nbytes(type, K));
        for (int64_t s = 0; s < K / QK_K; s++) unpack_kquant_row(type, group + s * kvref_pack_span_bytes(type), s, r, row);
        return;
    }
    for (int64_t b = 0; b < K / 32; b++)
        unpack_legacy_row(type, kvref_pack_record(type, group, b), r, row + b * kvref_q8_block_bytes(type));
}

int64_t kvref_packed_nbytes(int32_t type, int64_t rows, int64_t cols) {
    if (!kvref_packable(type) || rows < 0 || cols < 0 || kvref_row_nbytes(type, cols) < 0) return 0;
    const int64_t groups = (rows + KVREF_PACK_ROWS - 1) / KVREF_PACK_ROWS, group = kvref_pack_group_bytes(type, cols);
    if (group > 0 && groups > INT64_MAX / group) return 0;
    return groups * group;
}

int kvref_pack_int8(const void *w, int32_t w_type, int64_t w_nbytes, int64_t rows, int64_t cols, void *out,
                    int64_t out_nbytes) {
    if (rows < 0 || cols < 0 || w_nbytes < 0 || out_nbytes < 0) return KVREF_ERR_DIM;
    if (!kvref_packable(w_type)) return KVREF_ERR_TYPE;
    const int64_t rb = kvref_row_nbytes(w_type, cols);
    if (rb < 0) return KVREF_ERR_SHAPE;
    if (rows > 0 && rb > 0 && rows > INT64_MAX / rb) return KVREF_ERR_SIZE;
    if (w_nbytes != rows * rb || out_nbytes != kvref_packed_nbytes(w_type, rows, cols)) return KVREF_ERR_SIZE;
    if (out_nbytes == 0) return KVREF_OK;
    if (w == NULL || out == NULL) return KVREF_ERR_NULL;
    if ((uintptr_t)out % 64 != 0) return KVREF_ERR_VALUE;
    const int64_t gb = kvref_pack_group_bytes(w_type, cols);
    for (int64_t n = 0; n < rows; n += KVREF_PACK_ROWS)
        kvref_pack_group(w_type, cols, (const uint8_t *)w + n * rb, rb, rows - n < KVREF_PACK_ROWS ? rows - n : KVREF_PACK_ROWS,
                         (uint8_t *)out + n / KVREF_PACK_ROWS * gb);
    return KVREF_OK;
}

#define MV_ROWS 8 /* rows of x per multi-row dot call: a batch below either GEMM switch is one call */

/* y[t * ldy + i] (=, or += with accumulate) rows i < nr of a packed group dotted with the T rows
 * of x in 8-bit blocks, MV_ROWS rows of x per kernel call */
static void packed_group_rows(const kvref_kernels *kk, int32_t type, int64_t K, const uint8_t *group,
                              const int8_t *qs, const float *ds, const int32_t *xsum, int64_t T, float *y,
                              int64_t ldy, int64_t nr, int accumulate) {
    float r[MV_ROWS * KVREF_PACK_ROWS];
    for (int64_t t0 = 0; t0 < T; t0 += MV_ROWS) {
        const int64_t nt = T - t0 < MV_ROWS ? T - t0 : MV_ROWS;
        kk->packed_dot(type, K, group, qs + t0 * K, ds + t0 * (K / 16), xsum + t0 * (K / 16), nt, r);
        for (int64_t t = 0; t < nt; t++) {
            float *out = y + (t0 + t) * ldy;
            for (int64_t i = 0; i < nr; i++)
                out[i] = accumulate ? out[i] + r[t * KVREF_PACK_ROWS + i] : r[t * KVREF_PACK_ROWS + i];
        }
    }
}

typedef struct {
    const kvref_kernels *kk;
    kvref_pool *pool;
    const int8_t *qs;          /* [T, K] */
    const float *ds;           /* [T, K/32, 2] */
    const int32_t *xsum;       /* [T, K/16] */
    const uint8_t *w;          /* [N, rb] in the file's layout */
    int32_t type;
    int64_t T, K, N, rb;
    float *y;                  /* [T, N] */
} pack_ctx;

/* one group of 16 weight rows packed into the thread's scratch, then multiplied */
static void packed_unit(void *vctx, int64_t unit, int thread) {
    const pack_ctx *c = vctx;
    const int64_t n0 = unit * KVREF_PACK_ROWS, nr = c->N - n0 < KVREF_PACK_ROWS ? c->N - n0 : KVREF_PACK_ROWS;
    uint8_t *group = kvref_pool_scratch(c->pool, thread);
    kvref_pack_group(c->type, c->K, c->w + n0 * c->rb, c->rb, nr, group);
    packed_group_rows(c->kk, c->type, c->K, group, c->qs, c->ds, c->xsum, c->T, c->y + n0, c->N, nr, 0);
}

size_t kvref_matmul_int8_scratch_bytes(int64_t T, int64_t K) {
    const size_t group = (size_t)kvref_pack_group_bytes(KVREF_TYPE_Q8_0, K); /* the largest groups */
    const size_t tile = kvref_matmul_scratch_bytes(T, K);
    return group > tile ? group : tile;
}

void kvref_matmul_int8_run(kvref_pool *pool, const float *x, int64_t T, int64_t K, const uint8_t *w,
                           int32_t type, int64_t N, float *y) {
    const kvref_kernels *kk = kvref_pool_kernels(pool);
    const int gemm = T >= KVREF_GEMM_Q8_MIN_T && kk->gemm_q8 != NULL && kvref_q8_tile_type(type);
    if (T == 0 || N == 0 || K == 0 || (!gemm && !kvref_packable(type) && T >= KVREF_GEMM_Q8_MIN_T)) {
        kvref_matmul_run(pool, x, T, K, w, type, N, y);
        return;
    }
    if (!gemm && !kvref_packable(type)) { /* a weight without 8-bit kernels below the switch: the fused forward's decode path */
        const kvref_mv mv = {x, NULL, NULL, NULL, T, K, 1, {{w, NULL, type, N, y, N}}, 0, NULL};
        kvref_mv_run(pool, &mv);
        return;
    }
    if (gemm) {
        int8_t *xqs = kvref_pool_shared(pool, kvref_matmul_int8_shared_bytes(T, K)); /* reserved: no allocation */
        float *xds = (float *)(void *)(xqs + T * K);
        quantize_ctx qc = {kk, x, T, K, xqs, xds, NULL};
        kvref_pool_run(pool, quantize_unit, &qc, (T + Q8_ROWS_PER_UNIT - 1) / Q8_ROWS_PER_UNIT);
        q8_ctx c = {kk, pool, (const uint8_t *)xqs, xds, w, type, T, K, N, kvref_row_nbytes(type, K), y};
        kvref_pool_run(pool, mm_q8_tile_unit, &c, (N + KVREF_TILE_N - 1) / KVREF_TILE_N);
        return;
    }
    const int8_t *xqs;
    const float *xds;
    const int32_t *xsum;
    kvref_quantize_rows(pool, x, T, K, &xqs, &xds, &xsum);
    pack_ctx c = {kk, pool, xqs, xds, xsum, w, type, T, K, N, kvref_row_nbytes(type, K), y};
    kvref_pool_run(pool, packed_unit, &c, (N + KVREF_PACK_ROWS - 1) / KVREF_PACK_ROWS);
}

int kvref_matmul_int8(kvref_pool *pool, const float *x, int64_t T, int64_t K, const void *w,
                      int32_t w_type, int64_t w_nbytes, int64_t N, float *y) {
    const int checked = check_matmul(pool, x, T, K, w, w_type, w_nbytes, N, y);
    if (checked >= 0) return checked;
    if (K > 0 && T > INT64_MAX / 2 / K) return KVREF_ERR_DIM;
    kvref_pool_lock(pool);
    int status = kvref_pool_reserve(pool, kvref_matmul_int8_scratch_bytes(T, K));
    if (status == KVREF_OK && kvref_pool_shared(pool, kvref_matmul_int8_shared_bytes(T, K)) == NULL)
        status = KVREF_ERR_NOMEM;
    if (status == KVREF_OK) kvref_matmul_int8_run(pool, x, T, K, (const uint8_t *)w, w_type, N, y);
    kvref_pool_unlock(pool);
    return status;
}

/* ---- several weights sharing one input, decode path --------------------------------------- */

/* out[t * ldo] = the dot of the weight row w with row t of x [T, K]: the multi-row kernel, or (NULL in
 * the table) the single-row kernel per row, which defines it */
static inline void dot_rows(const kvref_kernels *kk, int32_t type, int64_t K, const uint8_t *w, const float *x,
                            int64_t T, float *out, int64_t ldo) {
    if (kk->vec_dot_rows[type] != NULL) kk->vec_dot_rows[type](K, w, x, T, out, ldo);
    else for (int64_t t = 0; t < T; t++) out[t * ldo] = kk->vec_dot[type](K, w, x + t * K);
}

typedef struct {
    const kvref_mv *mv;
    const kvref_kernels *kk;
    int64_t unit_rows;
    int64_t first_unit[4];     /* units of part p are [first_unit[p], first_unit[p + 1]) */
} mv_ctx;

/* y_p[t, n0:n1] (=, or +=) the dot products of rows n0..n1 of part p: each weight row is dotted with
 * up to MV_ROWS rows of x per call, which decodes its blocks once for all of them; a packed part
 * (n0 a multiple of 16) group by group with x in 8-bit blocks */
static void mv_rows(const mv_ctx *c, const kvref_mv_part *p, int64_t n0, int64_t n1) {
    const kvref_mv *mv = c->mv;
    const int64_t rb = kvref_row_nbytes(p->type, mv->K), K = mv->K;
    if (mv->xqs != NULL && p->packed != NULL) { /* a unit's groups are one stream the hardware prefetches */
        const int64_t gb = kvref_pack_group_bytes(p->type, K);
        for (int64_t n = n0; n < n1; n += KVREF_PACK_ROWS) {
            packed_group_rows(c->kk, p->type, K, p->packed + n / KVREF_PACK_ROWS * gb, mv->xqs, mv->xds, mv->xsum,
                              mv->T, p->y + n, p->ldy, n1 - n < KVREF_PACK_ROWS ? n1 - n : KVREF_PACK_ROWS,
                              mv->accumulate);
        }
        return;
    }
    if (mv->T == 1) { /* single-stream decode: the single-row kernel straight into y, no staging (~10 % faster) */
        const kvref_vec_dot_fn dot = c->kk->vec_dot[p->type];
        for (int64_t n = n0; n < n1; n++) {
            prefetch_row(p->w, n, n1, rb);
            const float r = dot(K, p->w + n * rb, mv->x);
            p->y[n] = mv->accumulate ? p->y[n] + r : r;
        }
        return;
    }
    for (int64_t n = n0; n < n1; n++) {
        prefetch_row(p->w, n, n1, rb);
        const uint8_t *w = p->w + n * rb;
        for (int64_t t0 = 0; t0 < mv->T; t0 += MV_ROWS) {
            const int64_t nt = mv->T - t0 < MV_ROWS ? mv->T - t0 : MV_ROWS;
            float r[MV_ROWS]; /* [nt]: the sums to add, with accumulate */
            float *out = mv->accumulate ? r : p->y + t0 * p->ldy + n;
            const int64_t ldo = mv->accumulate ? 1 : p->ldy;
            dot_rows(c->kk, p->type, K, w, mv->x + t0 * K, nt, out, ldo);
            if (mv->accumulate)
                for (int64_t t = 0; t < nt; t++) p->y[(t0 + t) * p->ldy + n] += r[t];
        }
    }
}

static void mv_unit(void *vctx, int64_t unit, int thread) {
    const mv_ctx *c = vctx;
    const kvref_mv *mv = c->mv;
    (void)thread;
    if (mv->glu != NULL) {
        const kvref_mv_part *g = &mv->part[0], *u = &mv->part[1];
        const int64_t n0 = unit * c->unit_rows;
        const int64_t n1 = n0 + c->unit_rows < g->N ? n0 + c->unit_rows : g->N;
        mv_rows(c, g, n0, n1);
        mv_rows(c, u, n0, n1);
        for (int64_t t = 0; t < mv->T; t++)
            mv->glu(n1 - n0, g->y + t * g->ldy + n0, u->y + t * u->ldy + n0, g->y + t * g->ldy + n0);
        return;
    }
    int p = 0;
    while (unit >= c->first_unit[p + 1]) p++;
    const kvref_mv_part *part = &mv->part[p];
    const int64_t n0 = (unit - c->first_unit[p]) * c->unit_rows;
    mv_rows(c, part, n0, n0 + c->unit_rows < part->N ? n0 + c->unit_rows : part->N);
}

void kvref_mv_run(kvref_pool *pool, const kvref_mv *mv) {
    mv_ctx c = {mv, kvref_pool_kernels(pool), 0, {0, 0, 0, 0}};
    if (mv->glu != NULL) {
        c.unit_rows = vec_unit_rows(pool, mv->part[0].N);
        kvref_pool_run(pool, mv_unit, &c, (mv->part[0].N + c.unit_rows - 1) / c.unit_rows);
        return;
    }
    int64_t rows = 0;
    for (int p = 0; p < mv->nparts; p++) rows += mv->part[p].N;
    c.unit_rows = vec_unit_rows(pool, rows);
    for (int p = 0; p < 3; p++) {
        const int64_t n = p < mv->nparts ? (mv->part[p].N + c.unit_rows - 1) / c.unit_rows : 0;
        c.first_unit[p + 1] = c.first_unit[p] + n;
    }
    kvref_pool_run(pool, mv_unit, &c, c.first_unit[3]);
}

/* ---- the read-bandwidth probe ---------------------------------------------------------------- */

typedef struct {
    const kvref_kernels *kk;
    const uint8_t *buf;
    uint64_t *sums;            /* [units] */
} probe_ctx;

static void probe_unit(void *vctx, int64_t unit, int thread) {
    const probe_ctx *c = vctx;
    (void)thread;
    c->sums[unit] = c->kk->read_sum(c->buf + unit * KVREF_PROBE_UNIT, KVREF_PROBE_UNIT);
}

int kvref_read_probe(kvref_pool *pool, const void *buf, int64_t nbytes, uint64_t *checksum) {
    if (pool == NULL || buf == NULL || checksum == NULL) return KVREF_ERR_NULL;
    if (nbytes <= 0 || nbytes % KVREF_PROBE_UNIT != 0) return KVREF_ERR_SIZE;
    if ((uintptr_t)buf % 64 != 0) return KVREF_ERR_VALUE;
    const int64_t units = nbytes / KVREF_PROBE_UNIT;
    uint64_t *sums = malloc((size_t)units * sizeof(uint64_t));
    if (sums == NULL) return KVREF_ERR_NOMEM;
    kvref_pool_lock(pool);
    probe_ctx c = {kvref_pool_kernels(pool), buf, sums};
    kvref_pool_run(pool, probe_unit, &c, units);
    kvref_pool_unlock(pool);
    uint64_t sum = 0;
    for (int64_t u = 0; u < units; u++) sum += sums[u];
    free(sums);
    *checksum = sum;
    return KVREF_OK;
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
