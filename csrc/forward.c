/* forward.c: one execution of the whole model (a prefill or a decode step) in one C call.
 *
 * This is kvref/spec/decoder.py step for step, computed with the kernels the single-kernel API
 * uses (matmul.c, attention.c, elementwise.c) in the same order, so with exact activations its
 * logits and cache rows are bit for bit those of the Python decoder running the native kernels
 * (pass by pass: an execution of more than KVREF_PASS_ROWS rows runs as several, kvref.h).
 * What it removes is the Python between the kernels (~400 calls per decode step), and it fuses
 * what can share one dispatch to the thread pool:
 *   - decode: the Q, K and V projections are one dispatch, gate and up (with SwiGLU on each
 *     unit's rows) another, and the output and down projections add into the residual stream as
 *     they produce it; every output element is still the one dot product kvref_matmul computes;
 *   - RoPE's cos/sin are computed once per new position and distinct frequency table per call, not
 *     once per layer (Gemma 3 has two tables: its local and global layers' bases);
 *   - K and V go straight into the cache slots of the new positions, encoded as the Python cache
 *     layouts encode them (kvcache.c), and attention reads them there, paged, in per-layer rings
 *     or contiguous.
 * A mixture-of-experts layer's MLP is moe.c's (kvref_moe_run): its rows grouped by expert, so each
 * routed expert's weights stream once per pass.
 * Its memory is bounded: long executions run in passes of at most KVREF_PASS_ROWS rows, so the row
 * buffers are a pass's, not the prompt's; and in the int8 mode the LM head's likeliest rows are
 * recomputed from the packed copy, so the head's file pages stay unread once it is packed.
 *
 * Work is split only by the pool (units of rows, heads, key segments), never by thread identity,
 * so results are the same for every thread count. Shape legend as in kvref.h; x is the residual
 * stream [T, E], S = length + T positions are attended to.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdlib.h>

#include "internal.h"
#include "platform.h"

#define ROWS_PARALLEL_MIN 16   /* from this many new positions on, row-wise steps use the pool */
#define ROWS_PER_UNIT 4

/* the projections: a layer's (MLA's low-rank query and latent down-projection last), then the LM head */
enum { W_Q, W_K, W_V, W_O, W_GATE, W_UP, W_DOWN, W_Q_A, W_KV_A, W_HEAD };

struct kvref_model {
    kvref_model_desc desc;     /* config and pointers; desc.layers points at `layers` */
    kvref_layer_desc *layers;  /* [n_layers] */
    int int8;                  /* every projection and LM head of a type with a packed form (internal.h)
                                  packed: KVREF_ACT_INT8 executions can run */
    int64_t max_k;             /* widest matmul input: max(E, H*D, F), and MLA's Q, R, H*Dv */
    int64_t cache_heads;       /* what the cache holds per position and attention reads: Hkv kv heads, */
    int64_t key_dim, value_dim; /* of key_dim and value_dim values (D, D); MLA: one latent key of R + Dr, values R */
    int64_t rope_dim;          /* the width RoPE rotates per head: D, or MLA's Dr */
    int64_t n_tables;          /* distinct RoPE frequency tables among the layers' */
    int64_t *table_of;         /* [n_layers] the index of each layer's table among those */
};

enum { FAM_PROJ = 0, FAM_ATTN = 1, FAM_OTHER = 2 };

struct kvref_state {
    const kvref_model *model;
    int64_t rows;              /* positions every row buffer below holds */
    float *x;                  /* [rows, E]     residual stream */
    float *xb;                 /* [rows, E]     a block's normed input; once its projections have read it,
                                *                the block's output before the residual add */
    /* A layer's attention block uses q .. ly and its MLP gate and up, never one the other's: the two
     * sets share one allocation, `blocks` (at Llama 3.2 1B's shapes 20 KiB a row beside gate's 32) */
    float *blocks;
    float *q;                  /* [rows, H*D]   queries (rotated in place); MLA: [rows, H, R + Dr] absorbed */
    float *k, *v;              /* [rows, Hkv*D] new keys (rotated in place) and values; MLA: [rows, R + Dr]
                                *                latent keys, v unused */
    float *att;                /* [rows, H*D]   attention output; MLA: [rows, H, R] */
    float *lq, *lh, *lo;       /* MLA: [rows, H*D] projected queries, [rows, Q] low-rank queries, [rows, H*Dv]
                                *      values (W_UV after attention) */
    float *lx, *ly;            /* MLA: [rows, max(Dn, R)], [rows, max(R, Dv)] one head's rows in and out of its
                                *      up-projection */
    float *gate;               /* [rows, F]     MLP hidden: gate, then act(gate) * up */
    float *up;                 /* [min(rows * F, KVREF_UP_FLOATS)] a chunk of up's columns for every row
                                *                (kvref.h: [T, up_columns(F, T)]) */
    double *cs;                /* [n_tables, rows, D] RoPE cos | sin of each new position, per table */
    int64_t *q_positions;      /* [rows] each new position's own position */
    int64_t *row_seq;          /* [rows] the sequence each new position belongs to */
    int64_t keys;              /* k_positions holds 0 .. keys-1 */
    int64_t *k_positions;      /* [keys] */
    int64_t ring_keys;
    int64_t *slot_positions;   /* [ring_keys] the position each slot of a ring layer holds, by
                                  sequence (sequence b's from the sum of the positions before it) */
    int64_t partial_floats;
    float *partial;            /* attention's per-segment softmax states, by sequence */
    int64_t max_jobs, n_jobs;
    kvref_attn_job *jobs;      /* [max_jobs]: a layer's attentions, run together */
    int64_t part_slots;
    int64_t *parts;            /* [part_slots]: a pass's bounds [B + 1], then its parts' cache lengths [B] */
    int64_t ns[3], calls;      /* kvref_state_timings */
    int64_t expert_bytes;      /* ... and the routed experts' bytes read */
    int64_t fail_layer;        /* kvref_state_fail_at_layer: the layer the next forward stops at, or -1 */
    kvref_moe_state *moe;      /* a mixture of experts' row buffers (moe.c), or NULL */
};

/* one call's arguments, passed to every step */
typedef struct {
    kvref_pool *pool;
    const kvref_kernels *kk;
    const kvref_model_desc *c; /* config and weights */
    kvref_state *s;
    const int64_t *token_ids;  /* [T]: the new positions of every sequence, sequence after sequence */
    int64_t T, B;              /* rows in all, sequences (of this pass: see kvref_forward_batch) */
    const int64_t *bounds;     /* [B + 1]: sequence b's rows are bounds[b] .. bounds[b+1]-1 */
    const kvref_kv *caches;    /* [B]: sequence b's cache, written at positions [lengths[b], ...) */
    const int64_t *lengths;    /* [B] */
    int int8;                  /* KVREF_ACT_INT8 */
    int all_logits;
    float *logits;
    int64_t n_last;            /* without all_logits: the sequences whose last row is in this pass (the first n_last) */
    int64_t layer;             /* the layer being computed */
    const kvref_layer_desc *lw;
    const float *gain;         /* the RMSNorm gain of the current norm step */
    const float *bias;         /* the bias the current bias step adds to xb */
    float *norm_rows;          /* ... and the rows it normalises in place (NULL: x into xb) */
    kvref_glu_fn glu;          /* the MLP's gate activation (the kernel table's swiglu, geglu or swiglu_oai) */
    int64_t hidden0, hidden_n; /* the chunk of hidden columns glu_row gates: [hidden0, hidden0 + hidden_n) */
    const kvref_model *model;
} fw;

/* ---- row-wise steps: one function per new position, on the pool when there are many --------- */

typedef void (*row_fn)(const fw *f, int64_t t);
typedef struct {
    const fw *f;
    row_fn fn;
} rows_ctx;

static void rows_task(void *vctx, int64_t unit, int thread) {
    const rows_ctx *c = vctx;
    (void)thread;
    const int64_t t1 = (unit + 1) * ROWS_PER_UNIT < c->f->T ? (unit + 1) * ROWS_PER_UNIT : c->f->T;
    for (int64_t t = unit * ROWS_PER_UNIT; t < t1; t++) c->fn(c->f, t);
}

static void for_each_row(const fw *f, row_fn fn) {
    if (f->T < ROWS_PARALLEL_MIN) {
        for (int64_t t = 0; t < f->T; t++) fn(f, t);
        return;
    }
    rows_ctx c = {f, fn};
    kvref_pool_run(f->pool, rows_task, &c, (f->T + ROWS_PER_UNIT - 1) / ROWS_PER_UNIT);
}

/* x[t] = tok_embeddings[token_ids[t]], dequantized exactly as kvref_embed does. A table that is
 * the LM head, packed (the int8 mode), gives its row from the packed copy, unpacked into xb[t] (E
 * floats hold a row of any type): its file pages were released once packed, and reading a row
 * there maps the page-cache folio around it back in (~150 KiB a token on the 1B bench file) */
static void embed_row(const fw *f, int64_t t) {
    const kvref_tensor *e = &f->c->tok_embeddings, *head = &f->c->output;
    const int64_t id = f->token_ids[t];
    float *x = f->s->x + t * f->c->d_model;
    const uint8_t *row = (const uint8_t *)e->data + id * kvref_row_nbytes(e->type, e->cols);
    if (head->packed != NULL && head->data == e->data) {
        uint8_t *unpacked = (uint8_t *)(f->s->xb + t * f->c->d_model);
        kvref_unpack_row(e->type, e->cols, (const uint8_t *)head->packed + id / KVREF_PACK_ROWS *
                         kvref_pack_group_bytes(e->type, e->cols), (int)(id % KVREF_PACK_ROWS), unpacked);
        row = unpacked;
    }
    kvref_dequant_row(e->type, e->cols, row, x);
    const float scale = f->c->embedding_scale;
    if (scale != 1.0f) /* as the decoder, which multiplies only then */
        for (int64_t i = 0; i < e->cols; i++) x[i] = x[i] * scale;
}

/* xb[t] = rms_norm(x[t]) * gain, or norm_rows[t] normalised in place */
static void norm_row(const fw *f, int64_t t) {
    const int64_t E = f->c->d_model;
    const float *in = f->norm_rows != NULL ? f->norm_rows + t * E : f->s->x + t * E;
    kvref_rms_norm_row(in, E, f->gain, f->c->norm_eps, f->norm_rows != NULL ? f->norm_rows + t * E : f->s->xb + t * E);
}

/* q[t], k[t] (and v[t]) as the decoder makes them from the projections: biases added, each head's
 * q and k RMS-normalised, then rotated for row t's position with the layer's frequencies */
static void qk_row(const fw *f, int64_t t) {
    const kvref_model_desc *c = f->c;
    const kvref_layer_desc *lw = f->lw;
    const int64_t H = c->n_heads, Hkv = c->n_kv_heads, D = c->head_dim;
    const int64_t table = f->model->table_of[f->layer]; /* -1: a NoPE layer */
    const double *cs = table < 0 ? NULL : f->s->cs + (table * f->s->rows + t) * D;
    float *q = f->s->q + t * H * D, *k = f->s->k + t * Hkv * D, *v = f->s->v + t * Hkv * D;
    if (lw->bq != NULL) {
        for (int64_t i = 0; i < H * D; i++) q[i] = q[i] + lw->bq[i];
        for (int64_t i = 0; i < Hkv * D; i++) k[i] = k[i] + lw->bk[i];
        for (int64_t i = 0; i < Hkv * D; i++) v[i] = v[i] + lw->bv[i];
    }
    if (lw->q_norm != NULL) {
        for (int64_t h = 0; h < H; h++) kvref_rms_norm_row(q + h * D, D, lw->q_norm, c->norm_eps, q + h * D);
        for (int64_t h = 0; h < Hkv; h++) kvref_rms_norm_row(k + h * D, D, lw->k_norm, c->norm_eps, k + h * D);
    }
    if (cs == NULL) return; /* a NoPE layer: q and k carry no position */
    kvref_rope_row(q, H, D, cs, q);
    kvref_rope_row(k, Hkv, D, cs, k);
}

/* k[t] and v[t] -> the slot of row t's position in its sequence's cache (MLA: the latent key k[t], its own V) */
static void store_row(const fw *f, int64_t t) {
    const int64_t kvd = f->model->cache_heads * f->model->key_dim;
    const float *k = f->s->k + t * kvd;
    kvref_kv_store(&f->caches[f->s->row_seq[t]], f->kk, f->layer, f->s->q_positions[t], k,
                   f->c->kv_lora_rank > 0 ? k : f->s->v + t * kvd);
}

/* xb[t] += bias */
static void bias_row(const fw *f, int64_t t) {
    const int64_t E = f->c->d_model;
    float *y = f->s->xb + t * E;
    for (int64_t i = 0; i < E; i++) y[i] = y[i] + f->bias[i];
}

/* x[t] += xb[t] */
static void residual_row(const fw *f, int64_t t) {
    const int64_t E = f->c->d_model;
    float *x = f->s->x + t * E;
    const float *y = f->s->xb + t * E;
    for (int64_t i = 0; i < E; i++) x[i] = x[i] + y[i];
}

/* gate[t, chunk] = act(gate[t, chunk]) * up[t], up holding the chunk's columns of each row */
static void glu_row(const fw *f, int64_t t) {
    float *gate = f->s->gate + t * f->c->d_ff + f->hidden0;
    f->glu(f->hidden_n, gate, f->s->up + t * f->hidden_n, gate);
}

/* ---- projections ------------------------------------------------------------------------- */

/* projection `which` of layer lw, or the LM head */
static const kvref_tensor *projection(const kvref_model_desc *c, const kvref_layer_desc *lw, int which) {
    const kvref_tensor *w[W_HEAD + 1] = {&lw->wq, &lw->wk, &lw->wv, &lw->wo, &lw->w_gate, &lw->w_up, &lw->w_down,
                                         &lw->wq_a, &lw->wkv_a, &c->output};
    return w[which];
}

/* its packed copy when an int8 execution reads one, else NULL */
static const uint8_t *packed(const fw *f, int which) { return f->int8 ? projection(f->c, f->lw, which)->packed : NULL; }

/* weight w into y [T, ldy] (its packed copy when an int8 execution reads one) */
static kvref_mv_part tensor_part(const fw *f, const kvref_tensor *w, float *y, int64_t ldy) {
    return (kvref_mv_part){(const uint8_t *)w->data, f->int8 ? w->packed : NULL, w->type, w->rows, y, ldy};
}

/* projection `which` into y [T, ldy] */
static kvref_mv_part part(const fw *f, int which, float *y, int64_t ldy) {
    return tensor_part(f, projection(f->c, f->lw, which), y, ldy);
}

/* rows n0 .. n0+n-1 of w as a weight of their own, its packed copy's groups included (n0 a multiple
 * of KVREF_PACK_ROWS) */
static kvref_tensor weight_rows(const kvref_tensor *w, int64_t n0, int64_t n) {
    kvref_tensor rows = *w;
    const int64_t rb = kvref_row_nbytes(w->type, w->cols);
    rows.data = (const uint8_t *)w->data + n0 * rb;
    rows.nbytes = n * rb;
    rows.rows = n;
    if (w->packed != NULL)
        rows.packed = (const uint8_t *)w->packed + n0 / KVREF_PACK_ROWS * kvref_pack_group_bytes(w->type, w->cols);
    return rows;
}

/* A decode-path projection of x [T, K] into up to three weights (parts, set by the caller): with
 * int8 activations, and when one of them is packed, x is rounded to 8-bit blocks first (into the
 * pool's shared buffer, reserved for the execution). */
static kvref_mv matvec(const fw *f, const float *x, int64_t T, int64_t K, int nparts, kvref_mv_part p0,
                       kvref_mv_part p1, kvref_mv_part p2) {
    kvref_mv mv = {x, NULL, NULL, NULL, T, K, nparts, {p0, p1, p2}, 0, NULL};
    int any = 0;
    for (int i = 0; i < nparts; i++) any |= mv.part[i].packed != NULL;
    if (any) kvref_quantize_rows(f->pool, x, T, K, &mv.xqs, &mv.xds, &mv.xsum);
    return mv;
}

/* Whether a projection of T rows of x into the n weights `which` takes the decode path (kvref_mv)
 * rather than the GEMM: below the switch of the activation mode's matmul (kvref.h), and with int8
 * activations at any T where each weight is packed (the packed kernel computes the 8-bit GEMM's
 * sums, and reads only the packed copy) */
static int decode_path(const fw *f, int64_t T, int n, const int *which) {
    int packed_all = f->int8;
    for (int i = 0; i < n; i++) packed_all &= packed(f, which[i]) != NULL;
    return packed_all || T < (f->int8 ? KVREF_GEMM_Q8_MIN_T : KVREF_GEMM_MIN_T);
}

/* y [T, N] = x [T, K] @ W.T on the prefill path (T from the GEMM switch on) */
static void matmul(const fw *f, const float *x, int64_t T, const kvref_tensor *w, float *y) {
    if (f->int8) kvref_matmul_int8_run(f->pool, x, T, w->cols, (const uint8_t *)w->data, w->type, w->rows, y);
    else kvref_matmul_run(f->pool, x, T, w->cols, (const uint8_t *)w->data, w->type, w->rows, y);
}

/* q, k, v = xb @ Wq.T, xb @ Wk.T, xb @ Wv.T */
static void qkv_projections(fw *f) {
    const int64_t t0 = kvref_now_ns();
    const kvref_layer_desc *lw = f->lw;
    kvref_state *s = f->s;
    const int64_t E = f->c->d_model;
    if (decode_path(f, f->T, 3, (const int[]){W_Q, W_K, W_V})) {
        const kvref_mv mv = matvec(f, s->xb, f->T, E, 3, part(f, W_Q, s->q, lw->wq.rows),
                                   part(f, W_K, s->k, lw->wk.rows), part(f, W_V, s->v, lw->wv.rows));
        kvref_mv_run(f->pool, &mv);
    } else {
        matmul(f, s->xb, f->T, &lw->wq, s->q);
        matmul(f, s->xb, f->T, &lw->wk, s->k);
        matmul(f, s->xb, f->T, &lw->wv, s->v);
    }
    s->ns[FAM_PROJ] += kvref_now_ns() - t0;
}

/* x += in @ W.T: a block's output projection added into the residual stream (Wo after attention,
 * Wd after the MLP); with a bias, x += in @ W.T + bias (gpt-oss's Wo); with a sandwich norm gain,
 * x += rms_norm(in @ W.T) * gain. The block's normed input xb is dead by now (its projections read
 * it), so the output goes there before the add unless it can be added as produced. */
static void residual_projection(fw *f, const float *in, int which, const float *bias, const float *post_norm) {
    int64_t t0 = kvref_now_ns();
    const kvref_tensor *w = projection(f->c, f->lw, which);
    kvref_state *s = f->s;
    const int decode = decode_path(f, f->T, 1, &which), direct = decode && bias == NULL && post_norm == NULL;
    if (decode) {
        const kvref_mv_part none = {0};
        kvref_mv mv = matvec(f, in, f->T, w->cols, 1, part(f, which, direct ? s->x : s->xb, w->rows), none, none);
        mv.accumulate = direct;
        kvref_mv_run(f->pool, &mv);
    } else {
        matmul(f, in, f->T, w, s->xb);
    }
    if (bias != NULL) { /* added before any norm, as the decoder's project() adds it */
        f->bias = bias;
        for_each_row(f, bias_row);
    }
    if (post_norm != NULL) { /* the block's output normalised before the add (Gemma 3) */
        s->ns[FAM_PROJ] += kvref_now_ns() - t0;
        t0 = kvref_now_ns();
        f->gain = post_norm;
        f->norm_rows = s->xb;
        for_each_row(f, norm_row);
        f->norm_rows = NULL;
        s->ns[FAM_OTHER] += kvref_now_ns() - t0;
        t0 = kvref_now_ns();
    }
    if (!direct) for_each_row(f, residual_row);
    s->ns[FAM_PROJ] += kvref_now_ns() - t0;
}

/* hidden columns per chunk of the up projection for T rows (kvref.h, KVREF_UP_FLOATS) */
static int64_t up_columns(int64_t F, int64_t T) {
    _Static_assert(KVREF_PASS_ROWS * KVREF_TILE_N <= KVREF_UP_FLOATS, "a pass's rows hold a tile's columns");
    _Static_assert(KVREF_TILE_N % KVREF_PACK_ROWS == 0, "chunks of whole packed groups");
    return T * F <= KVREF_UP_FLOATS ? F : KVREF_UP_FLOATS / T / KVREF_TILE_N * KVREF_TILE_N;
}

/* gate = act(xb @ Wg.T) * (xb @ Wu.T), up_columns at a time: on the decode path gate's and up's rows
 * of a chunk in one dispatch (x rounded to 8 bits once, for every chunk), on the GEMM path gate whole,
 * then each chunk of up */
static void gate_up_projections(fw *f) {
    const int64_t t0 = kvref_now_ns();
    const kvref_layer_desc *lw = f->lw;
    kvref_state *s = f->s;
    const int64_t E = f->c->d_model, F = f->c->d_ff, cols = up_columns(F, f->T);
    if (decode_path(f, f->T, 2, (const int[]){W_GATE, W_UP})) {
        const kvref_mv_part none = {0};
        kvref_mv mv = matvec(f, s->xb, f->T, E, 2, part(f, W_GATE, s->gate, F), part(f, W_UP, s->up, cols), none);
        mv.glu = f->glu;
        for (int64_t n0 = 0; n0 < F; n0 += cols) {
            const int64_t n = F - n0 < cols ? F - n0 : cols;
            const kvref_tensor gate = weight_rows(&lw->w_gate, n0, n), up = weight_rows(&lw->w_up, n0, n);
            mv.part[0] = tensor_part(f, &gate, s->gate + n0, F);
            mv.part[1] = tensor_part(f, &up, s->up, n);
            kvref_mv_run(f->pool, &mv);
        }
    } else {
        matmul(f, s->xb, f->T, &lw->w_gate, s->gate);
        for (f->hidden0 = 0; f->hidden0 < F; f->hidden0 += cols) {
            f->hidden_n = F - f->hidden0 < cols ? F - f->hidden0 : cols;
            const kvref_tensor up = weight_rows(&lw->w_up, f->hidden0, f->hidden_n);
            matmul(f, s->xb, f->T, &up, s->up); /* [T, hidden_n] */
            for_each_row(f, glu_row);
        }
    }
    s->ns[FAM_PROJ] += kvref_now_ns() - t0;
}

/* x += [rms_norm](moe(xb)) (moe.c): a mixture of experts' MLP, its output in xb before the add */
static void mixture_of_experts(fw *f) {
    int64_t t0 = kvref_now_ns();
    f->s->expert_bytes += kvref_moe_run(f->pool, f->c, f->lw->moe, f->int8, f->s->xb, f->T, f->s->moe);
    f->s->ns[FAM_PROJ] += kvref_now_ns() - t0;
    t0 = kvref_now_ns();
    if (f->lw->post_ffn_norm != NULL) { /* the block's output normalised before the add */
        f->gain = f->lw->post_ffn_norm;
        f->norm_rows = f->s->xb;
        for_each_row(f, norm_row);
        f->norm_rows = NULL;
    }
    for_each_row(f, residual_row);
    f->s->ns[FAM_OTHER] += kvref_now_ns() - t0;
}

/* ---- the other steps ------------------------------------------------------------------------ */

/* x = tok_embeddings[token_ids] */
static void embed_tokens(fw *f) {
    const int64_t t0 = kvref_now_ns();
    for_each_row(f, embed_row);
    f->s->ns[FAM_OTHER] += kvref_now_ns() - t0;
}

/* xb = rms_norm(x) * gain */
static void rms_norm(fw *f, const float *gain) {
    const int64_t t0 = kvref_now_ns();
    f->gain = gain;
    f->norm_rows = NULL;
    for_each_row(f, norm_row);
    f->s->ns[FAM_OTHER] += kvref_now_ns() - t0;
}

/* q, k as the decoder makes them (biases, QK-norm, RoPE for their positions) */
static void prepare_qk(fw *f) {
    const int64_t t0 = kvref_now_ns();
    for_each_row(f, qk_row);
    f->s->ns[FAM_OTHER] += kvref_now_ns() - t0;
}

/* the attention of new queries t0 .. t0+n-1 over the first S keys of the layer in cache kv, at the
 * positions k_positions gives, into att[t0 .. t0+n) */
static kvref_attn_job attention_job(const fw *f, const kvref_kv *kv, int64_t t0, int64_t n, int64_t S,
                                    const int64_t *k_positions, float *partial) {
    const kvref_model_desc *c = f->c;
    const kvref_model *m = f->model;
    const int64_t H = c->n_heads;
    kvref_attn_job job = {.a = {.q = f->s->q + t0 * H * m->key_dim, .q_positions = f->s->q_positions + t0,
                                .k_positions = k_positions, .T = n, .H = H, .S = S, .G = H / m->cache_heads,
                                .window = f->lw->window, .scale = c->attention_scale,
                                .softcap = c->attn_softcap, .sinks = f->lw->sinks},
                          .partial = partial, .out = f->s->att + t0 * H * m->value_dim};
    kvref_kv_layer(kv, f->layer, &job.a);
    return job;
}

static void attend(fw *f, kvref_attn_job *jobs, int64_t n) {
    const int64_t start = kvref_now_ns();
    kvref_attention_run(f->pool, jobs, n);
    f->s->ns[FAM_ATTN] += kvref_now_ns() - start;
}

/* Sequence b's new rows r0 .. r1-1: k, v -> its cache at positions [length, length + n); its
 * attention, of its new queries over cache positions [0, length + n), each seeing the keys its
 * window and position allow, joins the layer's jobs. A ring layer of R slots (window W <= R) takes
 * the new positions in sub-chunks of R - W + 1: each is written, then its queries attend to the
 * ring's slots, whose positions (in `slots`) follow from the slot index and the positions written
 * so far. A later sub-chunk overwrites positions the earlier sub-chunks' queries see, so those
 * attend at once; the last one joins the jobs. `partial`: the sequence's share of the partials. */
static void store_and_attend_sequence(fw *f, int64_t b, float *partial, int64_t *slots) {
    const kvref_kv *kv = &f->caches[b];
    kvref_state *s = f->s;
    const int64_t r0 = f->bounds[b], r1 = f->bounds[b + 1], length = f->lengths[b];
    const int64_t ring = kvref_kv_ring(kv, f->layer);
    int64_t t0 = kvref_now_ns();
    if (ring == 0) {
        if (f->B == 1) for_each_row(f, store_row);
        else for (int64_t t = r0; t < r1; t++) store_row(f, t);
        if (kv->k_type == KVREF_TYPE_KIVI4) /* in position order: a group is quantized as it completes */
            kvref_kv_store_kivi_k(kv, f->kk, f->layer, length, s->k + r0 * f->c->n_kv_heads * f->c->head_dim,
                                  r1 - r0);
        s->ns[FAM_OTHER] += kvref_now_ns() - t0;
        s->jobs[s->n_jobs++] = attention_job(f, kv, r0, r1 - r0, length + r1 - r0, s->k_positions, partial);
        return;
    }
    const int64_t step = ring - f->lw->window + 1;
    for (int64_t a = r0; a < r1; a += step) {
        const int64_t e = a + step < r1 ? a + step : r1, written = length + e - r0;
        const int64_t S = written < ring ? written : ring;
        t0 = kvref_now_ns();
        for (int64_t t = a; t < e; t++) store_row(f, t);
        for (int64_t j = 0; j < S; j++) slots[j] = j + ring * ((written - 1 - j) / ring);
        s->ns[FAM_OTHER] += kvref_now_ns() - t0;
        kvref_attn_job job = attention_job(f, kv, a, e - a, S, slots, partial);
        if (e < r1) attend(f, &job, 1);
        else s->jobs[s->n_jobs++] = job;
    }
}

/* floats of attention partials for a sequence of T new positions attending to S */
static int64_t sequence_partials(const kvref_model *m, int64_t T, int64_t S) {
    return kvref_attention_partial_floats(T, m->cache_heads, m->desc.n_heads / m->cache_heads, m->value_dim, S);
}

/* every sequence's new K/V into its cache, then the attentions of all sequences in one dispatch */
static void store_and_attend(fw *f) {
    kvref_state *s = f->s;
    float *partial = s->partial;
    int64_t *slots = s->slot_positions;
    s->n_jobs = 0;
    for (int64_t b = 0; b < f->B; b++) {
        const int64_t T = f->bounds[b + 1] - f->bounds[b], S = f->lengths[b] + T;
        store_and_attend_sequence(f, b, partial, slots);
        partial += sequence_partials(f->model, T, S);
        slots += S;
    }
    attend(f, s->jobs, s->n_jobs);
}

/* ---- multi-head latent attention (MLA: DeepSeek-V2/V3) -------------------------------------------
 * kvref/spec/decoder.py's project_latent and latent_attention_block (absorbed), kernel for kernel. Legend: R
 * kv_lora_rank, Q q_lora_rank, Dr qk_rope_head_dim, Dn = D - Dr the part RoPE leaves alone, Dv
 * v_head_dim. Each new position's latent key [c_kv ; k_rope] goes in k, and store_and_attend writes and
 * reads it as any key: one kv head of R + Dr values whose first R are its value. The queries it reads
 * are the absorbed ones, [H, R + Dr] per position in q: W_UK[h]^T q_nope[h], then q_rope[h]. */

/* y = x @ W.T for T rows of x into one weight, on the decode path or the GEMM as the dense projections */
static void latent_projection(fw *f, const float *x, int which, float *y) {
    const kvref_tensor *w = projection(f->c, f->lw, which);
    if (decode_path(f, f->T, 1, &which)) {
        const kvref_mv_part none = {0};
        const kvref_mv mv = matvec(f, x, f->T, w->cols, 1, part(f, which, y, w->rows), none, none);
        kvref_mv_run(f->pool, &mv);
    } else {
        matmul(f, x, f->T, w, y);
    }
}

/* the two projections of xb: the query's first (lh = xb @ Wq_a.T, or lq = xb @ Wq.T without Q) and the
 * latent's (k = xb @ Wkv_a.T: [c_kv | k_rope] unnormalised, unrotated), one dispatch on the decode path */
static void latent_down_projections(fw *f) {
    kvref_state *s = f->s;
    const int which[2] = {f->c->q_lora_rank > 0 ? W_Q_A : W_Q, W_KV_A};
    float *y = f->c->q_lora_rank > 0 ? s->lh : s->lq;
    if (decode_path(f, f->T, 2, which)) {
        const kvref_mv_part none = {0};
        const kvref_tensor *wq = projection(f->c, f->lw, which[0]);
        const kvref_mv mv = matvec(f, s->xb, f->T, f->c->d_model, 2, part(f, which[0], y, wq->rows),
                                   part(f, W_KV_A, s->k, f->lw->wkv_a.rows), none);
        kvref_mv_run(f->pool, &mv);
    } else {
        matmul(f, s->xb, f->T, projection(f->c, f->lw, which[0]), y);
        matmul(f, s->xb, f->T, &f->lw->wkv_a, s->k);
    }
}

/* lh[t] = rms_norm(lh[t]) * q_a_norm */
static void latent_query_norm_row(const fw *f, int64_t t) {
    float *h = f->s->lh + t * f->c->q_lora_rank;
    kvref_rms_norm_row(h, f->c->q_lora_rank, f->lw->q_a_norm, f->c->latent_norm_eps, h);
}

/* row t's latent key normed and rotated in k (c_kv = rms_norm(c_kv) * kv_a_norm, k_rope turned for its
 * position), and its query heads' rotated parts (times q_rope_scale) into their absorbed queries' tails */
static void latent_rope_row(const fw *f, int64_t t) {
    const kvref_model_desc *c = f->c;
    const int64_t H = c->n_heads, D = c->head_dim, R = c->kv_lora_rank, Dr = c->qk_rope_head_dim, Dn = D - Dr;
    const double *cs = f->s->cs + (f->model->table_of[f->layer] * f->s->rows + t) * D;
    float *k = f->s->k + t * (R + Dr), *lq = f->s->lq + t * H * D, *q = f->s->q + t * H * (R + Dr);
    kvref_rms_norm_row(k, R, f->lw->kv_a_norm, c->latent_norm_eps, k);
    kvref_rope_row(k + R, 1, Dr, cs, k + R); /* one key for every head */
    for (int64_t h = 0; h < H; h++) {
        float *q_rope = q + h * (R + Dr) + R;
        kvref_rope_row(lq + h * D + Dn, 1, Dr, cs, q_rope);
        if (c->q_rope_scale != 1.0f)
            for (int64_t i = 0; i < Dr; i++) q_rope[i] = q_rope[i] * c->q_rope_scale;
    }
}

/* out[t, h, :N] = in[t, h, :K] @ W_h.T for every head h, W_h rows h*N .. of w [H*N, K], in [T, H,
 * in_stride / H], out [T, H, out_stride / H], every row of the pass at once (a batch reads each head's
 * matrix once a step): each head's rows gathered, then multiplied as kvref_matmul multiplies them (the
 * decoder's per_head_matmul) */
static void latent_per_head(fw *f, const float *in, int64_t in_stride, const kvref_tensor *w, float *out,
                            int64_t out_stride) {
    kvref_state *s = f->s;
    const int64_t T = f->T, H = f->c->n_heads, N = w->rows / H, K = w->cols;
    for (int64_t h = 0; h < H; h++) {
        for (int64_t t = 0; t < T; t++)
            memcpy(s->lx + t * K, in + t * in_stride + h * (in_stride / H), (size_t)K * sizeof(float));
        kvref_matmul_run(f->pool, s->lx, T, K, (const uint8_t *)w->data + h * N * K * (int64_t)sizeof(float),
                         KVREF_TYPE_F32, N, s->ly);
        for (int64_t t = 0; t < T; t++)
            memcpy(out + t * out_stride + h * (out_stride / H), s->ly + t * N, (size_t)N * sizeof(float));
    }
}

/* q (absorbed: [T, H, R + Dr]) and k (latent keys: [T, R + Dr]) from xb, as project_latent and
 * absorbed_queries make them */
static void latent_queries_and_keys(fw *f) {
    int64_t t0 = kvref_now_ns();
    const kvref_model_desc *c = f->c;
    kvref_state *s = f->s;
    const int64_t H = c->n_heads, R = c->kv_lora_rank, Dr = c->qk_rope_head_dim;
    latent_down_projections(f);
    if (c->q_lora_rank > 0) { /* the query through its low-rank bottleneck: lq = rms_norm(lh) @ Wq.T */
        s->ns[FAM_PROJ] += kvref_now_ns() - t0;
        t0 = kvref_now_ns();
        for_each_row(f, latent_query_norm_row);
        s->ns[FAM_OTHER] += kvref_now_ns() - t0;
        t0 = kvref_now_ns();
        latent_projection(f, s->lh, W_Q, s->lq);
    }
    latent_per_head(f, s->lq, H * c->head_dim, &f->lw->w_uk, s->q, H * (R + Dr)); /* q_nope -> W_UK^T q_nope */
    s->ns[FAM_PROJ] += kvref_now_ns() - t0;
    t0 = kvref_now_ns();
    for_each_row(f, latent_rope_row);
    s->ns[FAM_OTHER] += kvref_now_ns() - t0;
}

/* lo = each head's latent attention output through W_UV: [T, H, R] -> [T, H*Dv], the input of Wo */
static const float *latent_values(fw *f) {
    const int64_t t0 = kvref_now_ns();
    const int64_t H = f->c->n_heads;
    latent_per_head(f, f->s->att, H * f->c->kv_lora_rank, &f->lw->w_uv, f->s->lo, H * f->c->v_head_dim);
    f->s->ns[FAM_PROJ] += kvref_now_ns() - t0;
    return f->s->lo;
}

/* logits row i's KVREF_HEAD_EXACT_K largest, recomputed from xb row i with float32 activations:
 * each the single-row dot product of the exact mode (kvref.h, KVREF_ACT_INT8), on the head's row
 * unpacked from the packed copy into the thread's scratch (reading the file's rows would page in
 * the head a second time, a token's top rows at a time) */
static void exact_top_row(const fw *f, int64_t i, int thread) {
    const kvref_tensor *w = &f->c->output;
    const int64_t E = f->c->d_model, V = f->c->vocab_size, gb = kvref_pack_group_bytes(w->type, E);
    float *row = f->logits + i * V;
    const float *x = f->s->xb + i * E;
    uint8_t *unpacked = kvref_pool_scratch(f->pool, thread); /* [kvref_row_nbytes(type, E)] */
    int64_t ids[KVREF_HEAD_EXACT_K];
    const int64_t n = kvref_top_ids(row, V, KVREF_HEAD_EXACT_K, ids);
    for (int64_t j = 0; j < n; j++) {
        kvref_unpack_row(w->type, E, (const uint8_t *)w->packed + ids[j] / KVREF_PACK_ROWS * gb, (int)(ids[j] % KVREF_PACK_ROWS), unpacked);
        row[ids[j]] = f->kk->vec_dot[w->type](E, unpacked, x);
    }
}

static void exact_top_task(void *vctx, int64_t unit, int thread) {
    exact_top_row(vctx, unit, thread);
}

/* logits = rms_norm(x[rows]) @ output.T, rows = every new position, or each sequence's last one */
static void final_logits(fw *f) {
    int64_t t0 = kvref_now_ns();
    const kvref_model_desc *c = f->c;
    const int64_t E = c->d_model, V = c->vocab_size;
    kvref_state *s = f->s;
    const int64_t n = f->all_logits ? f->T : f->n_last;
    if (n == 0) return;
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = f->all_logits ? i : f->bounds[i + 1] - 1;
        kvref_rms_norm_row(s->x + t * E, E, c->output_norm, c->norm_eps, s->xb + i * E);
    }
    s->ns[FAM_OTHER] += kvref_now_ns() - t0;
    t0 = kvref_now_ns();
    if (decode_path(f, n, 1, (const int[]){W_HEAD})) {
        const kvref_mv_part none = {0};
        const kvref_mv mv = matvec(f, s->xb, n, E, 1, part(f, W_HEAD, f->logits, V), none, none);
        kvref_mv_run(f->pool, &mv);
    } else {
        matmul(f, s->xb, n, &c->output, f->logits);
    }
    if (packed(f, W_HEAD) != NULL) { /* the head's input was rounded: its likeliest tokens are made exact */
        if (n == 1) exact_top_row(f, 0, 0); /* the caller is thread 0 */
        else kvref_pool_run(f->pool, exact_top_task, (void *)f, n);
    }
    if (c->final_softcap > 0.0f) kvref_soft_cap_run(f->pool, f->logits, n * V, c->final_softcap, f->logits); /* Gemma 2 */
    s->ns[FAM_PROJ] += kvref_now_ns() - t0;
}

/* ---- model and state ------------------------------------------------------------------------ */

static int check_tensor(const kvref_tensor *t, int64_t rows, int64_t cols) {
    if (t->data == NULL) return KVREF_ERR_NULL;
    if (kvref_block_values(t->type) < 0) return KVREF_ERR_TYPE;
    if (t->rows != rows || t->cols != cols) return KVREF_ERR_SHAPE;
    const int64_t rb = kvref_row_nbytes(t->type, cols);
    if (rb < 0) return KVREF_ERR_SHAPE;
    if (rb > 0 && rows > INT64_MAX / rb) return KVREF_ERR_SIZE;
    if (t->nbytes != rows * rb) return KVREF_ERR_SIZE;
    return KVREF_OK;
}

#define KVREF_MAX_DIM (INT64_C(1) << 24) /* every config number; keeps every product below 2**63 */

/* a projection or LM head: packed, if at all, in the layout and bytes kvref_pack_int8 writes */
static int check_packed(const kvref_tensor *t) {
    if (t->packed == NULL) return KVREF_OK;
    if (!kvref_packable(t->type)) return KVREF_ERR_TYPE;
    return (uintptr_t)t->packed % 64 == 0 ? KVREF_OK : KVREF_ERR_VALUE;
}

/* a projection's shape, bytes and packed copy */
int kvref_check_projection(const kvref_tensor *t, int64_t rows, int64_t cols) {
    const int status = check_tensor(t, rows, cols);
    return status == KVREF_OK ? check_packed(t) : status;
}

/* KVREF_OK when MLA's dimensions (kv_lora_rank > 0) and layer lw's latent tensors are as kvref.h says */
static int check_latent_layer(const kvref_model_desc *c, const kvref_layer_desc *lw) {
    const int64_t E = c->d_model, H = c->n_heads, D = c->head_dim, R = c->kv_lora_rank, Q = c->q_lora_rank;
    const int64_t Dr = c->qk_rope_head_dim, Dv = c->v_head_dim;
    if (R > KVREF_MAX_DIM || Q < 0 || Q > KVREF_MAX_DIM || Dr < 2 || Dr > KVREF_MAX_DIM || Dv < 1 || Dv > KVREF_MAX_DIM)
        return KVREF_ERR_DIM;
    if (Dr % 2 != 0 || Dr >= D || c->n_kv_heads != H) return KVREF_ERR_SHAPE;
    if (!(c->latent_norm_eps >= 0.0) || isinf(c->latent_norm_eps) || !(c->q_rope_scale > 0.0f) || isinf(c->q_rope_scale))
        return KVREF_ERR_VALUE;
    if (lw->kv_a_norm == NULL || (Q > 0 && lw->q_a_norm == NULL) || lw->rope_freqs == NULL) return KVREF_ERR_NULL;
    /* the up-projections are read as float32 rows by kvref_matmul, never packed */
    if (lw->w_uk.type != KVREF_TYPE_F32 || lw->w_uv.type != KVREF_TYPE_F32 || lw->w_uk.packed != NULL ||
        lw->w_uv.packed != NULL)
        return KVREF_ERR_TYPE;
    int status = kvref_check_projection(&lw->wkv_a, R + Dr, E);
    if (status == KVREF_OK) status = kvref_check_projection(&lw->w_uk, H * R, D - Dr);
    if (status == KVREF_OK) status = kvref_check_projection(&lw->w_uv, H * Dv, R);
    if (status == KVREF_OK && Q > 0) status = kvref_check_projection(&lw->wq_a, Q, E);
    return status;
}

/* whether every tensor that has a packed form has it: the model can run int8 executions */
static int all_packed(const kvref_model_desc *c) {
    int all = 1;
    for (int64_t l = 0; l < c->n_layers; l++)
        for (int which = 0; which <= W_HEAD; which++) {
            const kvref_tensor *w = projection(c, &c->layers[l], which);
            all &= !kvref_packable(w->type) || w->packed != NULL;
        }
    for (int64_t l = 0; l < c->n_layers; l++) all &= c->layers[l].moe == NULL || kvref_moe_packed_all(&c->layers[l]);
    return all;
}

int kvref_model_create(const kvref_model_desc *desc, kvref_model **out) {
    if (out == NULL) return KVREF_ERR_NULL;
    *out = NULL;
    if (desc == NULL || desc->layers == NULL || desc->output_norm == NULL) return KVREF_ERR_NULL;
    const kvref_model_desc *c = desc;
    const int64_t dims[] = {c->n_layers, c->d_model, c->n_heads, c->n_kv_heads, c->head_dim, c->d_ff, c->vocab_size};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i] < 1 || dims[i] > KVREF_MAX_DIM) return KVREF_ERR_DIM;
    if (c->n_heads % c->n_kv_heads != 0 || c->head_dim % 2 != 0) return KVREF_ERR_SHAPE;
    if (!(c->norm_eps >= 0.0) || isinf(c->norm_eps) || !(c->embedding_scale > 0.0f) || isinf(c->embedding_scale)
        || !(c->attention_scale > 0.0f) || isinf(c->attention_scale)
        || !(c->attn_softcap >= 0.0f) || isinf(c->attn_softcap) || !(c->final_softcap >= 0.0f) || isinf(c->final_softcap)
        || (c->gate != KVREF_GATE_SILU && c->gate != KVREF_GATE_GELU_TANH && c->gate != KVREF_GATE_SWIGLU_OAI))
        return KVREF_ERR_VALUE;
    const int64_t E = c->d_model, QD = c->n_heads * c->head_dim, KVD = c->n_kv_heads * c->head_dim, F = c->d_ff;
    const int latent = c->kv_lora_rank > 0; /* MLA (negative: refused below) */
    const int64_t rope_dim = latent ? c->qk_rope_head_dim : c->head_dim;
    const int64_t WO = latent ? c->n_heads * c->v_head_dim : QD; /* Wo's input width */
    if (c->kv_lora_rank < 0) return KVREF_ERR_DIM;
    int status = check_tensor(&c->tok_embeddings, c->vocab_size, E);
    if (status == KVREF_OK && c->router.n_experts > 0) { /* a mixture of experts: its router and widths */
        status = kvref_router_check(&c->router);
        if (c->expert_d_ff < 1 || c->expert_d_ff > KVREF_MAX_DIM || c->shared_d_ff < 0 || c->shared_d_ff > KVREF_MAX_DIM)
            status = KVREF_ERR_DIM;
    }
    if (status == KVREF_OK) status = check_tensor(&c->output, c->vocab_size, E);
    if (status == KVREF_OK) status = c->tok_embeddings.packed == NULL ? check_packed(&c->output) : KVREF_ERR_VALUE;
    for (int64_t l = 0; status == KVREF_OK && l < c->n_layers; l++) {
        const kvref_layer_desc *lw = &c->layers[l];
        if (lw->attn_norm == NULL || lw->ffn_norm == NULL) return KVREF_ERR_NULL;
        /* the optional fields come in their groups: all three biases, both QK-norms, both sandwich norms */
        if ((lw->bq == NULL) != (lw->bk == NULL) || (lw->bq == NULL) != (lw->bv == NULL)
            || (lw->q_norm == NULL) != (lw->k_norm == NULL) || (lw->post_attn_norm == NULL) != (lw->post_ffn_norm == NULL))
            return KVREF_ERR_NULL;
        if (lw->window < 0) return KVREF_ERR_VALUE;
        status = latent ? check_latent_layer(c, lw) : kvref_check_projection(&lw->wk, KVD, E);
        if (status == KVREF_OK && !latent) status = kvref_check_projection(&lw->wv, KVD, E);
        if (status != KVREF_OK) return status;
        for (int64_t i = 0; lw->rope_freqs != NULL && i < rope_dim / 2; i++)
            if (!isfinite(lw->rope_freqs[i])) return KVREF_ERR_VALUE;
        const struct { const kvref_tensor *t; int64_t rows, cols; } expect[] = {
            {&lw->wq, QD, latent && c->q_lora_rank > 0 ? c->q_lora_rank : E}, {&lw->wo, E, WO},
            {&lw->w_gate, F, E}, {&lw->w_up, F, E}, {&lw->w_down, E, F}};
        const size_t n = lw->moe != NULL ? 2 : sizeof expect / sizeof expect[0]; /* a mixture: no dense MLP */
        for (size_t i = 0; status == KVREF_OK && i < n; i++)
            status = kvref_check_projection(expect[i].t, expect[i].rows, expect[i].cols);
        if (status == KVREF_OK && lw->moe != NULL) status = kvref_moe_check(c, lw);
    }
    if (status != KVREF_OK) return status;

    kvref_model *m = calloc(1, sizeof *m);
    if (m == NULL) return KVREF_ERR_NOMEM;
    m->layers = malloc((size_t)c->n_layers * sizeof *m->layers);
    if (m->layers == NULL) {
        free(m);
        return KVREF_ERR_NOMEM;
    }
    m->table_of = malloc((size_t)c->n_layers * sizeof *m->table_of);
    if (m->table_of == NULL) {
        kvref_model_destroy(m);
        return KVREF_ERR_NOMEM;
    }
    memcpy(m->layers, c->layers, (size_t)c->n_layers * sizeof *m->layers);
    for (int64_t l = 0; l < c->n_layers; l++) { /* layers with equal frequencies share their cos/sin */
        int64_t first = 0;
        if (c->layers[l].rope_freqs == NULL) { /* NoPE: no table */
            m->table_of[l] = -1;
            continue;
        }
        while (first < l && (c->layers[first].rope_freqs == NULL ||
                             memcmp(c->layers[first].rope_freqs, c->layers[l].rope_freqs,
                                    (size_t)(rope_dim / 2) * sizeof(double)) != 0))
            first++;
        m->table_of[l] = first < l ? m->table_of[first] : m->n_tables++;
    }
    m->desc = *c;
    m->desc.layers = m->layers;
    const int64_t widths[] = {E, QD, F, c->q_lora_rank, c->kv_lora_rank, WO, c->expert_d_ff, c->shared_d_ff};
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++) m->max_k = widths[i] > m->max_k ? widths[i] : m->max_k;
    m->cache_heads = latent ? 1 : c->n_kv_heads;
    m->key_dim = latent ? c->kv_lora_rank + c->qk_rope_head_dim : c->head_dim;
    m->value_dim = latent ? c->kv_lora_rank : c->head_dim;
    m->rope_dim = rope_dim;
    m->int8 = all_packed(c);
    *out = m;
    return KVREF_OK;
}

void kvref_model_destroy(kvref_model *model) {
    if (model == NULL) return;
    free(model->layers);
    free(model->table_of);
    free(model);
}

/* n items of `size` bytes, 64-byte aligned (released with kvref_aligned_free) */
static void *alloc_aligned(int64_t n, size_t size) { return kvref_aligned_alloc((size_t)n * size); }
static void *alloc_floats(int64_t n) { return alloc_aligned(n, sizeof(float)); }

static void free_rows(kvref_state *s) {
    void *floats[] = {s->x, s->xb, s->blocks}; /* alloc_floats's */
    for (size_t i = 0; i < sizeof floats / sizeof floats[0]; i++) kvref_aligned_free(floats[i]);
    void *lists[] = {s->cs, s->q_positions, s->row_seq};
    for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++) free(lists[i]);
    s->x = s->xb = s->blocks = s->q = s->k = s->v = s->att = s->gate = s->up = s->lq = s->lh = s->lo = s->lx = s->ly =
        NULL;
    s->cs = NULL;
    s->q_positions = s->row_seq = NULL;
    s->rows = 0;
}

int kvref_state_create(const kvref_model *model, kvref_state **out) {
    if (out == NULL) return KVREF_ERR_NULL;
    *out = NULL;
    if (model == NULL) return KVREF_ERR_NULL;
    kvref_state *s = calloc(1, sizeof *s);
    if (s == NULL) return KVREF_ERR_NOMEM;
    s->model = model;
    s->fail_layer = -1;
    *out = s;
    return KVREF_OK;
}

void kvref_state_destroy(kvref_state *state) {
    if (state == NULL) return;
    free_rows(state);
    void *grown[] = {state->k_positions, state->slot_positions, state->partial, state->jobs, state->parts}; /* grow's */
    for (size_t i = 0; i < sizeof grown / sizeof grown[0]; i++) kvref_aligned_free(grown[i]);
    kvref_moe_state_destroy(state->moe);
    free(state);
}


/* *p, holding *have items of `size` bytes, grown to at least `need` (to twice as many as it held,
 * if more); its contents are not kept. KVREF_OK, or KVREF_ERR_NOMEM with *p as it was. */
static int grow(void **p, int64_t *have, int64_t need, size_t size) {
    if (need <= *have) return KVREF_OK;
    const int64_t n = need > 2 * *have ? need : 2 * *have;
    void *q = alloc_aligned(n, size);
    if (q == NULL) return KVREF_ERR_NOMEM;
    kvref_aligned_free(*p);
    *p = q;
    *have = n;
    return KVREF_OK;
}

/* floats of n buffers of sizes[i] floats laid out one after the other, each 64-byte aligned */
static int64_t laid_out_floats(const int64_t *sizes, int n) {
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += (sizes[i] + 15) / 16 * 16;
    return total;
}

/* *bufs[i] = buffer i of that layout from base */
static void lay_out(float *base, float **const *bufs, const int64_t *sizes, int n) {
    for (int i = 0; i < n; i++) {
        *bufs[i] = base;
        base += (sizes[i] + 15) / 16 * 16;
    }
}

/* Grow the buffers to the execution of B sequences (rows bounds, cache lengths) of T rows in all,
 * attending to at most S positions each (never shrinks them). */
static int state_reserve(kvref_state *s, int64_t T, int64_t S, int64_t B, const int64_t *bounds,
                         const int64_t *lengths) {
    const kvref_model *m = s->model;
    const kvref_model_desc *c = &m->desc;
    const int64_t E = c->d_model, H = c->n_heads, QD = H * c->head_dim, KVD = m->cache_heads * m->key_dim;
    const int latent = c->kv_lora_rank > 0; /* MLA's buffers (kvref_state), one float each otherwise */
    const int64_t R = c->kv_lora_rank, Dn = c->head_dim - c->qk_rope_head_dim, Dv = c->v_head_dim;
    if (T > s->rows) { /* at most a pass's rows: more would never be used */
        const int64_t grown = T > 2 * s->rows ? T : 2 * s->rows, rows = grown < KVREF_PASS_ROWS ? grown : KVREF_PASS_ROWS;
        free_rows(s);
        s->x = alloc_floats(rows * E);
        s->xb = alloc_floats(rows * E);
        float **const attention[] = {&s->q, &s->k, &s->v, &s->att, &s->lq, &s->lh, &s->lo, &s->lx, &s->ly};
        const int64_t attention_floats[] = {rows * H * m->key_dim, rows * KVD, latent ? 0 : rows * KVD,
                                            rows * H * m->value_dim, latent ? rows * QD : 0,
                                            latent ? rows * c->q_lora_rank : 0, latent ? rows * H * Dv : 0,
                                            latent ? rows * (Dn > R ? Dn : R) : 0, latent ? rows * (Dv > R ? Dv : R) : 0};
        float **const mlp[] = {&s->gate, &s->up};
        const int64_t mlp_floats[] = {rows * c->d_ff, rows * c->d_ff < KVREF_UP_FLOATS ? rows * c->d_ff : KVREF_UP_FLOATS};
        const int64_t a = laid_out_floats(attention_floats, 9), b = laid_out_floats(mlp_floats, 2);
        s->blocks = alloc_floats(a > b ? a : b);
        if (s->blocks != NULL) {
            lay_out(s->blocks, attention, attention_floats, 9);
            lay_out(s->blocks, mlp, mlp_floats, 2);
        }
        s->cs = malloc((size_t)((s->model->n_tables > 0 ? s->model->n_tables : 1) * rows * c->head_dim) * sizeof(double));
        s->q_positions = malloc((size_t)rows * sizeof(int64_t));
        s->row_seq = malloc((size_t)rows * sizeof(int64_t));
        if (!s->x || !s->xb || !s->blocks || !s->cs || !s->q_positions || !s->row_seq) {
            free_rows(s);
            return KVREF_ERR_NOMEM;
        }
        s->rows = rows;
    }
    if (S > s->keys) {
        if (grow((void **)&s->k_positions, &s->keys, S, sizeof(int64_t)) != KVREF_OK) return KVREF_ERR_NOMEM;
        for (int64_t i = 0; i < s->keys; i++) s->k_positions[i] = i;
    }
    /* a ring layer's keys are at most its sequence's written positions, and a sequence's partials
     * those of its new positions over all its positions */
    int64_t slots = 0, partials = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = bounds[b + 1] - bounds[b];
        slots += lengths[b] + n;
        partials += sequence_partials(s->model, n, lengths[b] + n);
    }
    if (grow((void **)&s->slot_positions, &s->ring_keys, slots, sizeof(int64_t)) != KVREF_OK ||
        grow((void **)&s->partial, &s->partial_floats, partials, sizeof(float)) != KVREF_OK ||
        grow((void **)&s->jobs, &s->max_jobs, B, sizeof(kvref_attn_job)) != KVREF_OK ||
        kvref_moe_reserve(&s->moe, c, T) != KVREF_OK)
        return KVREF_ERR_NOMEM;
    return KVREF_OK;
}

void kvref_state_timings(const kvref_state *state, int64_t *out) {
    if (state == NULL || out == NULL) return;
    for (int i = 0; i < 3; i++) out[i] = state->ns[i];
    out[3] = state->calls;
    out[4] = state->expert_bytes;
}

void kvref_state_reset_timings(kvref_state *state) {
    if (state == NULL) return;
    for (int i = 0; i < 3; i++) state->ns[i] = 0;
    state->calls = 0;
    state->expert_bytes = 0;
}

int kvref_state_fail_at_layer(kvref_state *state, int64_t layer) {
    if (state == NULL) return KVREF_ERR_NULL;
    if (layer < -1 || layer >= state->model->desc.n_layers) return KVREF_ERR_VALUE;
    state->fail_layer = layer;
    return KVREF_OK;
}

/* ---- the forward ---------------------------------------------------------------------------- */

int kvref_forward(kvref_pool *pool, const kvref_model *model, kvref_state *state, const int64_t *token_ids,
                  int64_t T, const kvref_kv *cache, int64_t length, int32_t activations, int32_t all_logits,
                  float *logits) {
    if (T < 1 || T > KVREF_MAX_DIM) return KVREF_ERR_DIM;
    const int64_t bounds[2] = {0, T};
    return kvref_forward_batch(pool, model, state, token_ids, bounds, 1, cache, &length, activations, all_logits,
                               logits);
}

/* KVREF_OK when every sequence's rows, cache and length are a valid execution; *T and *S: rows in
 * all, and the most positions any sequence attends to */
static int check_batch(const kvref_model *model, const int64_t *bounds, int64_t B, const kvref_kv *caches,
                       const int64_t *lengths, int64_t *T, int64_t *S) {
    const kvref_model_desc *c = &model->desc;
    if (B < 1 || B > KVREF_MAX_DIM) return KVREF_ERR_DIM;
    if (bounds == NULL || caches == NULL || lengths == NULL) return KVREF_ERR_NULL;
    if (bounds[0] != 0) return KVREF_ERR_VALUE;
    *S = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = bounds[b + 1] - bounds[b], length = lengths[b];
        if (n < 1 || bounds[b + 1] > KVREF_MAX_DIM || length < 0 || length > KVREF_MAX_DIM) return KVREF_ERR_DIM;
        int status = kvref_kv_check(&caches[b], c->n_layers, model->cache_heads, model->key_dim, length + n); /* room */
        if (status != KVREF_OK) return status;
        if (c->kv_lora_rank > 0 && (caches[b].v != caches[b].k || caches[b].v_type != caches[b].k_type ||
                                    caches[b].v_scales != caches[b].k_scales || caches[b].v_dim != c->kv_lora_rank))
            return KVREF_ERR_SHAPE; /* a latent cache's V is its K's first R values */
        for (int64_t l = 0; l < c->n_layers; l++) { /* a ring keeps a window's positions, or it loses keys */
            const int64_t ring = kvref_kv_ring(&caches[b], l), window = c->layers[l].window;
            if (ring > 0 && (window == 0 || window > ring)) return KVREF_ERR_VALUE;
        }
        *S = length + n > *S ? length + n : *S;
    }
    *T = bounds[B];
    return KVREF_OK;
}

/* One pass: f's rows (at most KVREF_PASS_ROWS), as kvref_forward_batch of those rows alone; S: the
 * most positions any sequence of the whole execution attends to. Called with the pool locked. */
static int forward_pass(fw *f, int64_t S) {
    kvref_state *state = f->s;
    const kvref_model_desc *c = f->c;
    const int64_t T = f->T;
    const int64_t t_start = kvref_now_ns();
    int status = state_reserve(state, T, S, f->B, f->bounds, f->lengths);
    if (status == KVREF_OK) { /* tiles of the prefill GEMM */
        const size_t scratch = f->int8 ? kvref_matmul_int8_scratch_bytes(T, f->model->max_k)
                                       : kvref_matmul_scratch_bytes(T, f->model->max_k);
        const kvref_model *m = f->model;
        const size_t attn = kvref_attention_scratch_bytes(c->n_heads, c->n_heads / m->cache_heads, m->key_dim);
        const size_t head_row = (size_t)kvref_row_nbytes(c->output.type, c->d_model); /* exact_top_row's */
        const size_t most = scratch > attn ? scratch : attn;
        status = kvref_pool_reserve(f->pool, most > head_row ? most : head_row);
    }
    if (status == KVREF_OK && f->int8 && /* x in 8 bits */
        kvref_pool_shared(f->pool, kvref_matmul_int8_shared_bytes(T, f->model->max_k)) == NULL)
        status = KVREF_ERR_NOMEM;
    if (status != KVREF_OK) return status;
    for (int64_t b = 0; b < f->B; b++)
        for (int64_t t = f->bounds[b]; t < f->bounds[b + 1]; t++) {
            state->q_positions[t] = f->lengths[b] + t - f->bounds[b];
            state->row_seq[t] = b;
        }
    for (int64_t l = 0, seen = 0; l < c->n_layers; l++) { /* RoPE angles once per position and distinct table */
        const int64_t table = f->model->table_of[l];
        if (table < seen) continue; /* tables are numbered as layers first use them (NoPE layers: -1) */
        seen++;
        for (int64_t t = 0; t < T; t++)
            kvref_rope_cos_sin(f->model->rope_dim, c->layers[l].rope_freqs, state->q_positions[t],
                               state->cs + (table * state->rows + t) * c->head_dim);
    }
    state->ns[FAM_OTHER] += kvref_now_ns() - t_start;

    const int latent = c->kv_lora_rank > 0;
    embed_tokens(f);                                      /* x = tok_embeddings[token_ids] */
    for (f->layer = 0; f->layer < c->n_layers; f->layer++) {
        if (f->layer == state->fail_layer) { /* the test hook: layers < f->layer are written, no more */
            state->fail_layer = -1;
            return KVREF_ERR_INJECTED;
        }
        f->lw = &c->layers[f->layer];
        /* attention block: x += attention(new queries, cached + new K/V) @ Wo.T */
        rms_norm(f, f->lw->attn_norm);                    /* xb = rms_norm(x) * attn_norm */
        if (latent) {
            latent_queries_and_keys(f);                   /* MLA: absorbed queries q, latent keys k */
        } else {
            qkv_projections(f);                           /* q, k, v = xb @ Wq.T, xb @ Wk.T, xb @ Wv.T */
            prepare_qk(f);                                /* + biases; q, k: QK-norm, rotated for their positions */
        }
        store_and_attend(f);                              /* k, v -> cache; att = softmax(q . K * scale) V, by position */
        /* x += [norm](att @ Wo.T + bo); MLA: att through each head's W_UV first */
        residual_projection(f, latent ? latent_values(f) : state->att, W_O, f->lw->bo, f->lw->post_attn_norm);
        /* MLP block: x += act(...) @ Wd.T, position by position */
        rms_norm(f, f->lw->ffn_norm);                     /* xb = rms_norm(x) * ffn_norm */
        if (f->lw->moe != NULL) {
            mixture_of_experts(f);                        /* x += [norm](the routed experts' weighted sum [+ shared]) */
            continue;
        }
        gate_up_projections(f);                           /* gate = act(xb @ Wg.T) * (xb @ Wu.T) */
        residual_projection(f, state->gate, W_DOWN, NULL, f->lw->post_ffn_norm); /* x += [norm](gate @ Wd.T) */
    }
    final_logits(f);                                      /* logits = rms_norm(x) @ output.T */
    return KVREF_OK;
}

int kvref_forward_batch(kvref_pool *pool, const kvref_model *model, kvref_state *state, const int64_t *token_ids,
                        const int64_t *bounds, int64_t B, const kvref_kv *caches, const int64_t *lengths,
                        int32_t activations, int32_t all_logits, float *logits) {
    if (pool == NULL || model == NULL || state == NULL) return KVREF_ERR_NULL;
    if (state->model != model) return KVREF_ERR_VALUE;
    const kvref_model_desc *c = &model->desc;
    int64_t T = 0, S = 0;
    int status = check_batch(model, bounds, B, caches, lengths, &T, &S);
    if (status != KVREF_OK) return status;
    if ((activations != KVREF_ACT_F32 && activations != KVREF_ACT_INT8) || (all_logits != 0 && all_logits != 1))
        return KVREF_ERR_VALUE;
    if (activations == KVREF_ACT_INT8 && !model->int8) return KVREF_ERR_VALUE; /* its weights are not packed */
    if (token_ids == NULL || logits == NULL) return KVREF_ERR_NULL;
    for (int64_t t = 0; t < T; t++)
        if (token_ids[t] < 0 || token_ids[t] >= c->vocab_size) return KVREF_ERR_VALUE;

    if (grow((void **)&state->parts, &state->part_slots, 2 * (B + 1), sizeof(int64_t)) != KVREF_OK)
        return KVREF_ERR_NOMEM;
    int64_t *part_bounds = state->parts, *part_lengths = state->parts + B + 1;

    /* Passes of near-equal size, at most KVREF_PASS_ROWS rows each: every pass is the execution of
     * its rows (its part of each sequence, from the cache length the part starts at), so the row
     * buffers hold a pass, not the whole prompt, and each pass has as many rows as the GEMM needs. */
    const int64_t passes = (T + KVREF_PASS_ROWS - 1) / KVREF_PASS_ROWS, rows = (T + passes - 1) / passes;
    kvref_pool_lock(pool);
    const fw whole = {.pool = pool, .kk = kvref_pool_kernels(pool), .c = c, .s = state, .int8 = activations ==
                      KVREF_ACT_INT8, .all_logits = all_logits, .glu = kvref_gate_fn(kvref_pool_kernels(pool), c->gate),
                      .model = model};
    for (int64_t r0 = 0, b0 = 0; r0 < T && status == KVREF_OK; r0 += rows) {
        const int64_t r1 = r0 + rows < T ? r0 + rows : T;
        while (bounds[b0 + 1] <= r0) b0++;
        int64_t n = 0;
        for (int64_t b = b0; b < B && bounds[b] < r1; b++, n++) {
            part_bounds[n] = (bounds[b] > r0 ? bounds[b] : r0) - r0;
            part_lengths[n] = lengths[b] + (r0 > bounds[b] ? r0 - bounds[b] : 0);
        }
        part_bounds[n] = r1 - r0;
        fw f = whole;
        f.token_ids = token_ids + r0;
        f.T = r1 - r0;
        f.B = n;
        f.bounds = part_bounds;
        f.caches = caches + b0;
        f.lengths = part_lengths;
        f.logits = logits + (all_logits ? r0 : b0) * c->vocab_size;
        f.n_last = bounds[b0 + n] > r1 ? n - 1 : n; /* the last part's sequence may go on in the next pass */
        status = forward_pass(&f, S);
    }
    if (status == KVREF_OK) state->calls++;
    kvref_pool_unlock(pool);
    return status;
}
