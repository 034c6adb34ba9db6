/* kvref.h: the whole C API of kvref's native kernels.
 *
 * This file is also the cffi cdef: kvref/native/build.py feeds it to ffibuilder.cdef() with every
 * preprocessor line removed, so everything between the include guard must stay plain C
 * declarations (enums, typedefs, prototypes) that cffi's parser accepts.
 *
 * Shape legend (as in kvref/spec/ops.py):
 *   T new positions    S positions attended to (cached + new)    H query heads    Hkv kv heads
 *   D head_dim         E d_model (or any row width)              N output rows    K input columns
 *
 * Conventions, for every function:
 *   - the caller allocates every output; nothing here allocates memory the caller must free,
 *     except the pool, which kvref_pool_destroy() releases;
 *   - dimensions are int64_t and row-major (C order), with the shape written beside each pointer;
 *   - the return value is a kvref_status; on any status but KVREF_OK the outputs are unspecified
 *     but no memory outside them was written. Nothing calls exit() or abort();
 *   - matrices are in file layout: a weight is [N, K] (out x in), so y = x @ W.T;
 *   - a call with a zero dimension does nothing and returns KVREF_OK.
 *
 * Results are deterministic for a given pool (thread count and instruction set), and identical
 * across thread counts: work is split over output rows (matmul) or over (query, kv head, key
 * segment) units whose boundaries depend only on the shapes, so every output element is computed
 * by the same sequence of floating-point operations whichever thread runs it.
 */
#ifndef KVREF_H
#define KVREF_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum kvref_status {
    KVREF_OK = 0,
    KVREF_ERR_NULL = 1,        /* a required pointer is NULL */
    KVREF_ERR_DIM = 2,         /* a dimension is negative or out of range */
    KVREF_ERR_SHAPE = 3,       /* dimensions disagree with each other or with a block size */
    KVREF_ERR_TYPE = 4,        /* a tensor type the kernel does not implement */
    KVREF_ERR_SIZE = 5,        /* a byte count does not match the dimensions and type */
    KVREF_ERR_NOMEM = 6,       /* scratch memory could not be allocated */
    KVREF_ERR_THREAD = 7,      /* a worker thread could not be started */
    KVREF_ERR_ISA = 8,         /* the requested instruction set is not available on this CPU/build */
    KVREF_ERR_VALUE = 9,       /* a scalar argument is out of range (a position < 0, eps < 0, ...) */
    KVREF_ERR_INJECTED = 10    /* a failure armed by kvref_state_fail_at_layer (a test hook) */
};

/* Instruction sets a pool can run its kernels with; chosen at run time from CPU detection. */
enum kvref_isa {
    KVREF_ISA_AUTO = -1,       /* the best this CPU supports */
    KVREF_ISA_SCALAR = 0,      /* portable C (the reference loops) */
    KVREF_ISA_AVX2 = 1,        /* x86-64 AVX2 + FMA + F16C */
    KVREF_ISA_AVX512 = 2,      /* x86-64 AVX-512 F/BW/VL/DQ (+ AVX2 + FMA + F16C) */
    KVREF_ISA_NEON = 3,        /* aarch64 Advanced SIMD (every ARMv8-A CPU) */
    KVREF_ISA_NEON_DOTPROD = 4, /* aarch64 NEON + the 8-bit dot product (sdot, FEAT_DotProd) */
    KVREF_ISA_NEON_I8MM = 5    /* aarch64 NEON + sdot + the 8-bit matrix multiply (smmla, FEAT_I8MM) */
};

/* Tensor types, numbered as GGML/GGUF number them (kvref.formats.ggml.GGMLType). */
enum kvref_type {
    KVREF_TYPE_F32 = 0,
    KVREF_TYPE_F16 = 1,
    KVREF_TYPE_Q4_0 = 2,
    KVREF_TYPE_Q4_1 = 3,
    KVREF_TYPE_Q5_0 = 6,
    KVREF_TYPE_Q8_0 = 8,
    KVREF_TYPE_Q4_K = 12,
    KVREF_TYPE_Q6_K = 14,
    KVREF_TYPE_I8 = 24,        /* K/V only: int8 elements, each group read as value * its float32 scale */
    KVREF_TYPE_KIVI4 = 25,     /* K/V only: 4-bit KIVI, two unsigned nibbles a byte, read as q * scale + zero */
    KVREF_TYPE_BF16 = 30,
    KVREF_TYPE_MXFP4 = 39      /* 32 values: an E8M0 scale byte, 16 bytes of 4-bit E2M1 codes (gpt-oss experts) */
};

/* A persistent pool of worker threads plus the instruction set its kernels use. The calling
 * thread is one of the n_threads; n_threads - 1 workers are started. Kernel calls on one pool
 * are serialised by the pool (one call runs at a time); separate pools are independent. */
typedef struct kvref_pool kvref_pool;

/* n_threads in [1, 1024]; isa one of kvref_isa. On success *out owns the pool. */
int kvref_pool_create(int64_t n_threads, int32_t isa, kvref_pool **out);
/* Stops and joins the workers, frees the pool. NULL is allowed. */
void kvref_pool_destroy(kvref_pool *pool);
int64_t kvref_pool_threads(const kvref_pool *pool);
int32_t kvref_pool_isa(const kvref_pool *pool);

/* 1 if this CPU and this build can run `isa` (KVREF_ISA_AUTO: always 1), else 0. */
int32_t kvref_isa_supported(int32_t isa);
/* The instruction set KVREF_ISA_AUTO resolves to on this CPU. */
int32_t kvref_isa_best(void);
/* Bytes of one row of k values of `type`; -1 if the type is not implemented or k is not a whole
 * number of blocks. */
int64_t kvref_row_nbytes(int32_t type, int64_t k);
/* Values per block of `type` (1 for F32/F16/BF16); -1 if not implemented. */
int64_t kvref_block_values(int32_t type);
/* A static, human-readable description of a status code. */
const char *kvref_status_string(int32_t status);

/* y = x @ W.T, W stored in `w_type` blocks, rows contiguous, read in place.
 *   x:  float32 [T, K]
 *   w:  bytes   [N, kvref_row_nbytes(w_type, K)], w_nbytes in total
 *   y:  float32 [T, N] (must not overlap x or w)
 * K must be a whole number of blocks of w_type. */
int kvref_matmul(kvref_pool *pool,
                 const float *x, int64_t T, int64_t K,
                 const void *w, int32_t w_type, int64_t w_nbytes, int64_t N,
                 float *y);

/* A mixture of experts' projection: y[r] = x[r] @ W_e.T with e = experts[r], W a stack of X matrices
 * [N, K] in `w_type` blocks, expert after expert, read in place. The rows naming one expert are taken
 * together (in ascending row order) and multiplied as kvref_matmul multiplies them, so each expert named
 * is read once per call, an expert no row names is never read, and y[r] is kvref_matmul's row for r
 * among its expert's rows.
 *   x:       float32 [R, K]
 *   experts: int64   [R], each in [0, X) (KVREF_ERR_VALUE otherwise, before anything is read)
 *   w:       bytes   [X, N, kvref_row_nbytes(w_type, K)], w_nbytes in total
 *   y:       float32 [R, N] (must not overlap x or w)
 * Scratch for the grouped rows is allocated per call (KVREF_ERR_NOMEM if it cannot be). */
int kvref_matmul_experts(kvref_pool *pool,
                         const float *x, int64_t R, int64_t K, const int64_t *experts,
                         const void *w, int32_t w_type, int64_t w_nbytes, int64_t X, int64_t N,
                         float *y);

/* The projection of the int8 activation mode: y = x~ @ W.T, where each row of x is first rounded
 * to blocks of 32 int8 values, x~[j] = d_b * q[j] with d_b = max_{j in b} |x[j]| / 127 and
 * q[j] = rint(x[j] * (1 / d_b)), and the dot products are computed in integers per block; a block
 * offset m (Q4_1's, Q4_K's) multiplies x~'s block sum d_b * sum q[j], so y is x~ @ W.T up to float32
 * rounding, for Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K weights. Each output is the sum over blocks
 * b (the K-quants' sub-blocks of 32 and 16 values), in order, of fl(d_x d_w) I_b and then (with an
 * offset) m_w s_x, each a fused multiply-add into a float32 sum, I_b the exact integer dot product:
 * bit for bit whatever T, the instruction set or the thread count (from KVREF_GEMM_Q8_MIN_T rows
 * of x on, with the scalar kernels, AVX-512 VNNI or NEON sdot/smmla, as an integer GEMM on 8-bit
 * tiles, else on weights packed per call as kvref_pack_int8 packs them). Every other weight type gives exactly
 * kvref_matmul's result. Arguments as kvref_matmul. */
int kvref_matmul_int8(kvref_pool *pool,
                      const float *x, int64_t T, int64_t K,
                      const void *w, int32_t w_type, int64_t w_nbytes, int64_t N,
                      float *y);

/* The read-bandwidth probe of `kvref bench`: every byte of buf [nbytes] (a whole number of
 * KVREF_PROBE_UNIT units) read once by the pool's threads, a unit at a time as projections stream
 * weights, with the instruction set's widest vector loads; *checksum = the wrapping sum of its
 * 64-bit words, so no load can be skipped. */
enum { KVREF_PROBE_UNIT = 1048576 };

/* From this many rows of x on, a projection dequantizes tiles of weight rows for a GEMM (each weight
 * block decoded once per call); below it, each weight row is decoded in registers once for all rows
 * of x (the decode path, batched decode included). Chosen by shape (rows of x, activation mode),
 * never by thread count, from measurements on SmolLM2's and Gemma 3's shapes (docs/benchmarks.md):
 * up to 8 rows (one call of the multi-row float dot kernels) decoding in registers is as fast as
 * the GEMM on SmolLM2 and faster on Gemma 3; at 16 rows, where the dot kernels decode each weight
 * twice, the GEMM is faster on both. With int8 activations the 8-bit weight types give the
 * same sums on either side (kvref_matmul_int8): the switch only chooses the tile GEMM over packing
 * per call, and the fused forward runs its packed copies at every T. */
enum { KVREF_GEMM_MIN_T = 9, KVREF_GEMM_Q8_MIN_T = 9 };
int kvref_read_probe(kvref_pool *pool, const void *buf, int64_t nbytes, uint64_t *checksum);

/* out[t] = row ids[t] of the table, dequantized to float32.
 *   table: bytes   [V, kvref_row_nbytes(type, E)], table_nbytes in total
 *   ids:   int64   [T], each in [0, V)
 *   out:   float32 [T, E] */
int kvref_embed(kvref_pool *pool,
                const void *table, int32_t type, int64_t table_nbytes, int64_t V, int64_t E,
                const int64_t *ids, int64_t T,
                float *out);

/* out = x / sqrt(mean(x**2) + eps) * weight, row by row (the mean square accumulated in double).
 *   x:      float32 [T, E]
 *   weight: float32 [E]
 *   out:    float32 [T, E] (may be x itself) */
int kvref_rms_norm(kvref_pool *pool,
                   const float *x, int64_t T, int64_t E,
                   const float *weight, double eps,
                   float *out);

/* Rotary embedding on adjacent pairs: (x[2i], x[2i+1]) of each head at position p turns by
 * p * inv_freq[i], computed in double and rounded once. inv_freq is the frequency table of
 * kvref.spec.ops.rope_frequencies (theta ** (-2i/D), stretched by any RoPE scaling), so a plain
 * base, linear and Llama 3 scaling, and each layer's own base are one mechanism.
 *   x:         float32 [T, nh, D], D even
 *   positions: int64   [T] (any values: the angle is position * frequency, in double)
 *   inv_freq:  float64 [D/2], finite
 *   out:       float32 [T, nh, D] (may be x itself) */
int kvref_rope(kvref_pool *pool,
               const float *x, int64_t T, int64_t nh, int64_t D,
               const int64_t *positions, const double *inv_freq,
               float *out);

/* out = silu(gate) * up, silu(g) = g * sigmoid(g).
 *   gate, up, out: float32 [n] (out may be gate or up) */
int kvref_swiglu(kvref_pool *pool,
                 const float *gate, const float *up, int64_t n,
                 float *out);

/* out = gelu_tanh(gate) * up, gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) as
 * kvref.spec.ops.gelu_tanh computes it (Gemma's GeGLU). The SIMD kernels compute the same function
 * as g / (1 + exp(-2y)); tests/test_native.py states the bound against the spec.
 *   gate, up, out: float32 [n] (out may be gate or up) */
int kvref_geglu(kvref_pool *pool,
                const float *gate, const float *up, int64_t n,
                float *out);

/* out = min(g, 7) sigmoid(1.702 min(g, 7)) (clamp(up, -7, 7) + 1): gpt-oss's clamped SwiGLU, as
 * kvref.spec.ops.swiglu_oai computes it (a NaN stays NaN through the clamps).
 *   gate, up, out: float32 [n] (out may be gate or up) */
int kvref_swiglu_oai(kvref_pool *pool,
                     const float *gate, const float *up, int64_t n,
                     float *out);

/* A mixture of experts' router (kvref.spec.ops.route): how each position's router logits choose its
 * k experts and weigh them. The fields of ModelConfig's mixture (router_score, n_expert_groups, ...). */
enum kvref_router_score {
    KVREF_ROUTER_SOFTMAX = 0,  /* scores = softmax(logits) over the X experts (Qwen3-MoE, Mixtral, gpt-oss) */
    KVREF_ROUTER_SIGMOID = 1   /* scores = sigmoid(logits), each expert on its own (DeepSeek-V3) */
};
enum kvref_group_score {
    KVREF_GROUP_TOP2_SUM = 0,  /* a group's score: its two best choice values summed (DeepSeek-V3) */
    KVREF_GROUP_MAX = 1        /* ... its best (DeepSeek-V2) */
};
typedef struct kvref_router {
    int64_t n_experts;         /* X >= 1 (0 in a model descriptor without mixture layers) */
    int64_t n_used;            /* k, 1 <= k <= X: experts each position runs */
    int32_t score;             /* a kvref_router_score */
    int64_t n_groups;          /* G >= 1 dividing X: grouped top-k (DeepSeek) when > 1 */
    int64_t n_groups_used;     /* 1 <= G_used <= G: the best groups a position chooses from */
    int32_t group_score;       /* a kvref_group_score */
    int32_t normalize;         /* 1: the k weights divided by their sum (norm_topk_prob) */
    float scaling;             /* finite: the weights are multiplied by it (routed_scaling_factor) */
} kvref_router;

/* experts [T, k], weights [T, k] = the routing of logits [T, X], as kvref.spec.ops.route defines it:
 * scores = softmax or sigmoid of each row (sigmoid(x) = 0.5 (1 + tanh(x / 2)); softmax subtracts the
 * row max, and a row holding a NaN or +inf scores NaN everywhere); the experts are chosen by
 * choice = scores + selection_bias (or scores, when it is NULL), restricted with groups to the
 * G_used best groups (others -inf); the k largest choices, best first, of equal ones the lower id
 * first, NaN after every number (in id order); their weights are their unbiased scores, divided by
 * their sum (added best first) with normalize, then multiplied by scaling.
 *   logits:         float32 [T, X]
 *   selection_bias: float32 [X] or NULL
 *   experts:        int64 [T, k];  weights: float32 [T, k] */
int kvref_route(const float *logits, int64_t T, const float *selection_bias, const kvref_router *router,
                int64_t *experts, float *weights);

/* out = cap * tanh(x / cap) for finite x, x itself otherwise (kvref.spec.ops.soft_cap: Gemma 2's final
 * logits and, inside kvref_attention, its scores).
 *   x, out: float32 [n] (out may be x)
 *   cap:    > 0, finite */
int kvref_soft_cap(kvref_pool *pool,
                   const float *x, int64_t n, float cap,
                   float *out);

/* A KV cache's storage, read and written in place (kvref/cache/quant.py's SlotStore). K and V of
 * every layer live in a grid of slots, one head_dim vector per (layer, slot, kv head):
 *   k, v:               k_type / v_type [n_layers, n_slots, n_kv_heads, head_dim]
 *   k_scales, v_scales: float32 [n_layers, n_slots, n_kv_heads, head_dim / group_size] where that
 *                       type is KVREF_TYPE_I8, else NULL
 * Element types: F32, F16, BF16 (the upper half of a float32), or I8, read as q * scale with one
 * scale per group_size consecutive elements along head_dim (group_size divides head_dim; 0 when
 * neither K nor V is I8). K and V may have different types.
 * Position p of the sequence lives in slot p when block_table is NULL (a contiguous cache), else in
 * slot block_table[p / block_size] * block_size + p % block_size (a paged cache: n_slots is a
 * multiple of block_size and every entry used names a block in [0, n_slots / block_size)).
 * Per-layer rings (a hybrid cache): with layer_ring, layer l with layer_ring[l] = R > 0 is a ring of
 * R slots, position p in its slot p % R, and a layer with 0 keeps position p in its slot p, n_slots
 * of them. Layer l's slots then follow layer l-1's: the arrays hold the sum of the layers' extents
 * (R, or n_slots) slots, [sum, n_kv_heads, head_dim] (scales likewise), and block_table is NULL.
 * KIVI4 (kvref/cache/quant.py): k, v uint8 [n_layers, n_slots, n_kv_heads, head_dim / 2], element
 * 2i in the low nibble of byte i; V per token: v_scales [n_layers, n_slots, n_kv_heads,
 * head_dim / group_size, 2] (scale, zero) pairs; K per channel over the group_size positions of a
 * group: k_scales [n_layers, ceil(n_slots / group_size), n_kv_heads, 2, head_dim] (the channels'
 * scales, then their zeros), the group of slot s being s / group_size (a block holds whole groups),
 * and the K of positions past the last full group in k_residual, float16 [n_layers, group_size,
 * n_kv_heads, head_dim], position p in row p % group_size. With S positions stored, positions
 * below S - S % group_size are quantized. KIVI4 K takes no rings. */
typedef struct kvref_kv {
    void *k, *v;
    float *k_scales, *v_scales;
    int32_t k_type, v_type;
    int64_t n_layers, n_slots, n_kv_heads, head_dim, group_size;
    const int64_t *block_table;  /* [n_blocks] or NULL */
    int64_t n_blocks, block_size;
    const int64_t *layer_ring;   /* [n_layers], each >= 0, or NULL (every layer as above) */
    uint16_t *k_residual;        /* KIVI4 K: float16 [n_layers, group_size, n_kv_heads, head_dim]; else NULL */
    int64_t v_dim;               /* Dv, what attention reads of each V vector: its first Dv of head_dim
                                    elements, 1 <= Dv <= head_dim; 0: head_dim (KIVI4 V: always). A latent
                                    (MLA) cache passes its K as V (k, k_type, k_scales) with Dv = kv_lora_rank */
} kvref_kv;

/* Causal grouped-query attention by position with a single-pass (online) softmax, reading layer
 * `layer` of a cache in place (int8 and bfloat16 elements decoded in registers).
 * Key s (s < S) is position s of the cache, at the slot the block table gives (slot s of a ring
 * layer, whose caller says in k_positions which position each slot holds, in any order); query t,
 * head h attends to every key with k_positions[s] <= q_positions[t], and with a window W > 0 only to
 * those with q_positions[t] - W < k_positions[s], through kv head h / (H / Hkv); scores are
 * (q . k) * scale, then with softcap > 0 softcap * tanh(score / softcap) (kvref_soft_cap: Gemma 2), before
 * the mask. A query that sees no key gets a zero output. Chunks of keys no query can see are
 * skipped without reading their K/V (a windowed decode step reads about W keys of a long cache).
 *   q:           float32 [T, H, D], D == kv->head_dim, Hkv == kv->n_kv_heads
 *   q_positions: int64   [T]
 *   k_positions: int64   [S]
 *   window:      >= 0 (0: none)
 *   softcap:     >= 0, finite (0: none)
 *   scale:       finite (kvref.spec.ops.attention's scale; 1 / sqrt(D) is its default)
 *   sinks:       float32 [H] or NULL: each head's sink logit (gpt-oss), one more term of its softmax
 *                denominator, exp(sink), that multiplies no value; a non-finite one makes its head NaN
 *   out:         float32 [T, H, Dv] (must not overlap the inputs); Dv = kv->v_dim, or D when that is 0
 * H must be a multiple of Hkv; the layer must hold S positions (n_slots, or the table's blocks, or
 * the ring's R slots). */
int kvref_attention(kvref_pool *pool,
                    const float *q, int64_t T, int64_t H, int64_t D,
                    const kvref_kv *kv, int64_t layer, int64_t S,
                    const int64_t *q_positions, const int64_t *k_positions,
                    int64_t window, float softcap, float scale, const float *sinks,
                    float *out);

/* ---- the fused forward: one whole execution (a prefill or a decode step) per call ------------ */

/* A weight matrix in file layout, read in place: [rows, cols] = [N, K] values in `type` blocks. */
typedef struct kvref_tensor {
    const void *data;          /* bytes [rows, kvref_row_nbytes(type, cols)] */
    int64_t nbytes;            /* rows * kvref_row_nbytes(type, cols) */
    int32_t type;              /* a kvref_type */
    int64_t rows, cols;
    const void *packed;        /* NULL, or the same matrix packed by kvref_pack_int8, which the int8
                                  activation mode reads instead of data (a projection or the LM head) */
} kvref_tensor;

/* Bytes of a [rows, cols] weight of `type` packed for the int8 activation mode, every field at the
 * file's bit width: Q4_0, Q4_1, Q5_0, Q8_0 and Q4_K weights in as many bytes as the file's (rows
 * rounded up to 16), Q6_K in 1.0095 times them (a header padded to 64 bytes); 0 for the other types,
 * which that mode reads in file layout. */
int64_t kvref_packed_nbytes(int32_t type, int64_t rows, int64_t cols);
/* w (as kvref_matmul takes it) -> out [out_nbytes = kvref_packed_nbytes(...)], 64-byte aligned: its
 * rows 16 at a time in the layout of the int8 mode's kernels, whose every 4-byte dot product
 * instruction multiplies 16 weight rows by the same 4 bytes of x. KVREF_ERR_TYPE for a type
 * kvref_packed_nbytes gives 0. */
int kvref_pack_int8(const void *w, int32_t w_type, int64_t w_nbytes, int64_t rows, int64_t cols, void *out,
                    int64_t out_nbytes);

/* One transformer block's weights (shapes in the legend above; F = d_ff) and its attention's
 * per-layer settings. The optional fields are those of the families besides Llama (ModelConfig's
 * qkv_bias, qk_norm, sandwich_norms, layer_windows, per-layer RoPE). */
typedef struct kvref_layer_desc {
    const float *attn_norm;    /* float32 [E]   RMSNorm gain before attention */
    kvref_tensor wq;           /* [H*D, E]      query projection */
    kvref_tensor wk;           /* [Hkv*D, E]    key projection */
    kvref_tensor wv;           /* [Hkv*D, E]    value projection */
    kvref_tensor wo;           /* [E, H*D]      attention output projection */
    const float *ffn_norm;     /* float32 [E]   RMSNorm gain before the MLP */
    kvref_tensor w_gate;       /* [F, E]        gate projection */
    kvref_tensor w_up;         /* [F, E]        up projection */
    kvref_tensor w_down;       /* [E, F]        down projection */
    const float *bq, *bk, *bv; /* float32 [H*D], [Hkv*D], [Hkv*D] biases added to the projections, or NULL */
    const float *q_norm, *k_norm; /* float32 [D] RMSNorm gains of every query / key head before RoPE, or NULL
                                  (both or neither) */
    const float *post_attn_norm, *post_ffn_norm; /* float32 [E] RMSNorm gains of the attention and MLP
                                  outputs before their residual adds, or NULL (both or neither) */
    const double *rope_freqs;  /* float64 [D/2] the layer's RoPE frequencies, as kvref_rope takes them; NULL: a
                                  NoPE layer (SmolLM3), whose q and k are not rotated */
    int64_t window;            /* the layer's attention window W (a query at p sees p-W+1 .. p), 0: none */
    const float *sinks;        /* float32 [H] the layer's sink logits (kvref_attention), or NULL */
    const float *bo;           /* float32 [E] the attention output projection's bias (gpt-oss), or NULL */
    const struct kvref_moe_layer *moe; /* a mixture of experts in place of w_gate, w_up, w_down (whose data
                                  are then NULL), or NULL: a dense MLP */
    /* Multi-head latent attention (kvref_model_desc.kv_lora_rank > 0; R, Q, Dr, Dv there, Dn = D - Dr):
     * wk and wv are unused (data NULL), wq is [H*D, Q] after wq_a (or [H*D, E] without it), wo [E, H*Dv],
     * and rope_freqs has Dr/2 frequencies (the rotated part of each query head and the shared key). */
    kvref_tensor wq_a;         /* [Q, E]        the query's down-projection, data NULL when Q is 0 */
    const float *q_a_norm;     /* float32 [Q]   its RMSNorm gain (eps latent_norm_eps) */
    kvref_tensor wkv_a;        /* [R + Dr, E]   down-projection to [c_kv | k_rope] */
    const float *kv_a_norm;    /* float32 [R]   RMSNorm gain of c_kv (eps latent_norm_eps) */
    kvref_tensor w_uk;         /* F32 [H*R, Dn] W_UK transposed per head: rows h*R .. fold head h's query
                                  into the latent (W_UK[h] [Dn, R] is wkv_b's rows h*(Dn+Dv) .. +Dn) */
    kvref_tensor w_uv;         /* F32 [H*Dv, R] W_UV: rows h*Dv .. turn head h's latent output into its value */
} kvref_layer_desc;

/* A mixture-of-experts layer's MLP (kvref.spec.decoder.moe; Fx = the router's expert width, Fs the
 * shared expert's): the router chooses k of X experts per position (kvref_route), each a gated MLP;
 * their outputs, weighted, are summed, plus the shared expert's. An expert stack is the X matrices
 * one after the other, as kvref_matmul_experts reads it; packed (the int8 mode), each expert's
 * kvref_packed_nbytes(type, rows / X, cols) bytes rounded up to a multiple of 64, one after the other. */
typedef struct kvref_moe_layer {
    kvref_tensor router;       /* [X, E]        expert logits per position */
    const float *router_bias;  /* float32 [X] added to the logits (gpt-oss), or NULL */
    const float *selection_bias; /* float32 [X] added to the scores to choose experts (DeepSeek-V3), or NULL */
    kvref_tensor gate, up;     /* [X * Fx, E]   each expert's gate and up projections */
    kvref_tensor down;         /* [X * E, Fx]   each expert's down projection */
    const float *gate_bias, *up_bias; /* float32 [X, Fx] expert biases (gpt-oss), or NULL (all three or none) */
    const float *down_bias;    /* float32 [X, E] */
    kvref_tensor shared_gate, shared_up; /* [Fs, E] the shared expert every position runs (DeepSeek), */
    kvref_tensor shared_down;  /* [E, Fs]       or data NULL: none */
} kvref_moe_layer;

/* How the MLP gates: out = act(x @ Wg.T) * (x @ Wu.T). */
enum kvref_gate {
    KVREF_GATE_SILU = 0,       /* SwiGLU (Llama, Qwen, Mistral): kvref_swiglu */
    KVREF_GATE_GELU_TANH = 1,  /* GeGLU (Gemma): kvref_geglu */
    KVREF_GATE_SWIGLU_OAI = 2  /* gpt-oss's clamped SwiGLU: kvref_swiglu_oai */
};

/* Everything a forward reads besides the tokens and the cache. kvref_model_create copies it (and
 * the layer array); the memory the pointers point into must outlive the model. */
typedef struct kvref_model_desc {
    int64_t n_layers;          /* transformer blocks */
    int64_t d_model;           /* E */
    int64_t n_heads;           /* H */
    int64_t n_kv_heads;        /* Hkv, H % Hkv == 0 */
    int64_t head_dim;          /* D, even (RoPE rotates pairs) */
    int64_t d_ff;              /* F */
    int64_t vocab_size;        /* V */
    double norm_eps;           /* >= 0 */
    float embedding_scale;     /* > 0, finite: embeddings are multiplied by it (Gemma: sqrt(E)), 1: as stored */
    float attention_scale;     /* > 0, finite: what scores are multiplied by (1 / sqrt(D) unless a family says) */
    float attn_softcap;        /* >= 0, finite: scaled scores -> attn_softcap * tanh(score / attn_softcap)
                                  (Gemma 2), as kvref_attention's softcap; 0: none */
    float final_softcap;       /* >= 0, finite: logits -> kvref_soft_cap(logits, final_softcap) (Gemma 2); 0: none */
    int32_t gate;              /* a kvref_gate */
    kvref_tensor tok_embeddings; /* [V, E] */
    const kvref_layer_desc *layers; /* [n_layers] */
    const float *output_norm;  /* float32 [E] */
    kvref_tensor output;       /* [V, E] the LM head (may alias tok_embeddings) */
    kvref_router router;       /* the mixture layers' router (n_experts 0: none has one) */
    int64_t expert_d_ff;       /* Fx: each routed expert's hidden width */
    int64_t shared_d_ff;       /* Fs: the shared expert's, 0: none */
    /* Multi-head latent attention (DeepSeek-V2/V3), all 0 for K/V heads: the cache holds per layer and
     * position one latent key [c_kv ; k_rope] of R + Dr values (kvref_kv: 1 kv head, head_dim R + Dr,
     * v_dim R, V its K), and attention runs over it in the absorbed form (kvref/spec/decoder.py,
     * latent_attention_block): each query head's first Dn values folded into the latent by W_UK,
     * attention of [H, R + Dr] queries over the latent keys with values their first R, then W_UV. */
    int64_t kv_lora_rank;      /* R > 0: MLA; n_kv_heads == n_heads, head_dim = Dn + Dr */
    int64_t q_lora_rank;       /* Q: the query's low-rank bottleneck (wq_a, q_a_norm), 0: one wq */
    int64_t qk_rope_head_dim;  /* Dr, even, < head_dim */
    int64_t v_head_dim;        /* Dv */
    double latent_norm_eps;    /* >= 0: eps of q_a_norm and kv_a_norm */
    float q_rope_scale;        /* > 0, finite: each query head's rotated part is multiplied by it after RoPE
                                  (YaRN's attention factor squared, which DeepSeek puts on q_rope and k_rope
                                  only); 1: none */
} kvref_model_desc;

/* A validated copy of a descriptor. */
typedef struct kvref_model kvref_model;
int kvref_model_create(const kvref_model_desc *desc, kvref_model **out);
void kvref_model_destroy(kvref_model *model);

/* The run state of one model: activation buffers, RoPE tables, attention partials and timing
 * counters. Buffers grow to the largest execution seen (positions per call, cache length) and are
 * reused: a decode step allocates nothing. One state serves one call at a time. */
typedef struct kvref_state kvref_state;
int kvref_state_create(const kvref_model *model, kvref_state **out);
void kvref_state_destroy(kvref_state *state);

/* How projections treat their input rows. */
enum kvref_activations {
    KVREF_ACT_F32 = 0,         /* exact: the float32 kernels of kvref_matmul, every execution */
    KVREF_ACT_INT8 = 1         /* every projection is kvref_matmul_int8: its input rounded to
                                  8-bit blocks of 32 where the weight type has 8-bit kernels, read
                                  from the packed copies (kvref_tensor.packed), which every such
                                  projection must have, else KVREF_ERR_VALUE. Then, where the LM
                                  head was so rounded, the KVREF_HEAD_EXACT_K largest logits of
                                  each row (of equal ones the lower id first; never NaN) are
                                  recomputed with float32 activations, each the exact mode's
                                  single-row dot product (kvref_matmul with one row of x): the
                                  head's rounding was the largest single share of the mode's error,
                                  and its likeliest tokens carry nearly all of the probability */
};
enum { KVREF_HEAD_EXACT_K = 32 };

/* An execution of more rows than this (a long prompt, or a batch's rows in all) runs as passes of
 * near-equal size, at most this many rows each, one after another: each pass is the execution of its
 * rows, from the cache positions the earlier passes wrote. Its buffers hold one pass, so a prefill's
 * memory does not grow with the prompt (at Llama 3.2 1B's shapes, 48 KiB per row beside up's
 * chunk, KVREF_UP_FLOATS), and every pass still has the rows a GEMM needs (more than
 * KVREF_PASS_ROWS / 2). The price: the weights stream once per pass, against a pass's worth of GEMM
 * work each time. */
enum { KVREF_PASS_ROWS = 128 };

/* A pass of T rows computes its MLP's up projection in chunks of n hidden columns when T * F floats
 * would exceed this: each chunk, [T, n], is gated into its columns of gate ([T, F], which the down
 * projection reads whole) as soon as it is made, so the pass holds one chunk of up beside gate
 * rather than a second [T, F] (4 MiB fewer at Llama 3.2 1B's shapes). n is F when T * F fits, else
 * the most whole GEMM tiles of 32 columns whose T rows fit (1024 columns at 128 rows). No value
 * changes: each output is one weight row's dot product with one row of x whichever rows a call
 * multiplies, and the gate acts on each element alone. */
enum { KVREF_UP_FLOATS = 131072 };

/* Run T new tokens at positions length .. length+T-1 of a cache.
 *   token_ids:  int64 [T], each in [0, V)
 *   cache:      its n_layers, n_kv_heads and head_dim those of the model; its layers without a
 *               ring must have room for length + T positions. The new positions' K (after RoPE)
 *               and V are written, encoded exactly as kvref/cache/quant.py encodes them, into their
 *               slots in every layer; nothing else in the cache is written. A ring layer (R slots)
 *               must have a window W <= R: it keeps positions max(0, n - R) .. n - 1 of the n written
 *               so far, so its new positions are run in sub-chunks of at most R - W + 1, each written
 *               and then attended to, and no query misses a key of its window to a later write.
 *               (A ring layer's overwritten slots are the caller's to restore if it aborts.)
 *   logits:     float32 [T, V] with all_logits, else [V] for the last position
 * Every layer does what kvref/spec/decoder.py does, with the kernels of kvref_matmul,
 * kvref_attention, kvref_rms_norm, kvref_rope, kvref_swiglu / kvref_geglu / kvref_swiglu_oai,
 * kvref_soft_cap and, in a mixture layer, kvref_route and kvref_matmul_experts in the same order:
 * with KVREF_ACT_F32 the logits and cache rows are bit-identical to calling those kernels one by
 * one on the same pool, pass by pass (KVREF_PASS_ROWS; a ring layer's keys are in slot order, so
 * its results are the decoder's over a contiguous cache to float32 rounding). The caller commits the cache length (length + T)
 * only after KVREF_OK. */
int kvref_forward(kvref_pool *pool, const kvref_model *model, kvref_state *state,
                  const int64_t *token_ids, int64_t T, const kvref_kv *cache, int64_t length,
                  int32_t activations, int32_t all_logits, float *logits);

/* Several sequences in one execution: B sequences, sequence b's new positions being the ids
 * token_ids[bounds[b] .. bounds[b+1]) (bounds [B + 1], bounds[0] = 0, strictly increasing), at
 * positions lengths[b] .. of caches[b] (each as kvref_forward's cache; no two the same storage).
 * Every row-wise step (embedding, norms, projections, RoPE at each row's own position, the MLP, the
 * LM head) runs once over all bounds[B] rows, as kvref_forward over one sequence of that many;
 * attention runs per sequence against its own cache. logits: float32 [bounds[B], V] with
 * all_logits, else [B, V], each sequence's last position. kvref_forward is the case B = 1. Every
 * argument is checked before any cache is written; the caller commits every sequence's new
 * length only after KVREF_OK. */
int kvref_forward_batch(kvref_pool *pool, const kvref_model *model, kvref_state *state,
                        const int64_t *token_ids, const int64_t *bounds, int64_t B,
                        const kvref_kv *caches, const int64_t *lengths,
                        int32_t activations, int32_t all_logits, float *logits);

/* Time spent by kvref_forward on this state, in nanoseconds of the calling thread's wall clock,
 * by kernel family: out[0] projections (matmuls, their 8-bit input rounding, the fused SwiGLU and
 * residual adds), out[1] attention (scores, softmax, merge), out[2] everything else (embedding,
 * norms, RoPE, cache writes), out[3] the number of kvref_forward calls counted, out[4] the bytes of
 * the routed experts' matrices its mixture layers read (each expert a pass chose once; its packed copy's
 * bytes where that is read). */
void kvref_state_timings(const kvref_state *state, int64_t *out);
void kvref_state_reset_timings(kvref_state *state);

/* Test hook: arm a one-shot failure. The next kvref_forward on this state returns
 * KVREF_ERR_INJECTED when it reaches `layer` (after writing the K/V of layers < layer, before any
 * of `layer`'s); -1 disarms. The hook disarms itself once it fires; a call that fails before it
 * reaches the layer leaves it armed. Like every call on a state, not concurrent with a
 * kvref_forward on the same state. KVREF_ERR_NULL for a NULL state, KVREF_ERR_VALUE for a layer
 * outside [-1, n_layers). */
int kvref_state_fail_at_layer(kvref_state *state, int64_t layer);

#ifdef __cplusplus
}
#endif

#endif /* KVREF_H */
