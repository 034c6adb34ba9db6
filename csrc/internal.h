/* internal.h: what the C files share with each other and never with Python.
 *
 * The public API is kvref.h. This header holds the block layouts of the weight formats, the
 * half-precision conversions, the per-instruction-set kernel table and the pool's work-splitting
 * entry point.
 */
#ifndef KVREF_INTERNAL_H
#define KVREF_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "kvref.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVREF_X86 1
#else
#define KVREF_X86 0
#endif

/* ---- block layouts (GGML, as stored in GGUF files) ------------------------------------------ */

#define QK4_0 32
#define QK4_1 32
#define QK8_0 32
#define QK_K 256

#define BYTES_Q4_0 18   /* f16 d; u8 qs[16]: value j = d * ((qs[j % 16] >> 4*(j / 16)) & 15) - 8) */
#define BYTES_Q4_1 20   /* f16 d, m; u8 qs[16]: value j = d * nibble(j) + m */
#define BYTES_Q8_0 34   /* f16 d; i8 qs[32]: value j = d * qs[j] */
#define BYTES_Q4_K 144  /* f16 d, dmin; u8 scales[12] (8 x 6-bit scale, 8 x 6-bit min); u8 qs[128] */
#define BYTES_Q6_K 210  /* u8 ql[128], qh[64]; i8 scales[16]; f16 d */

#define KVREF_TYPE_SLOTS 31 /* type ids are < 31 */

/* ---- half precision ------------------------------------------------------------------------- */

static inline float kvref_fp32_from_bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t kvref_bits_from_fp32(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* IEEE binary16 -> binary32, exact for every input (subnormals, infinities, NaN payloads). */
static inline float kvref_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1fu) return kvref_fp32_from_bits(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        if (mant == 0) return kvref_fp32_from_bits(sign);
        /* subnormal: mant * 2**-24, exact in binary32 */
        float f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    return kvref_fp32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

static inline float kvref_bf16_to_fp32(uint16_t h) { return kvref_fp32_from_bits((uint32_t)h << 16); }

/* binary32 -> binary16, round to nearest even (as NumPy's astype(float16) and F16C round):
 * overflow goes to infinity, tiny values to subnormals or zero, NaN stays a quiet NaN.
 * (F. Giesen's float_to_half_fast3_rtne; relies on IEEE float addition, which SSE gives.) */
static inline uint16_t kvref_fp32_to_fp16(float f) {
    uint32_t u = kvref_bits_from_fp32(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    uint16_t h;
    if (u >= 0x47800000u) {                     /* >= 65536, infinity or NaN */
        h = u > 0x7f800000u ? (uint16_t)(0x7e00u | ((u >> 13) & 0x3ffu)) : (uint16_t)0x7c00u;
    } else if (u < 0x38800000u) {               /* below 2**-14: a subnormal half or zero */
        const float magic = kvref_fp32_from_bits(126u << 23); /* 0.5: aligns the half ulp 2**-24 */
        h = (uint16_t)(kvref_bits_from_fp32(kvref_fp32_from_bits(u) + magic) - (126u << 23));
    } else {
        const uint32_t odd = (u >> 13) & 1u;    /* ties go to the even mantissa */
        u += 0xc8000fffu + odd;                 /* rebias the exponent (-112 << 23) and round */
        h = (uint16_t)(u >> 13);
    }
    return (uint16_t)(h | sign);
}

static inline uint16_t kvref_load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline float kvref_load_fp16(const uint8_t *p) { return kvref_fp16_to_fp32(kvref_load_u16(p)); }

/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K super-block (llama.cpp get_scale_min_k4). */
static inline void kvref_q4k_scale_min(int j, const uint8_t *scales, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = scales[j] & 63;
        *m = scales[j + 4] & 63;
    } else {
        *sc = (uint8_t)((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4));
        *m = (uint8_t)((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
    }
}

/* ---- 8-bit activation blocks (the "int8" activation mode) ---------------------------------------
 *
 * A row of K activations (K a multiple of 32) rounded to 8 bits per block of 32, llama.cpp's Q8_1
 * idea with an exact block sum, stored as two arrays so SIMD kernels load several blocks at once:
 *   qs [K]          int8, rint(x * (1/d)) of its block (ties to even), in [-127, 127]
 *   ds [K/32, 2]    float32 per block: d = max|x| / 127 (0 for an all-zero block), s = sum of x
 * x[j] ~ d * qs[j]. d and qs are the same on every instruction set (d, 1/d and x * (1/d) are single
 * IEEE operations, then round-to-nearest-even); s is a float32 sum whose order differs. s is the
 * unrounded sum because Q4_1's block offset m multiplies it: that term stays exact. For finite x,
 * |x * (1/d)| <= 127 * (1 + 2**-22), so qs never needs clamping; the kernels clamp anyway, which
 * only matters for NaN (-> 127). */

/* the exact scale and inverse scale of a block whose largest magnitude is amax */
static inline void kvref_q8_scale(float amax, float *d, float *id) {
    *d = amax / 127.0f;
    *id = *d != 0.0f ? 1.0f / *d : 0.0f;
}

/* ---- kernel table: one per instruction set -------------------------------------------------- */

/* dot of one weight row (K values in `type` blocks) with x [K] */
typedef float (*kvref_vec_dot_fn)(int64_t K, const uint8_t *w_row, const float *x);
/* one weight row (K values) -> float32 [K], each value rounded exactly as the NumPy dequantizer does */
typedef void (*kvref_dequant_fn)(int64_t K, const uint8_t *w_row, float *out);
/* y[t * ldy + n] = dot(x[t, :], w[n, :]) for t < T, n < nw; x [T, K], w [nw, K] float32 */
/* dot of one weight row (K values in `type` blocks) with x [K] in 8-bit blocks (qs [K], ds [K/32, 2]) */
typedef float (*kvref_vec_dot_q8_fn)(int64_t K, const uint8_t *w_row, const int8_t *qs, const float *ds);
/* x [K] (K a multiple of 32) -> qs [K], ds [K/32, 2] */
typedef void (*kvref_quantize_q8_fn)(int64_t K, const float *x, int8_t *qs, float *ds);
typedef void (*kvref_gemm_fn)(int64_t K, const float *x, int64_t T, const float *w, int64_t nw,
                              float *y, int64_t ldy);

/* One unit of attention: query t against keys [s0, s1) for the G query heads of kv head hk, an
 * online-softmax update of the state it is given: for each head g of the group, the running max
 * m[g], the sum of exponentials l[g] and the unnormalised output acc[g * D .. +D] (all relative to
 * m[g]). Start from kvref_attn_state_init (m = -inf, l = 0, acc = 0: no key seen); a range with no
 * visible key leaves the state as it was. Updating with [s0, s1) then [s1, s2) is the same
 * computation, bit for bit, as one update with [s0, s2) when s1 - s0 is a multiple of
 * KVREF_ATTN_CHUNK (the unit works chunk by chunk from s0). */
typedef struct kvref_attn_args {
    const float *q;            /* [T, H, D] */
    const uint8_t *k, *v;      /* the layer's slots [n_slots, Hkv, D] of k_type / v_type */
    const float *k_scales, *v_scales; /* the layer's I8 scales [n_slots, Hkv, D / group_size] or NULL */
    int32_t k_type, v_type;
    int64_t group_size;
    const int64_t *block_table; /* key s is in slot table[s / block_size] * block_size + s % block_size */
    int64_t block_size;        /* ... or in slot s when block_table is NULL */
    const int64_t *q_positions, *k_positions; /* [T], [S] */
    int64_t T, H, D, S, Hkv, G;
    float scale;               /* 1 / sqrt(D) */
} kvref_attn_args;

typedef void (*kvref_attn_unit_fn)(const kvref_attn_args *a, int64_t t, int64_t hk, int64_t s0,
                                   int64_t s1, float *m, float *l, float *acc, float *scratch);

static inline void kvref_attn_state_init(int64_t G, int64_t D, float *m, float *l, float *acc) {
    for (int64_t g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int64_t i = 0; i < G * D; i++) acc[i] = 0.0f;
}

/* Keys a unit scores per step; how far ahead of the keys it scores a unit prefetches (one chunk);
 * and so how many keys past a chunk it looks up rows for. */
#define KVREF_ATTN_CHUNK 64
#define KVREF_ATTN_PREFETCH_KEYS 64
#define KVREF_ATTN_LOOKAHEAD (KVREF_ATTN_PREFETCH_KEYS + 8)

/* Per-thread scratch of an attention unit: probabilities p [G, CHUNK] floats, then the rows of a
 * chunk (and its lookahead) as int64: row [CHUNK + LOOKAHEAD], srow [CHUNK + LOOKAHEAD]. */
static inline int64_t kvref_attn_scratch_floats(int64_t G, int64_t D) {
    return G * KVREF_ATTN_CHUNK + 4 * (KVREF_ATTN_CHUNK + KVREF_ATTN_LOOKAHEAD) + 64;
}

/* Where kv head hk's vectors of keys c0 .. c0+n-1 are: row[i] is the element offset of key c0 + i's
 * vector in the layer's K and V arrays ((slot * Hkv + hk) * D), srow[i] the offset of its first I8
 * scale ((slot * Hkv + hk) * D / group_size; 0 when nothing is I8). The slots follow the
 * block table one block at a time: one division per call, none per key. */
static inline void kvref_attn_rows(const kvref_attn_args *a, int64_t hk, int64_t c0, int64_t n, int64_t *row,
                                   int64_t *srow) {
    const int64_t bs = a->block_table != NULL ? a->block_size : INT64_MAX;
    const int64_t ng = a->group_size > 0 ? a->D / a->group_size : 0;
    int64_t b = c0 / bs, o = c0 % bs;
    for (int64_t i = 0; i < n; i++) {
        const int64_t slot = a->block_table != NULL ? a->block_table[b] * bs + o : c0 + i;
        row[i] = (slot * a->Hkv + hk) * a->D;
        srow[i] = (slot * a->Hkv + hk) * ng;
        if (++o == bs) {
            o = 0;
            b++;
        }
    }
}

/* Bytes of one stored K/V element of `type`; -1 for a type a cache cannot store. */
static inline int64_t kvref_kv_element_bytes(int32_t type) {
    switch (type) {
    case KVREF_TYPE_F32: return 4;
    case KVREF_TYPE_F16: case KVREF_TYPE_BF16: return 2;
    case KVREF_TYPE_I8: return 1;
    default: return -1;
    }
}

/* Ask for the K or V vectors (base and type: the layer's K or V; kv head hk's part of each slot:
 * rows from kvref_attn_rows) of keys i0 .. i0+7, those of the nrows looked up, to be brought into
 * L2, one 64-byte line at a time. A SIMD unit calls this every 8 keys for the keys one chunk ahead,
 * so each line is asked for a whole chunk (all kv heads' turns) before it is read: the AVX-512 unit
 * asks for K while it scores and for V while it sums values, which spreads the requests over the
 * work. Without it, attention over a cache streamed from DRAM waits on memory at every group of
 * keys: a unit reads a third of each slot (SmolLM2, Hkv = 3), a strided pattern the hardware
 * prefetchers follow poorly. Measured on this repository's 2-core Zen 4 machine (attention over 30
 * layers x 4096 float16 positions, cache cold, 2 threads; each pair from builds run alternately, as
 * the host's load moves absolute times): whole slots asked for by kv head 0 only, 32 keys ahead:
 * into L1 9.1 ms against 9.7 with no prefetch, into L2 6.7-6.9 ms against 5.6-5.9 for K and V
 * together while scoring; V while summing values instead: 4.0-4.5 ms against 4.5-4.9 (with the
 * segment runs of attention.c), and 3.2 against 3.5 ms with the cache in L3. Twice as far ahead,
 * every other line, or into L1 was slower. */
static inline void kvref_attn_prefetch(const uint8_t *base, int32_t type, int64_t D, const int64_t *row, int64_t i0,
                                       int64_t nrows) {
    const int64_t width = kvref_kv_element_bytes(type), i1 = i0 + 8 < nrows ? i0 + 8 : nrows;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t o = 0; o < D * width; o += 64) __builtin_prefetch(base + row[i] * width + o, 0, 2);
}

typedef struct kvref_kernels {
    int32_t isa;
    kvref_vec_dot_fn vec_dot[KVREF_TYPE_SLOTS];
    kvref_dequant_fn dequant[KVREF_TYPE_SLOTS];
    kvref_gemm_fn gemm_f32;
    kvref_attn_unit_fn attn_unit;
    /* out[i] = silu(gate[i]) * up[i] */
    void (*swiglu)(int64_t n, const float *gate, const float *up, float *out);
    /* 8-bit activations: a dot kernel for the weight types that have one (NULL: use vec_dot) */
    kvref_vec_dot_q8_fn vec_dot_q8[KVREF_TYPE_SLOTS];
    kvref_quantize_q8_fn quantize_q8;
    /* out[i] = kvref_fp32_to_fp16(x[i]) */
    void (*to_fp16)(int64_t n, const float *x, uint16_t *out);
} kvref_kernels;

extern const kvref_kernels kvref_kernels_scalar;
#if KVREF_X86
extern const kvref_kernels kvref_kernels_avx2;
extern const kvref_kernels kvref_kernels_avx512;
extern const kvref_kernels kvref_kernels_avx512_vnni; /* avx512 plus VNNI 8-bit dot products */
/* the AVX2 8-bit dot kernels (maddubs), which AVX-512 CPUs without VNNI use too */
float kvref_avx2_vec_dot_q8_q4_0(int64_t K, const uint8_t *w_row, const int8_t *qs, const float *ds);
float kvref_avx2_vec_dot_q8_q4_1(int64_t K, const uint8_t *w_row, const int8_t *qs, const float *ds);
float kvref_avx2_vec_dot_q8_q8_0(int64_t K, const uint8_t *w_row, const int8_t *qs, const float *ds);
#endif

/* scalar reference pieces the SIMD tables reuse for types they do not specialise */
void kvref_dequant_row(int32_t type, int64_t K, const uint8_t *w_row, float *out);
/* the portable attention unit: any K/V types and group size (SIMD units hand it what they do not cover) */
void kvref_attn_unit_ref(const kvref_attn_args *a, int64_t t, int64_t hk, int64_t s0, int64_t s1, float *m,
                         float *l, float *acc, float *scratch);
float kvref_silu_ref(float g);
void kvref_to_fp16_ref(int64_t n, const float *x, uint16_t *out);

/* ---- row kernels shared by the single-kernel API and the fused forward ----------------------- */

/* out = x / sqrt(mean(x**2) + eps) * weight for one row of E values (mean square in double) */
void kvref_rms_norm_row(const float *x, int64_t E, const float *weight, double eps, float *out);
/* inv_freq[i] = theta ** (-2i / D), i < D/2 */
void kvref_rope_inv_freq(int64_t D, double theta, double *inv_freq);
/* cs[0..D/2) = cos(p * inv_freq), cs[D/2..D) = sin(p * inv_freq), in double */
void kvref_rope_cos_sin(int64_t D, const double *inv_freq, int64_t position, double *cs);
/* rotate the nh heads of one position: x, out [nh, D] (out may be x), cs from kvref_rope_cos_sin */
void kvref_rope_row(const float *x, int64_t nh, int64_t D, const double *cs, float *out);

/* ---- matmul and attention bodies (arguments checked, the pool lock held) -------------------- */

#define KVREF_GEMM_MIN_T 4     /* from this many x rows on, matmul dequantizes tiles for a GEMM */
#define KVREF_TILE_N 32        /* weight rows per unit (one dequantized tile) on the GEMM path */

/* per-thread scratch bytes kvref_matmul_run needs for a weight of `type` with K columns */
size_t kvref_matmul_scratch_bytes(int32_t type, int64_t T, int64_t K);
/* y [T, N] = x [T, K] @ W.T: the work of kvref_matmul (any T) */
void kvref_matmul_run(kvref_pool *pool, const float *x, int64_t T, int64_t K, const uint8_t *w,
                      int32_t type, int64_t N, float *y);

/* Up to three weights that share one input, for T < KVREF_GEMM_MIN_T rows of x (decode): one
 * dispatch computes every part's rows. y_p[t * ldy + n] = dot(x[t], W_p[n]) (+= with accumulate:
 * the residual add). With xqs/xds (x in 8-bit blocks: qs [T, K], ds [T, K/32, 2]), weights that
 * have an 8-bit kernel read those instead of x. With
 * swiglu, parts 0 and 1 are gate and up of equal N, and each unit finishes its rows with
 * y_0 = silu(y_0) * y_1. Every element is one dot product whatever the split. */
typedef struct kvref_mv_part {
    const uint8_t *w;          /* [N, kvref_row_nbytes(type, K)] */
    int32_t type;
    int64_t N;
    float *y;                  /* [T, ldy], columns [0, N) written */
    int64_t ldy;
} kvref_mv_part;

typedef struct kvref_mv {
    const float *x;            /* [T, K] */
    const int8_t *xqs;         /* [T, K] or NULL */
    const float *xds;          /* [T, K / 32, 2] */
    int64_t T, K;
    int nparts;
    kvref_mv_part part[3];
    int accumulate;
    int swiglu;
} kvref_mv;

void kvref_mv_run(kvref_pool *pool, const kvref_mv *mv);

/* ---- the cache's storage (kvcache.c) ------------------------------------------------------- */

/* KVREF_OK if `kv` is a well-formed cache of n_layers x Hkv x D that holds `positions` positions
 * (every block-table entry they use in range), else the status naming what is wrong */
int kvref_kv_check(const kvref_kv *kv, int64_t n_layers, int64_t Hkv, int64_t D, int64_t positions);
/* the attention arguments' view of layer `layer` of a checked cache (q, positions, T, H, S unset) */
void kvref_kv_layer(const kvref_kv *kv, int64_t layer, kvref_attn_args *a);
/* encode the K and V vectors of one position, k and v [Hkv, D] float32, into its slot in `layer` */
void kvref_kv_store(const kvref_kv *kv, const kvref_kernels *kk, int64_t layer, int64_t position,
                    const float *k, const float *v);

/* per-thread scratch bytes, and shared floats for segment partials, of kvref_attention_run */
size_t kvref_attention_scratch_bytes(int64_t G, int64_t D);
int64_t kvref_attention_partial_floats(int64_t T, int64_t Hkv, int64_t G, int64_t D, int64_t S);
/* the work of kvref_attention for checked arguments (S > 0); partial holds
 * kvref_attention_partial_floats floats */
void kvref_attention_run(kvref_pool *pool, const kvref_attn_args *a, float *partial, float *out);

/* ---- pool internals ------------------------------------------------------------------------- */

/* Runs fn(ctx, unit, thread) for every unit in [0, n_units) on the pool's threads (the caller's
 * thread is thread 0). Units are claimed dynamically, so fn must make each unit's result
 * independent of which thread runs it. Returns when every unit is done. */
typedef void (*kvref_task_fn)(void *ctx, int64_t unit, int thread);
void kvref_pool_run(kvref_pool *pool, kvref_task_fn fn, void *ctx, int64_t n_units);

/* Makes every thread's scratch at least nbytes (64-byte aligned); KVREF_OK or KVREF_ERR_NOMEM. */
int kvref_pool_reserve(kvref_pool *pool, size_t nbytes);
void *kvref_pool_scratch(kvref_pool *pool, int thread);
/* A buffer shared by all threads of one call, at least nbytes; NULL if it cannot be allocated. */
void *kvref_pool_shared(kvref_pool *pool, size_t nbytes);
const kvref_kernels *kvref_pool_kernels(const kvref_pool *pool);
/* Serialise kernel calls on one pool (scratch and the task slot belong to one call at a time). */
void kvref_pool_lock(kvref_pool *pool);
void kvref_pool_unlock(kvref_pool *pool);

#endif /* KVREF_INTERNAL_H */
