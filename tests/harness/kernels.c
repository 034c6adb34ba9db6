/* kernels.c: every kernel table this CPU and build can run, entry by entry, against the scalar table,
 * and the thread pool through the public API (kvref.h). A plain C program linked with the csrc
 * sources, so it runs where Python cannot: an aarch64 build under qemu-aarch64, a Windows build under
 * wine (tests/harness/build.py builds it, tests/test_harness.py runs it).
 *
 * The tables are found through the pool (kvref_pool_create(1, isa) for every isa id until the pool
 * refuses the id as out of range), so a new instruction set's table is checked as soon as the pool
 * dispatches to it; ISA_NAMES only gives it a name in the report. The scalar table is the reference:
 * only its pool is checked.
 *
 * Bounds are those of tests/test_native.py and the kernel comments of csrc/internal.h: bit for bit where
 * they say every table computes the same bits (dequant, vec_dot_rows against the table's own vec_dot,
 * tile_columns, the I8 score, packed_dot, quantize_q8, gemm_q8, q8_tile, read_sum, to_fp16), else the
 * float32 rounding bound of the two orders of operations. u, gamma(n) and UNDERFLOW_SLACK are
 * kvref/tolerance.py's. The inputs come from a seeded generator: a run repeats itself.
 *
 * One line per (table, kernel, type): "ok", "FAIL" with the first mismatch, or "--" for what is not
 * there to check; the exit status is 1 if any line failed. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static const char *const ISA_NAMES[] = {"scalar", "avx2", "avx512", "neon", "neon_dotprod", "neon_i8mm"}; /* by kvref_isa id */
#define ISA_NAME_COUNT ((int)(sizeof ISA_NAMES / sizeof ISA_NAMES[0]))

/* ---- bounds (kvref/tolerance.py) ------------------------------------------------------------- */

#define U (1.0 / 16777216.0)          /* FLOAT32_UNIT_ROUNDOFF, 2**-24 */
#define UNDERFLOW_SLACK 1e-37

/* the relative error of any n-term float32 sum or dot product, in any order, with or without FMA */
static double gamma_n(double n) { return n * U / (1 - n * U); }

/* ---- seeded inputs ----------------------------------------------------------------------------- */

static uint64_t rng_state;

static uint64_t rnd_u64(void) { /* splitmix64 */
    uint64_t z = (rng_state += UINT64_C(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}
static double rnd_uniform(void) { return (double)(rnd_u64() >> 11) * (1.0 / 9007199254740992.0); } /* [0, 1) */
static int64_t rnd_below(int64_t n) { return (int64_t)(rnd_u64() % (uint64_t)n); }
static float rnd_normal(void) { /* Box-Muller */
    const double r = sqrt(-2.0 * log(1.0 - rnd_uniform())), t = 6.283185307179586 * rnd_uniform();
    return (float)(r * cos(t));
}
static void fill_normal(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = scale * rnd_normal();
}

/* All buffers come from one arena, 64-byte aligned, released all at once after each check. */
#define ARENA_BYTES (24u << 20)
static unsigned char *arena;
static size_t arena_used;

static void *take(size_t nbytes) {
    arena_used = (arena_used + 63) & ~(size_t)63;
    if (arena_used + nbytes > ARENA_BYTES) {
        fprintf(stderr, "harness: arena exhausted (%zu bytes asked)\n", nbytes);
        exit(2);
    }
    void *p = arena + arena_used;
    arena_used += nbytes;
    return p;
}
static float *take_floats(int64_t n) { return take((size_t)n * sizeof(float)); }

/* a float16 scale field, as tests/test_native.py's f16_fields: mostly realistic magnitudes, plus
 * zeros, subnormals and large values, so every conversion path is exercised */
static uint16_t random_f16_field(void) {
    const int64_t kind = rnd_below(10);
    const double v = 2 * rnd_uniform() - 1;
    if (kind == 0) return 0;
    if (kind == 1) return kvref_fp32_to_fp16((float)(v * ldexp(1, -16)));
    if (kind == 2) return kvref_fp32_to_fp16((float)(300 * v));
    return kvref_fp32_to_fp16((float)(v * ldexp(1, -(int)rnd_below(11))));
}

/* N random rows of K values of a weight type into w [N, kvref_row_nbytes(type, K)]: random bytes with
 * valid scale fields (every bit pattern of the quantized fields), float rows of normals */
static void random_weight(int32_t type, int64_t N, int64_t K, uint8_t *w) {
    const int64_t rb = kvref_row_nbytes(type, K), bv = kvref_block_values(type);
    if (bv == 1) {
        for (int64_t i = 0; i < N * K; i++) {
            const float f = rnd_normal();
            const uint32_t bits = kvref_bits_from_fp32(f);
            if (type == KVREF_TYPE_F32) memcpy(w + 4 * i, &f, 4);
            else {
                const uint16_t h = type == KVREF_TYPE_F16 ? kvref_fp32_to_fp16(f) : (uint16_t)(bits >> 16);
                memcpy(w + 2 * i, &h, 2);
            }
        }
        return;
    }
    for (int64_t i = 0; i < N * rb; i++) w[i] = (uint8_t)rnd_u64();
    const int64_t bb = rb / (K / bv), nb = N * (K / bv);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *block = w + b * bb;
        uint16_t f[2] = {random_f16_field(), random_f16_field()};
        switch (type) {
        case KVREF_TYPE_Q4_1: case KVREF_TYPE_Q4_K: memcpy(block, f, 4); break;
        case KVREF_TYPE_Q6_K: memcpy(block + 208, f, 2); break;
        case KVREF_TYPE_MXFP4: /* E8M0 scales 2**-16 .. 2**8, and some subnormal ones (e = 0, 1) */
            block[0] = (uint8_t)(rnd_below(10) == 0 ? rnd_below(2) : 112 + rnd_below(25));
            break;
        default: memcpy(block, f, 2); /* Q4_0, Q5_0, Q8_0 */
        }
    }
}

static const char *type_name(int32_t type) {
    switch (type) {
    case KVREF_TYPE_F32: return "f32";
    case KVREF_TYPE_F16: return "f16";
    case KVREF_TYPE_BF16: return "bf16";
    case KVREF_TYPE_Q4_0: return "q4_0";
    case KVREF_TYPE_Q4_1: return "q4_1";
    case KVREF_TYPE_Q5_0: return "q5_0";
    case KVREF_TYPE_Q8_0: return "q8_0";
    case KVREF_TYPE_Q4_K: return "q4_k";
    case KVREF_TYPE_Q6_K: return "q6_k";
    case KVREF_TYPE_MXFP4: return "mxfp4";
    case KVREF_TYPE_I8: return "i8";
    case KVREF_TYPE_KIVI4: return "kivi4";
    default: return "?";
    }
}

/* ---- one report line: a kernel of a table on one type ------------------------------------------- */

typedef struct {
    char what[96];             /* "avx2 vec_dot q4_0" */
    long cases, bad;
    double worst;              /* the largest |diff| / bound among bounded comparisons */
    char first[256];           /* the first mismatch */
} line_t;

static int failed_lines;

static void line_begin(line_t *l, const char *table, const char *kernel, const char *type) {
    memset(l, 0, sizeof *l);
    snprintf(l->what, sizeof l->what, "%s %s %s", table, kernel, type);
    arena_used = 0;
}

/* records a mismatch: the first one's message is reported */
static void mismatch(line_t *l, long index, const char *fmt, ...) {
    if (l->bad++ > 0) return;
    va_list args;
    va_start(args, fmt);
    const int used = vsnprintf(l->first, sizeof l->first, fmt, args);
    va_end(args);
    if (used >= 0 && (size_t)used < sizeof l->first) snprintf(l->first + used, sizeof l->first - (size_t)used, " at %ld", index);
}

/* n bytes equal */
static void expect_bytes(line_t *l, const void *got, const void *want, size_t n, const char *what) {
    l->cases++;
    const uint8_t *g = got, *w = want;
    for (size_t i = 0; i < n; i++)
        if (g[i] != w[i]) {
            mismatch(l, (long)i, "%s: byte 0x%02x, want 0x%02x", what, g[i], w[i]);
            return;
        }
}

/* |got - want| <= bound, or both NaN */
static void expect_close(line_t *l, float got, float want, double bound, long index) {
    l->cases++;
    if (isnan(got) && isnan(want)) return;
    const double diff = fabs((double)got - (double)want);
    if (!(diff <= bound)) {
        mismatch(l, index, "got %.9g, want %.9g, bound %.3g", got, want, bound);
        return;
    }
    if (bound > 0 && diff / bound > l->worst) l->worst = diff / bound;
}

static void line_end(line_t *l) {
    if (l->bad == 0) printf("ok    %-40s %6ld cases  worst |diff|/bound %.3f\n", l->what, l->cases, l->worst);
    else {
        printf("FAIL  %-40s %ld of %ld: %s\n", l->what, l->bad, l->cases, l->first);
        failed_lines++;
    }
    fflush(stdout);
}

/* ---- weight kernels: dequant, vec_dot, vec_dot_rows -------------------------------------------- */

#define MAX_T 11               /* rows of x: the multi-row dot kernels' blocks (8 or 4, 2, 1) and tails */

/* the sizes a weight type is tried at: any K for the float types (tails of every vector width),
 * 1 to 5 blocks for the others */
static int weight_sizes(int32_t type, int64_t *K) {
    const int64_t bv = kvref_block_values(type);
    if (bv == 1) {
        const int64_t any[] = {1, 7, 16, 33, 100, 300};
        memcpy(K, any, sizeof any);
        return 6;
    }
    const int n = bv == QK_K ? 2 : 4;
    const int64_t blocks[] = {1, 2, 3, 5};
    for (int i = 0; i < n; i++) K[i] = blocks[i] * bv;
    return n;
}

static void check_weight_type(const char *name, const kvref_kernels *kk, int32_t type) {
    const kvref_kernels *ref = &kvref_kernels_scalar;
    const int64_t N = 20;
    int64_t Ks[6];
    const int nK = weight_sizes(type, Ks);
    line_t dq, dot, rows;
    line_begin(&dq, name, "dequant", type_name(type));
    line_begin(&dot, name, "vec_dot", type_name(type));
    line_begin(&rows, name, "vec_dot_rows", type_name(type));
    for (int ik = 0; ik < nK; ik++) {
        arena_used = 0;
        const int64_t K = Ks[ik], rb = kvref_row_nbytes(type, K);
        uint8_t *w = (uint8_t *)take((size_t)(N * rb + 1)) + 1; /* an odd address: weights are file views */
        random_weight(type, N, K, w);
        float *x = take_floats(MAX_T * K), *got = take_floats(K), *want = take_floats(K);
        fill_normal(x, MAX_T * K, 1.0f);
        float *out = take_floats(MAX_T * 3);
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *row = w + n * rb;
            /* every value rounded as the NumPy dequantizer rounds it */
            kk->dequant[type](K, row, got);
            ref->dequant[type](K, row, want);
            expect_bytes(&dq, got, want, (size_t)K * 4, "dequantized value");
            /* two float32 dot products of the same K terms in different orders: each within gamma(K) sum|w x|
             * of the exact sum (tests/test_native.py, dot_bound) */
            for (int64_t t = 0; t < MAX_T; t++) {
                double mag = 0;
                for (int64_t k = 0; k < K; k++) mag += fabs((double)want[k] * x[t * K + k]);
                expect_close(&dot, kk->vec_dot[type](K, row, x + t * K), ref->vec_dot[type](K, row, x + t * K),
                             2 * gamma_n((double)K) * mag + UNDERFLOW_SLACK, (long)(n * MAX_T + t));
            }
            /* the rows kernel is the table's own vec_dot per row, bit for bit, at any stride */
            if (kk->vec_dot_rows[type] == NULL) continue;
            for (int64_t T = 1; T <= MAX_T; T++) {
                kk->vec_dot_rows[type](K, row, x, T, out, 3);
                for (int64_t t = 0; t < T; t++) {
                    const float one = kk->vec_dot[type](K, row, x + t * K);
                    expect_bytes(&rows, &out[3 * t], &one, 4, "row of x");
                }
            }
        }
    }
    line_end(&dq);
    line_end(&dot);
    if (kk->vec_dot_rows[type] != NULL) line_end(&rows);
}

/* ---- the float GEMM: tile_columns and gemm_f32 ----------------------------------------------------- */

static void check_tiles(const char *name, const kvref_kernels *kk) {
    const int64_t Ks[] = {1, 7, 64, 129};
    line_t cols, gemm;
    line_begin(&cols, name, "tile_columns", "f32");
    line_begin(&gemm, name, "gemm_f32", "f32");
    for (int ik = 0; ik < 4; ik++) {
        arena_used = 0;
        const int64_t K = Ks[ik], TN = KVREF_TILE_N;
        float *rows = take_floats(16 * K), *got = take_floats(K * TN), *want = take_floats(K * TN);
        fill_normal(rows, 16 * K, 1.0f);
        for (int64_t half = 0; half < TN; half += 16) { /* a pure transposition into either half */
            for (int64_t i = 0; i < K * TN; i++) got[i] = want[i] = (float)i;
            kk->tile_columns(K, rows, got + half);
            kvref_kernels_scalar.tile_columns(K, rows, want + half);
            expect_bytes(&cols, got, want, (size_t)(K * TN) * 4, "tile element");
        }
        const int64_t Ts[] = {1, 3, 8, 9, 13}, nws[] = {1, 16, 17, 32}, ldy = 40;
        float *x = take_floats(13 * K), *tile = take_floats(K * TN);
        float *y = take_floats(13 * ldy), *yref = take_floats(13 * ldy), *y1 = take_floats(ldy);
        fill_normal(x, 13 * K, 1.0f);
        for (int in = 0; in < 4; in++) {
            const int64_t nw = nws[in];
            fill_normal(tile, K * TN, 1.0f);
            for (int64_t k = 0; k < K; k++)
                for (int64_t n = nw; n < TN; n++) tile[k * TN + n] = 0.0f; /* the columns past nw are zero */
            for (int it = 0; it < 5; it++) {
                const int64_t T = Ts[it];
                kk->gemm_f32(K, x, T, tile, nw, y, ldy);
                kvref_kernels_scalar.gemm_f32(K, x, T, tile, nw, yref, ldy);
                for (int64_t t = 0; t < T; t++) {
                    kk->gemm_f32(K, x + t * K, 1, tile, nw, y1, ldy); /* an element's operations do not depend on T */
                    expect_bytes(&gemm, y1, y + t * ldy, (size_t)nw * 4, "row alone against row of T");
                    for (int64_t n = 0; n < nw; n++) {
                        double mag = 0; /* chains of (fused or unfused) multiply-adds in k order */
                        for (int64_t k = 0; k < K; k++) mag += fabs((double)x[t * K + k] * tile[k * TN + n]);
                        expect_close(&gemm, y[t * ldy + n], yref[t * ldy + n], 2 * gamma_n((double)K) * mag + UNDERFLOW_SLACK,
                                     (long)(t * ldy + n));
                    }
                }
            }
        }
    }
    line_end(&cols);
    line_end(&gemm);
}

/* ---- attention chunk kernels --------------------------------------------------------------------- */

/* One layer of a contiguous cache with S keys at positions 0 .. S-1 and one query at position qpos
 * (window: kvref_attn_args's), built for a K and a V type and a group size, and the chunk of keys
 * c0 .. c0+n-1 for kv head hk as attention.c's cursor hands it over. */
typedef struct {
    kvref_attn_args a;
    kvref_attn_chunk c;
    int64_t rows[KVREF_ATTN_CHUNK + KVREF_ATTN_LOOKAHEAD], srows[KVREF_ATTN_CHUNK + KVREF_ATTN_LOOKAHEAD];
    int8_t *q8;
    float *qe;
    int32_t *qsum;
} attn_case;

/* random stored elements of `type` for `count` head vectors of D, and their scales: I8 [count, D / gs]
 * of 2**-7 .. 2**-5; KIVI4 V (scale, zero) pairs [count, D / gs, 2]; KIVI4 K per-group [count / gs,
 * 2, D] channel scales then zeros (count: slots times kv heads) */
static void random_kv(int32_t type, int64_t count, int64_t D, int64_t gs, int is_k, uint8_t **data, float **scales) {
    const int64_t bytes = count * kvref_kv_vector_bytes(type, D);
    *data = take((size_t)bytes + 64);
    *scales = NULL;
    if (type == KVREF_TYPE_F32) fill_normal((float *)(void *)*data, count * D, 1.0f);
    else if (type == KVREF_TYPE_F16 || type == KVREF_TYPE_BF16) {
        for (int64_t i = 0; i < count * D; i++) {
            const float f = rnd_normal();
            const uint16_t h = type == KVREF_TYPE_F16 ? kvref_fp32_to_fp16(f) : (uint16_t)(kvref_bits_from_fp32(f) >> 16);
            memcpy(*data + 2 * i, &h, 2);
        }
    } else {
        for (int64_t i = 0; i < bytes; i++) (*data)[i] = (uint8_t)rnd_u64();
        if (type == KVREF_TYPE_I8) for (int64_t i = 0; i < bytes; i++) if ((*data)[i] == 0x80) (*data)[i] = 0x81; /* [-127, 127] */
        const int64_t n = type == KVREF_TYPE_I8 ? count * (D / gs) : is_k ? 2 * D * (count / gs + 1) : 2 * count * (D / gs);
        *scales = take_floats(n);
        for (int64_t i = 0; i < n; i++) (*scales)[i] = (float)((0.5 + rnd_uniform()) * ldexp(1, -6)) * (rnd_below(4) ? 1 : -1);
        if (type == KVREF_TYPE_KIVI4)
            for (int64_t i = 0; i < n; i++) (*scales)[i] = is_k || i % 2 == 1 ? rnd_normal() : 0.2f * (float)rnd_uniform();
    }
}

static void attn_setup(attn_case *ac, int32_t kt, int32_t vt, int64_t gs, int64_t S, int64_t Hkv, int64_t G, int64_t D,
                       int64_t Dv, int64_t window) {
    kvref_attn_args *a = &ac->a;
    memset(a, 0, sizeof *a);
    a->k_type = kt;
    a->v_type = vt;
    a->group_size = kt == KVREF_TYPE_I8 || vt == KVREF_TYPE_I8 || kt == KVREF_TYPE_KIVI4 || vt == KVREF_TYPE_KIVI4 ? gs : 0;
    a->T = 1;
    a->H = Hkv * G;
    a->Hkv = Hkv;
    a->G = G;
    a->D = D;
    a->Dv = Dv;
    a->S = S;
    a->window = window;
    a->scale = 0.3f;
    float *q = take_floats(a->H * D);
    fill_normal(q, a->H * D, 1.0f);
    a->q = q;
    uint8_t *k, *v;
    float *ks, *vs;
    random_kv(kt, S * Hkv, D, gs, 1, &k, &ks);
    random_kv(vt, S * Hkv, D, gs, 0, &v, &vs);
    a->k = k;
    a->v = v;
    a->k_scales = ks;
    a->v_scales = vs;
    if (kt == KVREF_TYPE_KIVI4) { /* the keys past the last full group are float16 rows */
        uint16_t *res = take((size_t)(gs * Hkv * D) * 2);
        for (int64_t i = 0; i < gs * Hkv * D; i++) res[i] = kvref_fp32_to_fp16(rnd_normal());
        a->k_residual = res;
    }
    int64_t *pos = take((size_t)(S + 1) * 8);
    for (int64_t s = 0; s < S; s++) pos[s] = s;
    pos[S] = S - 1;
    a->k_positions = pos;
    a->q_positions = pos + S;
    /* an I8 K's rounded query: any bytes in [-127, 127] with their sums, any scales */
    const int64_t ng = a->group_size > 0 ? D / a->group_size : 0;
    ac->q8 = take((size_t)(a->H * D));
    ac->qe = take_floats(a->H * (ng + 1));
    ac->qsum = take((size_t)(a->H * (ng + 1)) * 4);
    for (int64_t h = 0; h < a->H; h++)
        for (int64_t b = 0; b < ng; b++) {
            int32_t sum = 0;
            for (int64_t j = b * gs; j < (b + 1) * gs; j++) sum += ac->q8[h * D + j] = (int8_t)(rnd_below(255) - 127);
            ac->qsum[h * ng + b] = sum;
            ac->qe[h * ng + b] = (float)((0.5 + rnd_uniform()) * ldexp(1, -8));
        }
}

/* the chunk of keys c0 .. c0+n-1 for kv head hk (attention.c's cursor_init and cursor_seek); 0 when
 * none of them is visible, a chunk the skeleton never hands over */
static int attn_chunk(attn_case *ac, int64_t hk, int64_t c0, int64_t n) {
    const kvref_attn_args *a = &ac->a;
    kvref_attn_chunk *c = &ac->c;
    const int64_t D = a->D, gs = a->group_size, ng = gs > 0 ? D / gs : 0;
    memset(c, 0, sizeof *c);
    c->q = a->q + hk * a->G * D;
    c->k = a->k + hk * kvref_kv_vector_bytes(a->k_type, D);
    c->v = a->v + hk * kvref_kv_vector_bytes(a->v_type, D);
    if (a->k_scales) c->k_scales = a->k_scales + hk * (a->k_type == KVREF_TYPE_KIVI4 ? 2 * D : ng);
    if (a->v_scales) c->v_scales = a->v_scales + hk * (a->v_type == KVREF_TYPE_KIVI4 ? 2 * ng : ng);
    if (a->k_residual) c->k_residual = a->k_residual + hk * D;
    c->qpos = a->q_positions[0];
    c->klo = a->window == 0 ? INT64_MIN : c->qpos - (a->window - 1);
    c->kp = a->k_positions + c0;
    c->n = n;
    c->nrows = a->S - c0 < n + KVREF_ATTN_LOOKAHEAD ? a->S - c0 : n + KVREF_ATTN_LOOKAHEAD;
    c->row = ac->rows;
    c->srow = ac->srows;
    kvref_attn_rows(a, c0, c->nrows, ac->rows, ac->srows);
    int64_t visible = 0;
    for (int64_t s = 0; s < n; s++) visible += !kvref_attn_hidden(c, s);
    c->all = visible == n;
    c->q8 = ac->q8 + hk * a->G * D;
    c->qe = ac->qe + hk * a->G * ng;
    c->qsum = ac->qsum + hk * a->G * ng;
    return visible > 0;
}

/* the magnitude of a stored element e (of a chunk's K or V) as the bounds count it: |k|, or for KIVI4
 * |level * scale| + |zero|, the two terms its decodings add in either order */
static double kv_magnitude(const kvref_attn_args *a, const kvref_attn_chunk *c, int is_k, int64_t s, int64_t i) {
    const int32_t type = is_k ? a->k_type : a->v_type;
    const uint8_t *base = is_k ? c->k : c->v;
    const int64_t D = a->D, gs = a->group_size, e = c->row[s] + i;
    switch (type) {
    case KVREF_TYPE_F32: { float f; memcpy(&f, base + 4 * e, 4); return fabs(f); }
    case KVREF_TYPE_F16: return fabs(kvref_load_fp16(base + 2 * e));
    case KVREF_TYPE_BF16: return fabs(kvref_bf16_to_fp32(kvref_load_u16(base + 2 * e)));
    case KVREF_TYPE_I8: return fabs((double)(int8_t)base[e] * (is_k ? c->k_scales : c->v_scales)[c->srow[s] + i / gs]);
    default: { /* KIVI4 */
        const double level = (base[e / 2] >> (4 * (e % 2))) & 15;
        if (!is_k) {
            const float *pair = c->v_scales + 2 * (c->srow[s] + i / gs);
            return fabs(level * pair[0]) + fabs(pair[1]);
        }
        const int64_t key = c->kp - a->k_positions + s;
        if (key >= a->S - a->S % gs) return fabs(kvref_fp16_to_fp32(c->k_residual[(key % gs) * a->Hkv * D + i]));
        const float *params = c->k_scales + (c->row[s] / (a->Hkv * D) / gs) * a->Hkv * 2 * D;
        return fabs(level * params[i]) + fabs(params[D + i]);
    }
    }
}

/* whether a table's attention kernels take this K/V type and group size (attention.c runs the scalar
 * table's otherwise: nothing of the table's to check) */
static int attn_takes(const kvref_attn_kernels *k, int32_t kt, int32_t vt, int64_t gs, int64_t D) {
    const int i8 = kt == KVREF_TYPE_I8 || vt == KVREF_TYPE_I8, kivi = kt == KVREF_TYPE_KIVI4 || vt == KVREF_TYPE_KIVI4;
    if (i8 && gs % k->i8_lanes != 0) return 0;
    if (kivi && (k->kivi_lanes == 0 || gs % k->kivi_lanes != 0 || D % k->kivi_lanes != 0)) return 0;
    return 1;
}

/* score, exp and values of one table on one K/V pair and group size, every chunk of a few caches */
static void check_attention_pair(const char *name, const kvref_kernels *kk, int32_t kt, int32_t vt, int64_t gs) {
    const kvref_attn_kernels *ka = &kk->attn, *ref = &kvref_kernels_scalar.attn;
    char types[40];
    snprintf(types, sizeof types, "%s/%s", type_name(kt), type_name(vt));
    if (gs > 0) snprintf(types + strlen(types), sizeof types - strlen(types), " g%d", (int)gs);
    /* (head dim, heads per kv head, window): the SIMD kernels' blocks of 1, 2 and 3 heads, a window
     * that hides whole chunks and part of one, V narrower than K */
    const int64_t shapes[][3] = {{32, 4, 0}, {64, 1, 70}, {128, 2, 0}};
    const int64_t Hkv = 2, C = KVREF_ATTN_CHUNK;
    line_t score, ex, values;
    line_begin(&score, name, "attn.score", types);
    line_begin(&ex, name, "attn.exp", types);
    line_begin(&values, name, "attn.values", types);
    int taken = 0;
    for (int is = 0; is < 3; is++) {
        const int64_t D = shapes[is][0], G = shapes[is][1], window = shapes[is][2], S = 150 + 37 * is;
        if (gs > D || D % (gs > 0 ? gs : 1) != 0 || !attn_takes(ka, kt, vt, gs, D)) continue;
        /* MLA reads only the first Dv elements of each V vector (float types) */
        const int64_t Dv = is == 1 && kvref_kv_element_bytes(vt) > 1 ? D / 2 : D;
        taken = 1;
        arena_used = 0;
        attn_case ac;
        attn_setup(&ac, kt, vt, gs, S, Hkv, G, D, Dv, window);
        float *p = take_floats(G * C), *pref = take_floats(G * C);
        float *acc = take_floats(G * Dv), *accref = take_floats(G * Dv);
        float *m = take_floats(G), *mnew = take_floats(G), *mref = take_floats(G);
        float *sum = take_floats(G), *sumref = take_floats(G);
        for (int64_t hk = 0; hk < Hkv; hk++)
            for (int64_t c0 = 0; c0 < S; c0 += C) {
                const int64_t n = S - c0 < C ? S - c0 : C;
                if (!attn_chunk(&ac, hk, c0, n)) continue;
                const kvref_attn_chunk *c = &ac.c;
                /* scores of the visible keys: the integer scoring of an I8 K is the same bits on
                 * every table; other K types are two dot products over D in different orders
                 * (KIVI4's q . (level * scale + zero) as (q * scale) . level + q . zero) and the
                 * scaling: each within gamma(D + 3) of the exact |scale| sum |q k| */
                ka->score(&ac.a, c, p);
                ref->score(&ac.a, c, pref);
                for (int64_t s = 0; s < n; s++) {
                    if (kvref_attn_hidden(c, s)) continue;
                    for (int64_t g = 0; g < G; g++) {
                        if (kt == KVREF_TYPE_I8) {
                            expect_bytes(&score, &p[g * C + s], &pref[g * C + s], 4, "I8 score");
                            continue;
                        }
                        double mag = 0;
                        for (int64_t i = 0; i < D; i++) mag += fabs(c->q[g * D + i]) * kv_magnitude(&ac.a, c, 1, s, i);
                        expect_close(&score, p[g * C + s], pref[g * C + s],
                                     2 * gamma_n((double)D + 3) * ac.a.scale * mag + UNDERFLOW_SLACK, (long)(g * C + s));
                    }
                }
                /* exponentials: the masked keys' -inf as the skeleton writes them, a running max of
                 * -inf (the first chunk) or finite. The max is exact; each exponential within 2 ulp
                 * of expf on a SIMD table (Cephes) and expf's own rounding on the scalar one: 8u of
                 * the value (attention_bound's), and the n-term sum gamma(n) more */
                for (int64_t g = 0; g < G; g++) {
                    m[g] = c0 == 0 ? -INFINITY : 3 * rnd_normal();
                    for (int64_t s = 0; s < n; s++) {
                        pref[g * C + s] = kvref_attn_hidden(c, s) ? -INFINITY : 3 * rnd_normal();
                        p[g * C + s] = pref[g * C + s];
                    }
                }
                ka->exp(G, n, m, p, mnew, sum);
                ref->exp(G, n, m, pref, mref, sumref);
                for (int64_t g = 0; g < G; g++) {
                    expect_bytes(&ex, &mnew[g], &mref[g], 4, "running max");
                    for (int64_t s = 0; s < n; s++)
                        expect_close(&ex, p[g * C + s], pref[g * C + s], 8 * U * fabs(pref[g * C + s]) + UNDERFLOW_SLACK,
                                     (long)(g * C + s));
                    expect_close(&ex, sum[g], sumref[g], (gamma_n((double)n) + 8 * U) * sumref[g] + UNDERFLOW_SLACK, (long)g);
                }
                /* value sums: acc + sum over the visible keys of p v, each element a sum of n + 1
                 * terms (KIVI4: p level scale and p zero) in some order; a masked key's p is NaN,
                 * which must never reach acc */
                for (int64_t g = 0; g < G; g++)
                    for (int64_t s = 0; s < n; s++) p[g * C + s] = kvref_attn_hidden(c, s) ? NAN : (float)rnd_uniform();
                fill_normal(acc, G * Dv, 1.0f);
                memcpy(accref, acc, (size_t)(G * Dv) * 4);
                ka->values(&ac.a, c, p, acc);
                ref->values(&ac.a, c, p, accref);
                for (int64_t g = 0; g < G; g++)
                    for (int64_t i = 0; i < Dv; i++) {
                        double mag = fabs(accref[g * Dv + i]);
                        for (int64_t s = 0; s < n; s++)
                            if (!kvref_attn_hidden(c, s)) mag += p[g * C + s] * kv_magnitude(&ac.a, c, 0, s, i);
                        expect_close(&values, acc[g * Dv + i], accref[g * Dv + i],
                                     2 * gamma_n((double)n + 3) * mag + UNDERFLOW_SLACK, (long)(g * Dv + i));
                    }
            }
    }
    if (!taken) {
        char what[96];
        snprintf(what, sizeof what, "%s attn %s", name, types);
        printf("--    %-40s the scalar table's kernels run (lanes: I8 %d, KIVI4 %d)\n", what, (int)ka->i8_lanes,
               (int)ka->kivi_lanes);
        return;
    }
    line_end(&score);
    line_end(&ex);
    line_end(&values);
}

static void check_attention(const char *name, const kvref_kernels *kk) {
    const int32_t floats[] = {KVREF_TYPE_F32, KVREF_TYPE_F16, KVREF_TYPE_BF16};
    for (int k = 0; k < 3; k++)
        for (int v = 0; v < 3; v++) check_attention_pair(name, kk, floats[k], floats[v], 0);
    const int64_t groups[] = {8, 16, 32, 64};
    for (int ig = 0; ig < 4; ig++) {
        check_attention_pair(name, kk, KVREF_TYPE_I8, KVREF_TYPE_I8, groups[ig]);
        check_attention_pair(name, kk, KVREF_TYPE_F16, KVREF_TYPE_I8, groups[ig]);
        check_attention_pair(name, kk, KVREF_TYPE_I8, KVREF_TYPE_F16, groups[ig]);
        if (groups[ig] >= 16) check_attention_pair(name, kk, KVREF_TYPE_KIVI4, KVREF_TYPE_KIVI4, groups[ig]);
    }
}

/* ---- gated activations ----------------------------------------------------------------------------- */

/* tests/test_native.py's bound of each side against the spec, atol 4u |g| (|up| (+ 1 for swiglu_oai))
 * and rtol 16u, twice: both sides are within it of the spec */
static void check_glu(const char *name, const kvref_kernels *kk) {
    const char *names[] = {"swiglu", "geglu", "swiglu_oai"};
    const kvref_glu_fn fns[] = {kk->swiglu, kk->geglu, kk->swiglu_oai};
    const kvref_glu_fn refs[] = {kvref_kernels_scalar.swiglu, kvref_kernels_scalar.geglu, kvref_kernels_scalar.swiglu_oai};
    const int64_t ns[] = {1, 7, 8, 15, 16, 17, 100, 1000};
    const float scales[] = {1, 3, 10, 100};
    for (int f = 0; f < 3; f++) {
        line_t l;
        line_begin(&l, name, names[f], "f32");
        for (int in = 0; in < 8; in++)
            for (int is = 0; is < 4; is++) {
                arena_used = 0;
                const int64_t n = ns[in];
                float *g = take_floats(n), *u = take_floats(n), *out = take_floats(n), *ref = take_floats(n);
                fill_normal(g, n, scales[is]);
                fill_normal(u, n, f == 2 ? scales[is] : 1.0f);
                if (n > 8) g[3] = NAN; /* NaN stays NaN */
                fns[f](n, g, u, out);
                refs[f](n, g, u, ref);
                for (int64_t i = 0; i < n; i++) {
                    const double atol = 4 * U * fabs(g[i]) * (fabs(u[i]) + (f == 2));
                    expect_close(&l, out[i], ref[i], 2 * (atol + 16 * U * fabs(ref[i])) + UNDERFLOW_SLACK, (long)i);
                }
                /* an element's value does not depend on where it sits (the fused forward runs row ranges) */
                const int64_t i0 = n / 3;
                fns[f](n - i0, g + i0, u + i0, ref);
                expect_bytes(&l, ref, out + i0, (size_t)(n - i0) * 4, "element of a sub-range");
            }
        line_end(&l);
    }
}

/* ---- 8-bit activations: quantize_q8, packed_dot, q8_tile, gemm_q8 ------------------------------------ */

/* x [T, K] rounded by the scalar table: qs [T, K], ds [T, K/32, 2], xsum [T, K/16] */
static void quantize_rows(const float *x, int64_t T, int64_t K, int8_t *qs, float *ds, int32_t *xsum) {
    for (int64_t t = 0; t < T; t++) {
        kvref_kernels_scalar.quantize_q8(K, x + t * K, qs + t * K, ds + t * (K / 16));
        kvref_block_sums(K, qs + t * K, xsum + t * (K / 16));
    }
}

static void check_quantize(const char *name, const kvref_kernels *kk) {
    const int64_t Ks[] = {32, 64, 256, 1024};
    line_t l;
    line_begin(&l, name, "quantize_q8", "f32");
    for (int ik = 0; ik < 4; ik++) {
        arena_used = 0;
        const int64_t K = Ks[ik], nb = K / 32;
        float *x = take_floats(K), *ds = take_floats(2 * nb), *dsref = take_floats(2 * nb);
        int8_t *qs = take((size_t)K), *qsref = take((size_t)K);
        for (int64_t b = 0; b < nb; b++) fill_normal(x + 32 * b, 32, (float)ldexp(1, (int)rnd_below(40) - 20));
        if (nb >= 4) { /* an all-zero block (d = 0), an infinite and a NaN one (d = NaN) */
            memset(x, 0, 32 * 4);
            x[32 + 5] = INFINITY;
            x[64 + 9] = NAN;
        }
        kk->quantize_q8(K, x, qs, ds);
        kvref_kernels_scalar.quantize_q8(K, x, qsref, dsref);
        for (int64_t b = 0; b < nb; b++) {
            if (isnan(dsref[2 * b])) { /* the block's qs are meaningless; d and s NaN */
                expect_close(&l, ds[2 * b], dsref[2 * b], 0, (long)b);
                expect_close(&l, ds[2 * b + 1], dsref[2 * b + 1], 0, (long)b);
                continue;
            }
            expect_bytes(&l, qs + 32 * b, qsref + 32 * b, 32, "8-bit value");
            expect_bytes(&l, ds + 2 * b, dsref + 2 * b, 8, "block (d, s)");
        }
    }
    line_end(&l);
}

/* packed_dot on groups of 16 rows (kvref_pack_group), every packable type: bit for bit */
static void check_packed(const char *name, const kvref_kernels *kk, int32_t type) {
    line_t l;
    line_begin(&l, name, "packed_dot", type_name(type));
    const int64_t Ks[] = {32, 96, 256, 512};
    for (int ik = 0; ik < 4; ik++) {
        const int64_t K = Ks[ik], rb = kvref_row_nbytes(type, K);
        if (rb < 0) continue; /* the K-quants: whole super-blocks only */
        for (int64_t nr = 16; nr >= 5; nr -= 11) {
            arena_used = 0;
            uint8_t *w = take((size_t)(16 * rb)), *group = take((size_t)kvref_pack_group_bytes(type, K));
            random_weight(type, nr, K, w);
            kvref_pack_group(type, K, w, rb, nr, group);
            float *x = take_floats(8 * K), *ds = take_floats(8 * K / 16);
            int8_t *qs = take((size_t)(8 * K));
            int32_t *xsum = take((size_t)(8 * K / 16) * 4);
            fill_normal(x, 8 * K, 1.0f);
            quantize_rows(x, 8, K, qs, ds, xsum);
            float *out = take_floats(8 * 16), *ref = take_floats(8 * 16);
            for (int64_t T = 1; T <= 8; T++) {
                kk->packed_dot(type, K, group, qs, ds, xsum, T, out);
                kvref_kernels_scalar.packed_dot(type, K, group, qs, ds, xsum, T, ref);
                expect_bytes(&l, out, ref, (size_t)(T * 16) * 4, "packed dot");
            }
        }
    }
    line_end(&l);
}

/* kvref_unpack_row gives back every packed row's file bytes, and a packed group of a type that keeps
 * them all (every packable type but Q6_K, whose header is padded) is exactly their bytes */
static void check_pack_round_trip(int32_t type) {
    line_t l;
    line_begin(&l, "pack", "round trip", type_name(type));
    const int64_t K = 512, rb = kvref_row_nbytes(type, K), gb = kvref_pack_group_bytes(type, K);
    if (type != KVREF_TYPE_Q6_K && gb != 16 * rb) mismatch(&l, 0, "a group of %ld bytes for 16 rows of %ld", (long)gb, (long)rb);
    for (int64_t nr = 16; nr >= 5; nr -= 11) {
        uint8_t *w = take((size_t)(16 * rb)), *group = take((size_t)gb), *row = take((size_t)rb);
        random_weight(type, nr, K, w);
        kvref_pack_group(type, K, w, rb, nr, group);
        for (int r = 0; r < nr; r++) {
            kvref_unpack_row(type, K, group, r, row);
            expect_bytes(&l, row, w + r * rb, (size_t)rb, "unpacked byte");
        }
    }
    line_end(&l);
}

/* the 8-bit GEMM on the portable decoder's tiles, and the table's decoder against it: bit for bit */
static void check_gemm_q8(const char *name, const kvref_kernels *kk, int32_t type) {
    const int64_t bv = kvref_q8_tile_values(type), TN = KVREF_TILE_N, ldy = 40;
    const int affine = type == KVREF_TYPE_Q4_1 || type == KVREF_TYPE_Q4_K;
    const int tiles = kk->q8_tile != NULL && bv == 32;
    line_t gemm, tile;
    line_begin(&gemm, name, "gemm_q8", type_name(type));
    line_begin(&tile, name, "q8_tile", type_name(type));
    const int64_t Ks[] = {256, 512}, Ts[] = {1, 4, 9, 13}, nws[] = {32, 7};
    for (int ik = 0; ik < 2; ik++)
        for (int in = 0; in < 2; in++) {
            arena_used = 0;
            const int64_t K = Ks[ik], nw = nws[in], rb = kvref_row_nbytes(type, K), T = 13;
            uint8_t *w = take((size_t)(TN * rb));
            random_weight(type, nw, K, w);
            uint8_t *t0 = take((size_t)KVREF_Q8_TILE_SCRATCH(K)), *t1 = take((size_t)KVREF_Q8_TILE_SCRATCH(K));
            kvref_q8_tile_ref(type, K, w, rb, nw, t0);
            if (tiles) {
                kk->q8_tile(type, K, w, rb, nw, t1);
                expect_bytes(&tile, t1, t0, (size_t)(K / bv * KVREF_Q8_TILE_RECORD(bv)), "tile byte");
            }
            float *x = take_floats(T * K), *ds = take_floats(T * K / 16);
            int8_t *qs = take((size_t)(T * K));
            int32_t *xsum = take((size_t)(T * K / 16) * 4);
            fill_normal(x, T * K, 1.0f);
            quantize_rows(x, T, K, qs, ds, xsum);
            uint8_t *xu = take((size_t)(T * K));
            for (int64_t i = 0; i < T * K; i++) xu[i] = (uint8_t)(qs[i] + 128);
            float *y = take_floats(T * ldy), *yref = take_floats(T * ldy);
            for (int it = 0; it < 4; it++) {
                kk->gemm_q8(K, xu, ds, Ts[it], t0, bv, nw, affine, y, ldy);
                kvref_kernels_scalar.gemm_q8(K, xu, ds, Ts[it], t0, bv, nw, affine, yref, ldy);
                for (int64_t t = 0; t < Ts[it]; t++) expect_bytes(&gemm, y + t * ldy, yref + t * ldy, (size_t)nw * 4, "gemm_q8 row");
            }
        }
    line_end(&gemm);
    if (tiles) line_end(&tile);
}

/* ---- read_sum and to_fp16 ------------------------------------------------------------------------ */

static void check_bits(const char *name, const kvref_kernels *kk) {
    line_t sum, half;
    line_begin(&sum, name, "read_sum", "u64");
    const int64_t ns[] = {256, 1024, 4352};
    for (int i = 0; i < 3; i++) {
        uint8_t *p = take((size_t)ns[i]);
        for (int64_t j = 0; j < ns[i]; j++) p[j] = (uint8_t)rnd_u64();
        const uint64_t got = kk->read_sum(p, ns[i]), want = kvref_kernels_scalar.read_sum(p, ns[i]);
        expect_bytes(&sum, &got, &want, 8, "wrapping sum");
    }
    line_end(&sum);
    line_begin(&half, name, "to_fp16", "f32");
    /* overflow, ties, subnormals, infinities, NaN, signed zero, and normals of every scale */
    const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 65504.0f, 65519.99f, 65520.0f, 1e9f,
                             5.9604645e-08f, 2.9802322e-08f, 2.9802326e-08f, 8.940697e-08f, 6.097555e-05f,
                             6.1035156e-05f, 1.0009766f, 1.0014648f, -3.0517578e-05f, 1e-12f};
    const int64_t nsp = (int64_t)(sizeof special / sizeof special[0]), n = 1000;
    float *x = take_floats(n);
    uint16_t *got = take((size_t)n * 2), *want = take((size_t)n * 2);
    for (int64_t i = 0; i < n; i++) x[i] = i < nsp ? special[i] : rnd_normal() * (float)ldexp(1, (int)rnd_below(50) - 30);
    for (int64_t len = n; len >= n - 7; len--) { /* and every tail length */
        kk->to_fp16(len, x, got);
        kvref_kernels_scalar.to_fp16(len, x, want);
        expect_bytes(&half, got, want, (size_t)len * 2, "float16 bits");
    }
    line_end(&half);
}

/* ---- one table, every entry ------------------------------------------------------------------------ */

static void check_table(const char *name, const kvref_kernels *kk) {
    rng_state = 20250101; /* every table sees the same inputs */
    for (int32_t type = 0; type < KVREF_TYPE_SLOTS; type++)
        if (kvref_kernels_scalar.vec_dot[type] != NULL) check_weight_type(name, kk, type);
    check_tiles(name, kk);
    check_attention(name, kk);
    check_glu(name, kk);
    check_quantize(name, kk);
    for (int32_t type = 0; type < KVREF_TYPE_SLOTS; type++) {
        if (kvref_packable(type)) check_packed(name, kk, type);
        if (kvref_q8_tile_type(type) && kk->gemm_q8 != NULL) check_gemm_q8(name, kk, type);
    }
    check_bits(name, kk);
}

/* ---- the pool, through kvref.h only ----------------------------------------------------------------- */

static const char *isa_name(int32_t isa, char *buf, size_t n) {
    if (isa >= 0 && isa < ISA_NAME_COUNT) return ISA_NAMES[isa];
    snprintf(buf, n, "isa%d", (int)isa);
    return buf;
}

/* y at 2 and 4 threads equals y at 1 thread, bit for bit, for every weight type, both activation modes,
 * T below and above the GEMM switch */
static void check_threads(const char *name, int32_t isa) {
    line_t l;
    line_begin(&l, name, "pool threads 1/2/4", "matmul");
    kvref_pool *pools[3] = {NULL, NULL, NULL};
    const int64_t threads[] = {1, 2, 4};
    for (int i = 0; i < 3; i++)
        if (kvref_pool_create(threads[i], isa, &pools[i]) != KVREF_OK) mismatch(&l, i, "a pool of %d threads refused", (int)threads[i]);
    const int64_t K = 256, N = 70;
    for (int32_t type = 0; type < KVREF_TYPE_SLOTS && l.bad == 0; type++) {
        if (kvref_kernels_scalar.vec_dot[type] == NULL) continue;
        arena_used = 0;
        const int64_t rb = kvref_row_nbytes(type, K);
        uint8_t *w = take((size_t)(N * rb));
        random_weight(type, N, K, w);
        float *x = take_floats(12 * K), *y[3];
        fill_normal(x, 12 * K, 1.0f);
        for (int i = 0; i < 3; i++) y[i] = take_floats(12 * N);
        const int64_t Ts[] = {1, 5, 12};
        for (int it = 0; it < 3; it++)
            for (int mode = 0; mode < 2; mode++) {
                for (int i = 0; i < 3; i++) {
                    const int st = mode == 0 ? kvref_matmul(pools[i], x, Ts[it], K, w, type, N * rb, N, y[i])
                                             : kvref_matmul_int8(pools[i], x, Ts[it], K, w, type, N * rb, N, y[i]);
                    if (st != KVREF_OK) mismatch(&l, type, "%s matmul status %d", type_name(type), st);
                }
                expect_bytes(&l, y[1], y[0], (size_t)(Ts[it] * N) * 4, mode == 0 ? "2 threads" : "2 threads, int8");
                expect_bytes(&l, y[2], y[0], (size_t)(Ts[it] * N) * 4, mode == 0 ? "4 threads" : "4 threads, int8");
            }
    }
    for (int i = 0; i < 3; i++) kvref_pool_destroy(pools[i]);
    line_end(&l);
}

/* pools made and destroyed many times, each running a call (workers started, woken and joined) */
static void check_lifetime(const char *name, int32_t isa) {
    line_t l;
    line_begin(&l, name, "pool create/destroy", "x50");
    const int64_t K = 64, N = 40;
    float *x = take_floats(K), *w = take_floats(N * K), *y = take_floats(N), *y0 = take_floats(N);
    fill_normal(x, K, 1.0f);
    fill_normal(w, N * K, 1.0f);
    for (int i = 0; i < 50; i++) {
        kvref_pool *pool = NULL;
        int st = kvref_pool_create(1 + i % 4, isa, &pool);
        if (st == KVREF_OK) st = kvref_matmul(pool, x, 1, K, w, KVREF_TYPE_F32, N * K * 4, N, i == 0 ? y0 : y);
        kvref_pool_destroy(pool);
        if (st != KVREF_OK) mismatch(&l, i, "status %d", st);
        else if (i > 0) expect_bytes(&l, y, y0, (size_t)N * 4, "result of a fresh pool");
        else l.cases++;
    }
    line_end(&l);
}

/* a wrong argument returns its status; nothing crashes */
static void check_wrong_calls(void) {
    line_t l;
    line_begin(&l, "api", "wrong arguments", "status");
    kvref_pool *pool = NULL;
    float x[32] = {0}, y[4];
    uint8_t w[4 * 34] = {0};
    const struct { int got, want; } calls[] = {
        {kvref_pool_create(0, KVREF_ISA_SCALAR, &pool), KVREF_ERR_DIM},
        {kvref_pool_create(2000, KVREF_ISA_SCALAR, &pool), KVREF_ERR_DIM},
        {kvref_pool_create(1, 99, &pool), KVREF_ERR_VALUE},
        {kvref_pool_create(1, KVREF_ISA_SCALAR, NULL), KVREF_ERR_NULL},
        {kvref_matmul(NULL, x, 1, 32, w, KVREF_TYPE_Q8_0, 4 * 34, 4, y), KVREF_ERR_NULL},
    };
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
        l.cases++;
        if (calls[i].got != calls[i].want) mismatch(&l, (long)i, "status %d, want %d", calls[i].got, calls[i].want);
    }
    if (kvref_pool_create(2, KVREF_ISA_AUTO, &pool) != KVREF_OK) mismatch(&l, 0, "a pool of the best instruction set refused");
    else {
        const struct { int got, want; } on_pool[] = {
            {kvref_matmul(pool, NULL, 1, 32, w, KVREF_TYPE_Q8_0, 4 * 34, 4, y), KVREF_ERR_NULL},
            {kvref_matmul(pool, x, 1, 32, w, KVREF_TYPE_Q8_0, 4 * 34 - 1, 4, y), KVREF_ERR_SIZE},
            {kvref_matmul(pool, x, 1, 33, w, KVREF_TYPE_Q8_0, 4 * 34, 4, y), KVREF_ERR_SHAPE},
            {kvref_matmul(pool, x, 1, 32, w, 5, 4 * 34, 4, y), KVREF_ERR_TYPE},
            {kvref_matmul(pool, x, -1, 32, w, KVREF_TYPE_Q8_0, 4 * 34, 4, y), KVREF_ERR_DIM},
            {kvref_matmul(pool, x, 1, 32, w, KVREF_TYPE_Q8_0, 4 * 34, 4, y), KVREF_OK},
        };
        for (size_t i = 0; i < sizeof on_pool / sizeof on_pool[0]; i++) {
            l.cases++;
            if (on_pool[i].got != on_pool[i].want)
                mismatch(&l, (long)(i + 10), "status %d, want %d", on_pool[i].got, on_pool[i].want);
        }
        kvref_pool_destroy(pool);
    }
    kvref_pool_destroy(NULL);
    line_end(&l);
}

int main(void) {
    unsigned char *block = malloc(ARENA_BYTES + 64);
    if (block == NULL) return 2;
    arena = block + (64 - (uintptr_t)block % 64) % 64;
    char buf[32];
    printf("best instruction set: %s\n", isa_name(kvref_isa_best(), buf, sizeof buf));
    for (int32_t type = 0; type < KVREF_TYPE_SLOTS; type++)
        if (kvref_packable(type)) check_pack_round_trip(type);
    /* every isa id the pool knows, until it refuses one as out of range */
    for (int32_t isa = KVREF_ISA_SCALAR;; isa++) {
        const char *name = isa_name(isa, buf, sizeof buf);
        kvref_pool *pool = NULL;
        const int st = kvref_pool_create(1, isa, &pool);
        if (st == KVREF_ERR_VALUE) break;
        if (st == KVREF_ERR_ISA) {
            printf("--    %-40s not on this CPU or build\n", name);
            continue;
        }
        if (st != KVREF_OK) {
            printf("FAIL  %-40s pool refused: %s\n", name, kvref_status_string(st));
            failed_lines++;
            continue;
        }
        const kvref_kernels *kk = kvref_pool_kernels(pool);
        if (kk == &kvref_kernels_scalar) printf("--    %-40s the reference table\n", name);
        else check_table(name, kk);
#if KVREF_X86
        /* AVX-512 CPUs without VNNI run the plain AVX-512 table: check it here too */
        if (kk == &kvref_kernels_avx512_vnni) check_table("avx512-novnni", &kvref_kernels_avx512);
#endif
        kvref_pool_destroy(pool);
        check_threads(name, isa);
        check_lifetime(name, isa);
    }
    check_wrong_calls();
    printf("%s\n", failed_lines ? "FAILED" : "all ok");
    free(block);
    return failed_lines ? 1 : 0;
}
