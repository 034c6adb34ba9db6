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

/* aarch64: Advanced SIMD is part of the base architecture. sdot and smmla are used through target
 * attributes, which the arm_neon.h of GCC 10 and later honours and clang's from version 16 on
 * (before, it declares them only when the whole file is compiled for those features); older
 * compilers build the plain NEON table alone. */
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define KVREF_NEON 1
#if defined(__clang__) ? __clang_major__ < 16 : __GNUC__ < 10
#define KVREF_NEON_DOT 0
#else
#define KVREF_NEON_DOT 1
#endif
#else
#define KVREF_NEON 0
#define KVREF_NEON_DOT 0
#endif

/* A hint to bring the line at p into the caches (locality 3: L1 ... 0: none), where the compiler has
 * one: GCC and Clang (clang-cl included); MSVC builds go without. */
#if defined(__GNUC__) || defined(__clang__)
#define KVREF_PREFETCH(p, locality) __builtin_prefetch((p), 0, (locality))
#else
#define KVREF_PREFETCH(p, locality) ((void)(p))
#endif

/* ---- block layouts (GGML, as stored in GGUF files) ------------------------------------------ */

#define QK4_0 32
#define QK4_1 32
#define QK8_0 32
#define QK_K 256

#define BYTES_Q4_0 18   /* f16 d; u8 qs[16]: value j = d * ((qs[j % 16] >> 4*(j / 16)) & 15) - 8) */
#define BYTES_Q5_0 22   /* f16 d; u32 qh; u8 qs[16]: value j = d * ((low nibble j as Q4_0 | (qh >> j & 1) << 4) - 16) */
#define BYTES_Q4_1 20   /* f16 d, m; u8 qs[16]: value j = d * nibble(j) + m */
#define BYTES_Q8_0 34   /* f16 d; i8 qs[32]: value j = d * qs[j] */
#define BYTES_Q4_K 144  /* f16 d, dmin; u8 scales[12] (8 x 6-bit scale, 8 x 6-bit min); u8 qs[128] */
#define BYTES_Q6_K 210  /* u8 ql[128], qh[64]; i8 scales[16]; f16 d */
#define BYTES_MXFP4 17  /* u8 e; u8 qs[16]: value j = 2**(e - 128) * kvref_mxfp4_values[nibble j as Q4_0] */

#define KVREF_TYPE_SLOTS 40 /* type ids are < 40 */

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

/* MXFP4: the E2M1 code's value doubled (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, times 2), so
 * that it is an integer, and the E8M0 scale 2**(e - 127) halved to match: 2**(e - 128), exactly
 * (as float32 bits; e = 0 and 1 are subnormal) */
static const int8_t kvref_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static inline float kvref_e8m0_half(uint8_t e) {
    return kvref_fp32_from_bits(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

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

/* The high bits of a Q5_0 block (its bytes 2..5, little-endian): bit j is value j's fifth bit. */
static inline uint32_t kvref_q5_high_bits(const uint8_t *block) {
    uint32_t qh;
    memcpy(&qh, block + 2, 4);
    return qh;
}

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

/* kvref_q4k_scale_min for all eight sub-blocks at once: scales in out[0..7], mins in out[8..15],
 * four bytes per 32-bit word (sub-blocks 4..7 take bits 7:6 of bytes 0..7 as their bits 5:4) */
static inline void kvref_q4k_scales_mins(const uint8_t *scales, uint8_t out[16]) {
    const uint32_t six = 0x3f3f3f3fu, low = 0x0f0f0f0fu, top = 0x30303030u;
    uint32_t s[3], f[4];
    memcpy(s, scales, 12);
    f[0] = s[0] & six;
    f[1] = (s[2] & low) | (s[0] >> 2 & top);
    f[2] = s[1] & six;
    f[3] = (s[2] >> 4 & low) | (s[1] >> 2 & top);
    memcpy(out, f, 16);
}

/* ---- 8-bit activation blocks (the "int8" activation mode) ---------------------------------------
 *
 * A row of K activations (K a multiple of 32) rounded to 8 bits per block of 32, llama.cpp's Q8_1,
 * stored as two arrays so SIMD kernels load several blocks at once:
 *   qs [K]          int8, rint(x * (1/d)) of its block (ties to even), in [-127, 127]
 *   ds [K/32, 2]    float32 per block: d = max|x| / 127 (0 for an all-zero block), s = d * sum of qs
 * x~[j] = d * qs[j] ~ x[j]. d, qs and s are the same on every instruction set (d, 1/d, x * (1/d) and
 * d * s are single IEEE operations, the sum of qs an exact integer). s is the rounded block's sum,
 * not x's: a weight block's offset m (Q4_1, Q4_K) then meets the same x~ its integers do, so the
 * block's result is sum_j w_j x~_j and x's rounding errors are weighted by w_j, which centres on 0,
 * not by w_j - m, which does not (SmolLM2 Q4_1: the sum of x made the mean KL to the exact mode
 * 0.016 where this gives 0.004, as llama.cpp's Q8_1). For finite x,
 * |x * (1/d)| <= 127 * (1 + 2**-22), so qs never needs clamping; the kernels clamp anyway. A
 * block holding a NaN or an infinity gets d = NaN (its qs are 0 or clamped, and meaningless), so
 * every product it enters is NaN, as the exact float32 product would be NaN or infinite there:
 * rounding never turns a bad value into a finite one. */

/* the exact scale and inverse scale of a block whose largest magnitude is amax (finite: no value of
 * the block is NaN or infinite) */
static inline void kvref_q8_scale(float amax, int finite, float *d, float *id) {
    *d = finite ? amax / 127.0f : NAN;
    *id = finite && *d != 0.0f ? 1.0f / *d : 0.0f;
}

/* ---- the 8-bit GEMM tile (int8 activations, many rows of x) ------------------------------------
 *
 * KVREF_TILE_N weight rows of a type kvref_q8_tile_type takes, decoded to their integers in blocks
 * of bv = kvref_q8_tile_values(type) values that share a scale (32; Q6_K's sub-blocks are 16), one
 * record of KVREF_Q8_TILE_RECORD(bv) bytes per block b (at b * KVREF_Q8_TILE_RECORD(bv)):
 *   qs   [bv/4][KVREF_TILE_N][4] int8  value 4s + i of row n's block at qs[s][n][i]: four
 *                                    consecutive values per 32-bit lane, the operand of a
 *                                    four-byte dot product
 *   zero [KVREF_TILE_N] int32       -128 * the sum of the row's bv values: x is read as unsigned
 *                                    bytes q + 128, and this takes the 128s back out exactly
 *   d    [KVREF_TILE_N] float32     the block's scale
 *   m    [KVREF_TILE_N] float32     the block's offset (Q4_1's and Q4_K's; 0 for the symmetric types)
 * so row n's value j is d * q_j + m. Rows from nw on are all zero. */
#define KVREF_Q8_TILE_RECORD(bv) ((bv) * KVREF_TILE_N + 3 * 4 * KVREF_TILE_N)
#define KVREF_Q8_TILE_ZERO(bv) ((bv) * KVREF_TILE_N)     /* byte offsets in a record */
#define KVREF_Q8_TILE_D(bv) (KVREF_Q8_TILE_ZERO(bv) + 4 * KVREF_TILE_N)
#define KVREF_Q8_TILE_M(bv) (KVREF_Q8_TILE_D(bv) + 4 * KVREF_TILE_N)
/* a tile of K values' records (44 K bytes for 32-value blocks, 56 K for 16) and a decoder's
 * staging rows (40 K bytes) */
#define KVREF_Q8_TILE_SCRATCH(K) (96 * (K))

/* ---- attention chunk kernels (the skeleton that drives them is csrc/attention.c) ------------ */

/* What every attention kernel reads: the queries, one layer of the cache and the positions. */
typedef struct kvref_attn_args {
    const float *q;            /* [T, H, D] */
    const uint8_t *k, *v;      /* the layer's slots [n_slots, Hkv, D] of k_type / v_type */
    const float *k_scales, *v_scales; /* the layer's I8 scales [n_slots, Hkv, D / group_size] or NULL;
                                         KIVI4: V's (scale, zero) pairs, K's group params (kvref.h) */
    const uint16_t *k_residual; /* KIVI4 K: the layer's float16 rows [group_size, Hkv, D], else NULL */
    int32_t k_type, v_type;
    int64_t group_size;
    const int64_t *block_table; /* key s is in slot table[s / block_size] * block_size + s % block_size */
    int64_t block_size;        /* ... or in slot s when block_table is NULL */
    const int64_t *q_positions, *k_positions; /* [T], [S] */
    int64_t T, H, D, S, Hkv, G;
    int64_t Dv;                /* the values' width: each V vector's first Dv <= D elements (MLA: the
                                  latent c_kv inside the latent key); acc and out hold Dv per head */
    int64_t window;            /* a query at p sees keys at p - window < kp <= p; 0: every kp <= p */
    float scale;               /* what scores are multiplied by */
    float softcap;             /* > 0: scaled scores -> kvref_soft_cap_value(score, softcap) before the mask; 0: none */
    const float *sinks;        /* [H] each head's sink logit, joining its softmax denominator with no
                                  value (gpt-oss), or NULL */
} kvref_attn_args;

/* Gemma 2's soft cap of one score or logit: cap * tanh(x / cap) for finite x, x itself otherwise
 * (kvref.spec.ops.soft_cap: tanh would turn an infinity into a finite cap) */
static inline float kvref_soft_cap_value(float x, float cap) { return isfinite(x) ? cap * tanhf(x / cap) : x; }

/* Keys the skeleton hands the kernels per step; how far ahead of the keys it scores a kernel
 * prefetches (one chunk); and so how many keys past a chunk the skeleton looks up rows for. */
#define KVREF_ATTN_CHUNK 64
#define KVREF_ATTN_PREFETCH_KEYS 64
#define KVREF_ATTN_LOOKAHEAD (KVREF_ATTN_PREFETCH_KEYS + 8)

/* A chunk of n <= KVREF_ATTN_CHUNK consecutive keys, as the skeleton hands it to the kernels of one
 * query and kv head hk: key s's K vector is the D elements (of k_type) at element k + row[s], its
 * I8 scales the D / group_size floats at k_scales + srow[s]; V likewise. C = KVREF_ATTN_CHUNK. */
typedef struct kvref_attn_chunk {
    const float *q;            /* [G, D]: the query's G heads that share kv head hk */
    const uint8_t *k, *v;      /* kv head hk's vector in slot 0 of the layer's K and V */
    const float *k_scales, *v_scales; /* kv head hk's I8 scales in slot 0, or NULL */
    const uint16_t *k_residual; /* KIVI4 K: kv head hk's vector in residual row 0, else NULL */
    const int64_t *row, *srow; /* [nrows] from kvref_attn_rows: the chunk's n keys, then keys ahead */
    int64_t n, nrows;          /* n <= nrows <= n + KVREF_ATTN_LOOKAHEAD; nrows = n (nothing to
                                  prefetch) for runs of many queries (attention.c) */
    const int64_t *kp;         /* [n]: the keys' positions; key s is visible iff klo <= kp[s] <= qpos */
    int64_t qpos, klo;         /* klo: the query's window start (INT64_MIN without a window) */
    int all;                   /* every key of the chunk is visible (none visible: never handed over) */
    /* an I8 K's query, its G heads rounded per scale group (kvref_attn_score_fn): q8 [G, D], and per
     * group b of each head qe [G, D / group_size] = d_b * scale and qsum [G, D / group_size] = the
     * sum of its q8; unset for other K types */
    const int8_t *q8;
    const float *qe;
    const int32_t *qsum;
} kvref_attn_chunk;

/* Whether key s of a chunk is masked for its query: kp[s] outside [klo, qpos], tested as one unsigned
 * comparison of offsets from klo (klo <= qpos always; the offsets wrap instead of overflowing). */
static inline int kvref_attn_hidden(const kvref_attn_chunk *c, int64_t s) {
    return (uint64_t)c->kp[s] - (uint64_t)c->klo > (uint64_t)c->qpos - (uint64_t)c->klo;
}

/* p[g * C + s] = dot(q[g], k_s) * a->scale for every visible key s < n of the chunk and g < G, stored
 * through kvref_attn_score_value; p [G, C]. A masked key's entry may hold anything (the skeleton
 * overwrites it with -inf). Keys from n to nrows are the next chunk's: a kernel may prefetch their K
 * (and V) while it scores.
 *
 * An I8 K is scored with integer dot products (kvref.spec.ops.int8_key_scores): the skeleton rounds
 * each query head to 8 bits per scale group b of group_size elements, as the int8 activation mode
 * rounds its blocks (kvref_q8_scale: d_b = max|q| / 127, q8 = rint(q * (1 / d_b))), and sets
 * e_b = d_b * scale (c->q8, c->qe). Then, with I_b = sum_j q8_j k8_j over the group (exact) and
 * ks_b the key's scale,
 *     score = sum over b, in order from 0, starting from 0, of (float)I_b * (e_b * ks_b)
 * each product and each sum one float32 rounding (never fused): integers are exact in any order, so
 * every instruction set computes the same bits. */
typedef void (*kvref_attn_score_fn)(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p);
/* A score as the kernels store it: NaN if it is not finite (inf x 0 is NaN), else itself, exactly
 * (score + score * 0 = score + 0). In p, -inf is the skeleton's mark of a masked key (probability
 * exp(-inf) = 0); a seen key whose q . k is -inf (an infinite q or k, or an overflow) must instead
 * make its head's output NaN, kvref.spec.ops.attention's rule, as NaN and +inf do through the
 * softmax arithmetic (csrc/attention.c). One multiply-add, no compare: the AVX-512 kernel's
 * compare-and-blend made decode attention about 6 % slower (S = 4096, one thread). */
static inline float kvref_attn_score_value(float score) { return score + score * 0.0f; }
/* The exponentials of a chunk's n >= 1 keys for the G heads of a group: for each g < G, mnew[g] =
 * max(m[g], max_s p[g * C + s]), p[g * C + s] = exp(p[g * C + s] - mnew[g]) in place (0 for a masked
 * key's -inf) and sum[g] = the sum of those. p [G, C]; m, mnew, sum [G]. */
typedef void (*kvref_attn_exp_fn)(int64_t G, int64_t n, const float *m, float *p, float *mnew, float *sum);
/* acc[g * Dv + i] += sum over the visible keys s of p[g * C + s] * v_s[i], for g < G, i < Dv: p [G, C],
 * acc [G, Dv]. A masked key never touches acc. */
typedef void (*kvref_attn_values_fn)(const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc);

/* One instruction set's attention kernels. Their vectors read an I8 K or V one scale group at a time,
 * so they take I8 only when i8_lanes divides group_size; otherwise the skeleton runs the scalar
 * table's three kernels instead, and the results are the scalar table's whatever the instruction set. */
typedef struct kvref_attn_kernels {
    kvref_attn_score_fn score;
    kvref_attn_exp_fn exp;
    kvref_attn_values_fn values;
    int64_t i8_lanes;          /* 1 for kernels that take any group size */
    int64_t kivi_lanes;        /* KIVI4 taken when kivi_lanes divides group_size and head_dim (1: any);
                                  0: never (the scalar table's kernels run instead) */
} kvref_attn_kernels;

/* Where the slots of keys c0 .. c0+n-1 are: row[i] is the element offset of key c0 + i's slot in the
 * layer's K and V arrays (slot * Hkv * D; kv head hk's vector is hk * D further), srow[i] the offset
 * of its first I8 scale (slot * Hkv * D / group_size; left unwritten when group_size is 0: nothing
 * is I8). The slots follow the block table one block at a time (one division per call, none per
 * key); within a block they are consecutive, so the offsets step by a constant: loops of additions,
 * which compilers vectorize for baseline x86-64 (multiplying int64 lanes needs AVX-512). */
static inline void kvref_attn_rows(const kvref_attn_args *a, int64_t c0, int64_t n, int64_t *row, int64_t *srow) {
    const int64_t *table = a->block_table;
    const int64_t ng = a->group_size > 0 ? a->D / a->group_size : 0;
    const int64_t rstep = a->Hkv * a->D, sstep = a->Hkv * ng;
    const int64_t bs = table != NULL ? a->block_size : INT64_MAX;
    int64_t b = c0 / bs, o = c0 % bs;
    for (int64_t i = 0; i < n;) {
        const int64_t slot = table != NULL ? table[b] * bs + o : c0 + i;
        const int64_t len = bs - o < n - i ? bs - o : n - i; /* keys left in this block */
        int64_t r = slot * rstep;
        for (int64_t j = i; j < i + len; j++, r += rstep) row[j] = r;
        if (ng > 0) {
            int64_t sr = slot * sstep;
            for (int64_t j = i; j < i + len; j++, sr += sstep) srow[j] = sr;
        }
        i += len;
        o = 0;
        b++;
    }
}

/* Bytes of one stored K/V element of `type`; -1 for a type a cache cannot store. */
static inline int64_t kvref_kv_element_bytes(int32_t type) {
    switch (type) {
    case KVREF_TYPE_F32: return 4;
    case KVREF_TYPE_F16: case KVREF_TYPE_BF16: return 2;
    case KVREF_TYPE_I8: return 1;
    case KVREF_TYPE_KIVI4: return 1; /* per two elements: see kvref_kv_vector_bytes */
    default: return -1;
    }
}

/* The most positions a KIVI4 K group may hold (kvref/cache/quant.py's KIVI_MAX_GROUP) */
#define KVREF_KIVI_MAX_GROUP 256

/* Bytes of one stored head vector of D elements of `type` (a KIVI4 byte holds two) */
static inline int64_t kvref_kv_vector_bytes(int32_t type, int64_t D) {
    return type == KVREF_TYPE_KIVI4 ? D / 2 : D * kvref_kv_element_bytes(type);
}

/* The KIVI4 kernels (csrc/scalar.c, the reference; csrc/kernels_avx2.c, csrc/kernels_avx512.c). Key s
 * of a chunk is key kp - k_positions + s of the layer; keys from S - S % group_size on are K residual
 * rows. */
void kvref_attn_score_kivi_ref(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p);
void kvref_attn_values_kivi_ref(const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc);

/* Ask for the K or V vectors (base and type: a chunk's k or v, kv head hk's part of each slot;
 * rows from kvref_attn_rows) of keys i0 .. i0+7, those of the nrows looked up, to be brought into
 * L2, one 64-byte line at a time. A SIMD kernel calls this every 8 keys for the keys one chunk
 * ahead (row[n ..] of its chunk), so each line is asked for a whole chunk (all kv heads' turns)
 * before it is read: the AVX-512 kernels ask for K while they score and for V while they sum
 * values, which spreads the requests over the work. Without it, attention over a cache streamed
 * from DRAM waits on memory at every group of keys: the kernels read one kv head's part of each
 * slot (a third for SmolLM2, Hkv = 3), a strided pattern the hardware prefetchers follow poorly. One
 * chunk ahead into L2 is the measured best: further ahead, every other line, or into L1 were
 * slower (figures in docs/benchmarks.md). */
static inline void kvref_attn_prefetch(const uint8_t *base, int32_t type, int64_t D, const int64_t *row, int64_t i0,
                                       int64_t nrows) {
    const int64_t width = kvref_kv_element_bytes(type), i1 = i0 + 8 < nrows ? i0 + 8 : nrows;
    for (int64_t i = i0; i < i1; i++)
        for (int64_t o = 0; o < D * width; o += 64) KVREF_PREFETCH(base + row[i] * width + o, 2);
}

/* Ask for the I8 scales of K and V (those that are I8) of keys i0 .. i0+15 of the nrows looked up,
 * one 64-byte line per key: a slot's scales are a few floats, so nearby keys share lines, and a
 * prefetch of a line already on its way costs little. Without it, the scale loads waited on memory
 * where the K/V vectors, prefetched a chunk ahead, did not. */
static inline void kvref_attn_prefetch_scales(const kvref_attn_chunk *c, int64_t i0) {
    const int64_t i1 = i0 + 16 < c->nrows ? i0 + 16 : c->nrows;
    for (int64_t i = i0; i < i1; i++) {
        if (c->k_scales != NULL) KVREF_PREFETCH(c->k_scales + c->srow[i], 2);
        if (c->v_scales != NULL) KVREF_PREFETCH(c->v_scales + c->srow[i], 2);
    }
}

/* ---- kernel table: one per instruction set -------------------------------------------------- */

/* dot of one weight row (K values in `type` blocks) with x [K] */
typedef float (*kvref_vec_dot_fn)(int64_t K, const uint8_t *w_row, const float *x);
/* one weight row (K values) -> float32 [K], each value rounded exactly as the NumPy dequantizer does */
typedef void (*kvref_dequant_fn)(int64_t K, const uint8_t *w_row, float *out);
/* out[t * ldo] = vec_dot(K, w_row, x + t * K) for t < T, bit for bit: x [T, K]. Each weight block is
 * loaded and decoded once for all T rows of x; every row keeps the single-row kernel's accumulators
 * and reduction. NULL in a table: one vec_dot call per row (the definition). */
typedef void (*kvref_vec_dot_rows_fn)(int64_t K, const uint8_t *w_row, const float *x, int64_t T, float *out,
                                      int64_t ldo);

/* A SIMD file's vec_dot_<name> (one row of x) and vec_dot_rows_<name> (blocks of RB rows of x, then
 * 2, then 1) from its dot_<name>(K, w, x, R, out, ldo), which dots weight row w with rows 0..R-1 of x
 * [R, K] into out[r * ldo], R a constant once inlined; TARGET is the including file's. */
#define KVREF_DOT_KERNELS(name, RB)                                                                      \
    TARGET static float vec_dot_##name(int64_t K, const uint8_t *w, const float *x) {                    \
        float r;                                                                                         \
        dot_##name(K, w, x, 1, &r, 0);                                                                   \
        return r;                                                                                        \
    }                                                                                                    \
    TARGET static void vec_dot_rows_##name(int64_t K, const uint8_t *w, const float *x, int64_t T, float *out, \
                                           int64_t ldo) {                                                \
        int64_t t = 0;                                                                                   \
        for (; t + (RB) <= T; t += (RB)) dot_##name(K, w, x + t * K, (RB), out + t * ldo, ldo);          \
        for (; t + 2 <= T; t += 2) dot_##name(K, w, x + t * K, 2, out + t * ldo, ldo);                   \
        for (; t < T; t++) dot_##name(K, w, x + t * K, 1, out + t * ldo, ldo);                           \
    }

/* The entries a SIMD table fills with its file's functions of these names: vec_dot_<type>,
 * vec_dot_rows_<type> (KVREF_DOT_KERNELS) and dequant_<type> for every weight type, and the
 * one-per-table kernels; the table adds .isa, .attn and its 8-bit kernels. */
#define KVREF_WEIGHT_TYPE_ENTRIES(prefix)                                                                \
    {                                                                                                    \
        [KVREF_TYPE_F32] = prefix##f32, [KVREF_TYPE_F16] = prefix##f16, [KVREF_TYPE_BF16] = prefix##bf16, \
        [KVREF_TYPE_Q4_0] = prefix##q4_0, [KVREF_TYPE_Q4_1] = prefix##q4_1, [KVREF_TYPE_Q5_0] = prefix##q5_0, \
        [KVREF_TYPE_Q8_0] = prefix##q8_0, [KVREF_TYPE_Q4_K] = prefix##q4_k, [KVREF_TYPE_Q6_K] = prefix##q6_k, \
        [KVREF_TYPE_MXFP4] = prefix##mxfp4,                                                              \
    }
#define KVREF_SIMD_TABLE_COMMON                                                                          \
    .vec_dot = KVREF_WEIGHT_TYPE_ENTRIES(vec_dot_), .vec_dot_rows = KVREF_WEIGHT_TYPE_ENTRIES(vec_dot_rows_), \
    .dequant = KVREF_WEIGHT_TYPE_ENTRIES(dequant_), .gemm_f32 = gemm_f32, .tile_columns = tile_columns,   \
    .swiglu = swiglu, .geglu = geglu, .swiglu_oai = swiglu_oai, .quantize_q8 = quantize_q8,             \
    .read_sum = read_sum, .to_fp16 = to_fp16

/* out[t * 16 + r] = row r of a packed group (K values; the layout is below) dotted with row t of x
 * in 8-bit blocks, for t < T <= 8, r < 16: the 8-bit GEMM's sum (kvref_gemm_q8_fn) over blocks b
 * (Q6_K: its 16-value sub-blocks) in order from 0 of fl(d_x d_w) I_b, then (Q4_1, Q4_K) m_w s_x,
 * each a fused multiply-add, bit for bit. qs [T, K], ds [T, K/32, 2], xsum [T, K/16]: x's 8-bit
 * values, their blocks' (d_x, s_x) and the integer sums of their 16-value halves. */
typedef void (*kvref_packed_dot_fn)(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs, const float *ds,
                                    const int32_t *xsum, int64_t T, float *out);
/* x [K] (K a multiple of 32) -> qs [K], ds [K/32, 2] */
typedef void (*kvref_quantize_q8_fn)(int64_t K, const float *x, int8_t *qs, float *ds);
/* y[t * ldy + n] = sum over k of x[t, k] * tile[k, n] for t < T, n < nw, each a chain of
 * multiply-adds in k order from 0 (fused on the SIMD tables): x [T, K]; tile [K, KVREF_TILE_N]
 * float32, 64-byte aligned, the transposed weight rows, columns nw .. KVREF_TILE_N-1 zero. An
 * element's operations do not depend on T, nw or where the kernel's blocking puts it. */
typedef void (*kvref_gemm_fn)(int64_t K, const float *x, int64_t T, const float *tile, int64_t nw,
                              float *y, int64_t ldy);
/* y[t * ldy + n] = sum over the tile's blocks b (bv values each), in order from 0, of
 * fl(d_x d_w) I_b as one fused multiply-add into the float32 sum, then (with affine) m_w s_x as
 * another, for t < T, n < nw: I_b the exact integer dot product of the block's x bytes with the
 * weight row's values, d_x and s_x those of the 32-value x block it lies in. xu [T, K] are x's
 * 8-bit values plus 128 (unsigned), xds [T, K/32, 2] their blocks' (d_x, s_x); tile as above,
 * 64-byte aligned. An element's operations do not depend on T, nw or the kernel's blocking. */
/* rows 0 .. nw-1 of w (rb bytes each, K values of a type kvref_q8_tile_type takes whose blocks are
 * 32 values) -> an 8-bit tile as above, rows nw .. KVREF_TILE_N-1 zero; `tile` has room for
 * KVREF_Q8_TILE_SCRATCH(K) bytes, and a decoder may stage rows past the tile's records */
typedef void (*kvref_q8_tile_fn)(int32_t type, int64_t K, const uint8_t *w, int64_t rb, int64_t nw, uint8_t *tile);
/* the portable 8-bit tile decoder (matmul.c), for every type kvref_q8_tile_type takes: what a table's
 * q8_tile must equal byte for byte, and what runs where it is NULL or the blocks are 16 values */
void kvref_q8_tile_ref(int32_t type, int64_t K, const uint8_t *w, int64_t rb, int64_t nw, uint8_t *tile);
typedef void (*kvref_gemm_q8_fn)(int64_t K, const uint8_t *xu, const float *xds, int64_t T, const uint8_t *tile,
                                 int64_t bv, int64_t nw, int affine, float *y, int64_t ldy);
/* tile[k * KVREF_TILE_N + i] = rows[i * K + k] for i < 16, k < K: sixteen dequantized weight rows
 * [16, K] into sixteen columns of a tile (tile 64-byte aligned; the caller offsets it by 0 or 16) */
typedef void (*kvref_tile_columns_fn)(int64_t K, const float *rows, float *tile);

/* GELU's tanh form, 0.5 g (1 + tanh(C (g + K g^3))): its constants rounded to float32 as
 * kvref.spec.ops.gelu_tanh rounds them (C = sqrt(2 / pi)) */
#define KVREF_GELU_C ((float)0.7978845608028654)
#define KVREF_GELU_K 0.044715f

/* gpt-oss's clamped SwiGLU (kvref.spec.ops.swiglu_oai): the sigmoid's gain and the clamp */
#define KVREF_SWIGLU_OAI_ALPHA 1.702f
#define KVREF_SWIGLU_OAI_LIMIT 7.0f

/* out[i] = act(gate[i]) * up[i] for i < n (out may be gate or up): SwiGLU, GeGLU, or gpt-oss's
 * min(g, L) sigmoid(alpha min(g, L)) (clamp(u, -L, L) + 1) */
typedef void (*kvref_glu_fn)(int64_t n, const float *gate, const float *up, float *out);

typedef struct kvref_kernels {
    int32_t isa;
    kvref_vec_dot_fn vec_dot[KVREF_TYPE_SLOTS];
    kvref_vec_dot_rows_fn vec_dot_rows[KVREF_TYPE_SLOTS]; /* several rows of x (NULL: vec_dot per row) */
    kvref_dequant_fn dequant[KVREF_TYPE_SLOTS];
    kvref_gemm_fn gemm_f32;
    kvref_tile_columns_fn tile_columns;
    kvref_attn_kernels attn;
    kvref_glu_fn swiglu;       /* silu(g) * u */
    kvref_glu_fn geglu;        /* gelu_tanh(g) * u */
    kvref_glu_fn swiglu_oai;   /* gpt-oss's clamped SwiGLU */
    /* 8-bit activations */
    kvref_packed_dot_fn packed_dot; /* packed weights (below), up to 8 rows of x a call */
    kvref_quantize_q8_fn quantize_q8;
    kvref_gemm_q8_fn gemm_q8;  /* many rows of 8-bit x against 8-bit tiles (NULL: packed weights) */
    kvref_q8_tile_fn q8_tile;  /* 8-bit tiles of a 32-value type (NULL: matmul.c's portable decoder) */
    /* the wrapping sum of the n / 8 64-bit words at p (n a multiple of 256, p 64-byte aligned) */
    uint64_t (*read_sum)(const uint8_t *p, int64_t n);
    /* out[i] = kvref_fp32_to_fp16(x[i]) */
    void (*to_fp16)(int64_t n, const float *x, uint16_t *out);
} kvref_kernels;

/* the kernel table's function for a kvref_gate (kvref.h) */
static inline kvref_glu_fn kvref_gate_fn(const kvref_kernels *kk, int32_t gate) {
    return gate == KVREF_GATE_GELU_TANH ? kk->geglu : gate == KVREF_GATE_SWIGLU_OAI ? kk->swiglu_oai : kk->swiglu;
}

extern const kvref_kernels kvref_kernels_scalar;
#if KVREF_X86
extern const kvref_kernels kvref_kernels_avx2;
extern const kvref_kernels kvref_kernels_avx512;
extern const kvref_kernels kvref_kernels_avx512_vnni; /* avx512 plus VNNI 8-bit dot products */
/* the AVX2 kernel of packed weights (maddubs), which AVX-512 CPUs without VNNI use too */
void kvref_avx2_packed_dot(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs, const float *ds,
                           const int32_t *xsum, int64_t T, float *out);
/* the AVX2 score kernel of an I8 K (maddubs), which AVX-512 CPUs without VNNI use too */
void kvref_avx2_attn_score_i8(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p);
#endif

#if KVREF_NEON
extern const kvref_kernels kvref_kernels_neon;
#if KVREF_NEON_DOT
extern const kvref_kernels kvref_kernels_neon_dotprod; /* neon plus sdot */
extern const kvref_kernels kvref_kernels_neon_i8mm;    /* neon plus sdot and smmla */
#endif
#endif

/* scalar reference pieces the SIMD tables reuse for types they do not specialise */
void kvref_dequant_row(int32_t type, int64_t K, const uint8_t *w_row, float *out);
/* the portable score kernel of an I8 K (kvref_attn_score_fn; the integer scoring above) */
void kvref_attn_score_i8_ref(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p);
/* Whether the 8-bit GEMM takes weights of this type: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K (whose 32-value
 * sub-blocks have a scale and an offset each) and Q6_K (16-value sub-blocks with a scale each) */
static inline int kvref_q8_tile_type(int32_t type) {
    return type == KVREF_TYPE_Q4_0 || type == KVREF_TYPE_Q4_1 || type == KVREF_TYPE_Q5_0 ||
           type == KVREF_TYPE_Q8_0 || type == KVREF_TYPE_Q4_K || type == KVREF_TYPE_Q6_K;
}
/* values per block of one scale, for those types */
static inline int64_t kvref_q8_tile_values(int32_t type) { return type == KVREF_TYPE_Q6_K ? 16 : 32; }
/* block b (kvref_q8_tile_values(type) values) of a weight row of such a type -> its scale d and
 * offset m (0 but for Q4_1 and Q4_K), and (kvref_q8_weight_block) its integers q: value j is
 * d * q[j] + m */
/* bytes of one 32-value block of Q4_0, Q4_1, Q5_0 or Q8_0 */
static inline int64_t kvref_q8_block_bytes(int32_t type) {
    return type == KVREF_TYPE_Q4_0 ? BYTES_Q4_0 : type == KVREF_TYPE_Q4_1 ? BYTES_Q4_1
           : type == KVREF_TYPE_Q5_0 ? BYTES_Q5_0 : BYTES_Q8_0;
}
static inline void kvref_q8_block_scales(int32_t type, const uint8_t *row, int64_t b, float *d, float *m) {
    *m = 0.0f;
    switch (type) {
    case KVREF_TYPE_Q6_K: { /* sub-block b % 16 of a super-block: d * sc_j * q */
        const uint8_t *w = row + b / 16 * BYTES_Q6_K;
        *d = kvref_load_fp16(w + 208) * (float)(int8_t)w[192 + b % 16]; /* exact: 11 x 8 bits */
        return;
    }
    case KVREF_TYPE_Q4_K: { /* sub-block j of a super-block: d * sc_j * q - dmin * m_j */
        const uint8_t *w = row + b / 8 * BYTES_Q4_K;
        uint8_t sc, mn;
        kvref_q4k_scale_min((int)(b % 8), w + 4, &sc, &mn);
        *d = kvref_load_fp16(w) * (float)sc; /* both exact: an 11-bit by a 6-bit integer */
        *m = -(kvref_load_fp16(w + 2) * (float)mn);
        return;
    }
    case KVREF_TYPE_Q4_1:
        *d = kvref_load_fp16(row + b * BYTES_Q4_1);
        *m = kvref_load_fp16(row + b * BYTES_Q4_1 + 2);
        return;
    default: /* Q4_0, Q5_0, Q8_0: the scale leads the block */
        *d = kvref_load_fp16(row + b * kvref_q8_block_bytes(type));
    }
}
static inline void kvref_q8_weight_block(int32_t type, const uint8_t *row, int64_t b, int8_t *q, float *d, float *m) {
    kvref_q8_block_scales(type, row, b, d, m);
    if (type == KVREF_TYPE_Q6_K) { /* dequant_q6_k's order */
        const uint8_t *w = row + b / 16 * BYTES_Q6_K;
        const int j = (int)(b % 16), half = j / 8, g = j % 8 / 2, l0 = 16 * (j % 2);
        const uint8_t *ql = w + 64 * half + 32 * (g % 2), *qh = w + 128 + 32 * half;
        for (int i = 0; i < 16; i++)
            q[i] = (int8_t)((((ql[l0 + i] >> (4 * (g / 2))) & 0xF) | (((qh[l0 + i] >> (2 * g)) & 3) << 4)) - 32);
        return;
    }
    if (type == KVREF_TYPE_Q4_K) {
        const uint8_t *qs = row + b / 8 * BYTES_Q4_K + 16 + 32 * (b % 8 / 2);
        const int shift = 4 * (int)(b % 2);
        for (int i = 0; i < 32; i++) q[i] = (int8_t)((qs[i] >> shift) & 0xF);
        return;
    }
    const uint8_t *w = row + b * kvref_q8_block_bytes(type);
    switch (type) {
    case KVREF_TYPE_Q4_0:
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)((w[2 + j] & 0xF) - 8);
            q[j + 16] = (int8_t)((w[2 + j] >> 4) - 8);
        }
        return;
    case KVREF_TYPE_Q4_1:
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)(w[4 + j] & 0xF);
            q[j + 16] = (int8_t)(w[4 + j] >> 4);
        }
        return;
    case KVREF_TYPE_Q5_0: {
        const uint32_t qh = kvref_q5_high_bits(w);
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)(((w[6 + j] & 0xF) | ((qh >> j & 1u) << 4)) - 16);
            q[j + 16] = (int8_t)(((w[6 + j] >> 4) | ((qh >> (j + 16) & 1u) << 4)) - 16);
        }
        return;
    }
    default: /* KVREF_TYPE_Q8_0 */
        memcpy(q, w + 2, 32);
    }
}
/* ---- packed weights of the int8 activation mode ---------------------------------------------
 * Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K weight rows packed 16 at a time (kvref_pack_int8), so that
 * one 4-byte dot product instruction (VNNI vpdpbusd, AVX2 maddubs) multiplies 16 weight rows by the
 * same 4 bytes of x, each lane its own row: no horizontal sums, and a block's values are decoded
 * once for every row of x. Every field keeps the file's bit width, so a decode step reads the bytes
 * of the file: exactly its bytes for every type but Q6_K, 1.0095x for its header's padding.
 * A record is one 32-value block of the 16 rows:
 *   - Q4_0, Q4_1, Q5_0, Q8_0: first their scales, float16 d [16] as in the file (Q4_1: then m [16]);
 *     the K-quants' records hold no scales (their super-block's header does, below);
 *   - then the high bits of 5- and 6-bit values, then the values: unsigned bytes u = q + bias, q the
 *     signed integer of kvref_q8_weight_block (bias 8 for Q4_0, 16 for Q5_0, 128 for Q8_0, 32 for
 *     Q6_K, 0 for Q4_1 and Q4_K), in 8 vectors of 64 bytes: vector v holds values 4v .. 4v+3 of row
 *     r at bytes 4r .. 4r+3. Q8_0 stores them; the others store u % 16, vectors v and v + 4 as the
 *     low and high nibbles of one (4 vectors); Q5_0's bit 4 of u as 8 masks of 64 bits (bit 4r + i of
 *     mask v: value 4v + i of row r), Q6_K's bits 4-5 as two vectors of 2-bit fields (byte 4r + i of
 *     vector g: those of vectors 4g, 4g + 1, 4g + 2, 4g + 3 in its bits 0-1, 2-3, 4-5, 6-7).
 * A K-quant super-block (256 values: 8 records) of the 16 rows starts with a header of
 * kvref_pack_header_bytes, the file's fields of the 16 rows side by side (row r at index r):
 *   - Q4_K (256 bytes): d [16], dmin [16] float16; then the 12 bytes that hold each row's six-bit
 *     scales and mins in the file (kvref_q4k_scale_min), as 12 planes [12][16] (byte k of row r at
 *     16 k + r). A kernel unpacks the 16 rows' sc [8][16] and m [8][16] from them once per
 *     super-block, 64 bytes (4 planes) at a time: sc 0-3 = planes 0-3 & 63, m 0-3 = planes 4-7 & 63,
 *     sc 4-7 = the low nibbles of planes 8-11 with bits 7:6 of planes 0-3 as bits 5:4, m 4-7 = their
 *     high nibbles with those of planes 4-7 (kvref_q4k_scales_mins's operations, 16 rows wide);
 *   - Q6_K (320 bytes): d [16] float16; the 8-bit scales sc [16][16] (16-value sub-block j of row r
 *     at 16 j + r); 32 zero bytes.
 *   Either way the records start 64-byte aligned.
 * Record b's scales are kvref_q8_block_scales's, products of two of those fields computed in the
 * kernel (exact in float32): Q4_K d sc_j and -(dmin m_j), Q6_K d sc of each 16-value half.
 * A group of 16 rows is its K / 32 records in block order (each K-quant super-block's header before
 * its 8), kvref_pack_group_bytes in all, and a packed matrix its N / 16 groups. The dot products
 * count u x, and q x = u x - bias sum(x) takes the bias off with x's sums per 16 values
 * (kvref_mv.xsum). */
#define KVREF_PACK_ROWS 16
/* With 4 or more rows of x, the packed kernels ask for the record this many ahead of the one they
 * multiply: a record then takes long enough to multiply that the hardware prefetcher alone leaves
 * the next one's loads waiting on memory. With fewer rows the kernels stream near the read
 * bandwidth and the requests only cost issue slots (docs/benchmarks.md). */
#ifndef KVREF_PACK_PREFETCH_RECORDS /* benchmarks/packed_kernel.py builds other distances */
#define KVREF_PACK_PREFETCH_RECORDS 4
#endif
/* every cache line of the record of `bytes` at rec, into L1 */
static inline void kvref_pack_prefetch(const uint8_t *rec, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) KVREF_PREFETCH(rec + off, 3);
}
static inline int kvref_packable(int32_t type) { return kvref_q8_tile_type(type); }
static inline int32_t kvref_pack_bias(int32_t type) {
    switch (type) {
    case KVREF_TYPE_Q4_0: return 8;
    case KVREF_TYPE_Q5_0: return 16;
    case KVREF_TYPE_Q8_0: return 128;
    case KVREF_TYPE_Q6_K: return 32;
    default: return 0; /* Q4_1, Q4_K */
    }
}
/* whether the type's scales live in super-block headers (the K-quants), and its 64-byte vectors of high
 * bits (0, 1 or 2) */
static inline int kvref_pack_kquant(int32_t type) { return type == KVREF_TYPE_Q4_K || type == KVREF_TYPE_Q6_K; }
static inline int kvref_pack_planes(int32_t type) {
    return type == KVREF_TYPE_Q5_0 ? 1 : type == KVREF_TYPE_Q6_K ? 2 : 0;
}
/* where a record's high-bit planes and values start, and its bytes */
static inline int64_t kvref_pack_planes_at(int32_t type) {
    return kvref_pack_kquant(type) ? 0 : type == KVREF_TYPE_Q4_1 ? 64 : 32;
}
static inline int64_t kvref_pack_values_at(int32_t type) { return kvref_pack_planes_at(type) + 64 * kvref_pack_planes(type); }
static inline int64_t kvref_pack_record_bytes(int32_t type) {
    return kvref_pack_values_at(type) + (type == KVREF_TYPE_Q8_0 ? 512 : 256);
}
/* records per span (a K-quant super-block; 1 for the others), its header's bytes, and a span's bytes,
 * header included */
static inline int64_t kvref_pack_span(int32_t type) { return kvref_pack_kquant(type) ? QK_K / 32 : 1; }
static inline int64_t kvref_pack_header_bytes(int32_t type) {
    return type == KVREF_TYPE_Q4_K ? 256 : type == KVREF_TYPE_Q6_K ? 320 : 0;
}
static inline int64_t kvref_pack_span_bytes(int32_t type) {
    return kvref_pack_header_bytes(type) + kvref_pack_span(type) * kvref_pack_record_bytes(type);
}
/* bytes of a group of 16 rows of K values */
static inline int64_t kvref_pack_group_bytes(int32_t type, int64_t K) {
    return K / 32 / kvref_pack_span(type) * kvref_pack_span_bytes(type);
}
/* the header of record b's span in a group (the K-quants'), and record b */
static inline const uint8_t *kvref_pack_header(int32_t type, const uint8_t *group, int64_t b) {
    return group + b / kvref_pack_span(type) * kvref_pack_span_bytes(type);
}
static inline const uint8_t *kvref_pack_record(int32_t type, const uint8_t *group, int64_t b) {
    return kvref_pack_header(type, group, b) + kvref_pack_header_bytes(type) +
           b % kvref_pack_span(type) * kvref_pack_record_bytes(type);
}
/* rows 0 .. nr-1 of w (nr <= 16, rb bytes each, K values of a packable type) -> one packed group,
 * rows nr .. 15 zero */
void kvref_pack_group(int32_t type, int64_t K, const uint8_t *w, int64_t rb, int64_t nr, uint8_t *group);
/* row r < 16 of a packed group back in the file's bytes (kvref_row_nbytes(type, K)): the fields keep
 * their bit width, so packing loses nothing */
void kvref_unpack_row(int32_t type, int64_t K, const uint8_t *group, int r, uint8_t *row);
/* xsum [K/16] = the integer sums of the 16-value halves of qs [K] */
void kvref_block_sums(int64_t K, const int8_t *qs, int32_t *xsum);

float kvref_silu_ref(float g);
void kvref_to_fp16_ref(int64_t n, const float *x, uint16_t *out);

/* ---- row kernels shared by the single-kernel API and the fused forward ----------------------- */

/* out = x / sqrt(mean(x**2) + eps) * weight for one row of E values (mean square in double) */
void kvref_rms_norm_row(const float *x, int64_t E, const float *weight, double eps, float *out);
/* cs[0..D/2) = cos(p * inv_freq), cs[D/2..D) = sin(p * inv_freq), in double */
void kvref_rope_cos_sin(int64_t D, const double *inv_freq, int64_t position, double *cs);
/* rotate the nh heads of one position: x, out [nh, D] (out may be x), cs from kvref_rope_cos_sin */
void kvref_rope_row(const float *x, int64_t nh, int64_t D, const double *cs, float *out);
/* kvref_soft_cap's work on a locked pool */
void kvref_soft_cap_run(kvref_pool *pool, const float *x, int64_t n, float cap, float *out);

/* ---- matmul and attention bodies (arguments checked, the pool lock held) -------------------- */

#define KVREF_TILE_N 32        /* weight rows per unit (one dequantized tile) on the GEMM path: two
                                  AVX-512 vectors (four AVX2) of outputs per row of x */

/* per-thread scratch bytes kvref_matmul_run needs for T rows of x of K columns (any weight type) */
size_t kvref_matmul_scratch_bytes(int64_t T, int64_t K);
/* y [T, N] = x [T, K] @ W.T: the work of kvref_matmul (any T) */
void kvref_matmul_run(kvref_pool *pool, const float *x, int64_t T, int64_t K, const uint8_t *w,
                      int32_t type, int64_t N, float *y);

/* bytes of the pool's shared buffer kvref_matmul_int8_run needs (the caller reserves them) */
size_t kvref_matmul_int8_shared_bytes(int64_t T, int64_t K);
/* x [T, K] rounded to 8-bit blocks for the packed kernels, in the pool's shared buffer
 * (kvref_matmul_int8_shared_bytes(T, K), reserved by the caller): qs [T, K], ds [T, K/32, 2] and
 * xsum [T, K/16] */
void kvref_quantize_rows(kvref_pool *pool, const float *x, int64_t T, int64_t K, const int8_t **qs, const float **ds,
                         const int32_t **xsum);
/* per-thread scratch bytes kvref_matmul_int8_run needs for T rows of x of K columns */
size_t kvref_matmul_int8_scratch_bytes(int64_t T, int64_t K);
/* y [T, N] = x [T, K] @ W.T with x rounded to 8-bit blocks: the work of kvref_matmul_int8 (any T) */
void kvref_matmul_int8_run(kvref_pool *pool, const float *x, int64_t T, int64_t K, const uint8_t *w,
                           int32_t type, int64_t N, float *y);
/* Up to three weights that share one input, for few rows of x (decode, below the GEMM switch): one
 * dispatch computes every part's rows. y_p[t * ldy + n] = dot(x[t], W_p[n]) (+= with accumulate:
 * the residual add). With xqs (x in 8-bit blocks: qs [T, K], ds [T, K/32, 2], xsum [T, K/32]),
 * packed parts read those with the packed kernel; the others read x. With glu, parts 0 and 1 are
 * gate and up of equal N, and each unit finishes its rows with y_0 = glu(y_0, y_1). Every element
 * is one dot product whatever the split. */
typedef struct kvref_mv_part {
    const uint8_t *w;          /* [N, kvref_row_nbytes(type, K)] */
    const uint8_t *packed;     /* the same rows packed (kvref_pack_group, group after group), or NULL */
    int32_t type;
    int64_t N;
    float *y;                  /* [T, ldy], columns [0, N) written */
    int64_t ldy;
} kvref_mv_part;

typedef struct kvref_mv {
    const float *x;            /* [T, K] */
    const int8_t *xqs;         /* [T, K] or NULL */
    const float *xds;          /* [T, K / 32, 2] */
    const int32_t *xsum;       /* [T, K / 16] */
    int64_t T, K;
    int nparts;
    kvref_mv_part part[3];
    int accumulate;
    kvref_glu_fn glu;          /* NULL, or the gate activation applied to parts 0 and 1 */
} kvref_mv;

void kvref_mv_run(kvref_pool *pool, const kvref_mv *mv);

/* ---- top-k and the experts' grouping (moe.c, matmul.c, forward.c) ------------------------- */

/* ids [k] of the k largest values of row [V], largest first, of equal values the lower id first
 * (NaN is never one); returns how many: k, or fewer where the row has fewer values that are not NaN */
int64_t kvref_top_ids(const float *row, int64_t V, int64_t k, int64_t *ids);

/* Sorts the R rows of x by expert, stably, as a counting sort: expert e's rows go to the slots
 * first[e] .. first[e + 1] in row order, order[slot] naming the row. first: [X + 1] zeros, placed: [X]
 * zeros, order: [R]. Returns the most rows one expert takes. */
int64_t kvref_group_by_expert(const int64_t *experts, int64_t R, int64_t X, int64_t *first, int64_t *placed,
                              int64_t *order);

/* ---- a mixture of experts in the fused forward (moe.c) ------------------------------------ */

/* KVREF_OK if t is a [rows, cols] matrix of its type with a consistent byte count and its packed copy,
 * if any, of a packable type and 64-byte aligned (forward.c) */
int kvref_check_projection(const kvref_tensor *t, int64_t rows, int64_t cols);

typedef struct kvref_moe_state kvref_moe_state; /* its row buffers */

/* KVREF_OK if `router` is a valid router (kvref_route's), else KVREF_ERR_VALUE */
int kvref_router_check(const kvref_router *router);
/* KVREF_OK if layer lw of model c has a well-formed mixture (shapes, packed copies), else its status */
int kvref_moe_check(const kvref_model_desc *c, const kvref_layer_desc *lw);
/* whether every tensor of lw's mixture that has a packed form has it (the int8 mode can run) */
int kvref_moe_packed_all(const kvref_layer_desc *lw);
/* *s (NULL at first) grown to the buffers of T rows of model c; KVREF_ERR_NOMEM with *s as it was */
int kvref_moe_reserve(kvref_moe_state **s, const kvref_model_desc *c, int64_t T);
void kvref_moe_state_destroy(kvref_moe_state *s);
/* xb [T, E]: the layer's normed MLP input in, its mixture's output (routed experts + shared) out;
 * with int8, the int8 mode's projections (packed copies read where they exist). Pool locked, its
 * scratch and shared buffer reserved for T rows of the model's widest input. Returns the bytes of
 * routed experts' matrices read. */
int64_t kvref_moe_run(kvref_pool *pool, const kvref_model_desc *c, const kvref_moe_layer *m, int int8, float *xb,
                      int64_t T, kvref_moe_state *s);

/* ---- the cache's storage (kvcache.c) ------------------------------------------------------- */

/* KVREF_OK if `kv` is a well-formed cache of n_layers x Hkv x D whose layers without a ring hold
 * `positions` positions (every block-table entry they use in range), else the status naming what is
 * wrong */
int kvref_kv_check(const kvref_kv *kv, int64_t n_layers, int64_t Hkv, int64_t D, int64_t positions);
/* the ring size of `layer` of a checked cache: 0 for a layer whose position p is in its slot for p */
int64_t kvref_kv_ring(const kvref_kv *kv, int64_t layer);
/* the attention arguments' view of layer `layer` of a checked cache (q, positions, T, H, S unset):
 * key s is the slot of position s, or slot s of a ring layer */
void kvref_kv_layer(const kvref_kv *kv, int64_t layer, kvref_attn_args *a);
/* encode the K and V vectors of one position, k and v [Hkv, D] float32, into its slot in `layer`
 * (slot position % R of a ring layer) */
void kvref_kv_store(const kvref_kv *kv, const kvref_kernels *kk, int64_t layer, int64_t position,
                    const float *k, const float *v);
/* KIVI4 K of positions p0 .. p0+n-1 (k [n, Hkv, D] float32) into `layer`, in position order (kvref_kv_store
 * leaves KIVI4 K to this): each position's float16 row into the residual, and every group of
 * group_size positions this completes quantized per channel from those rows into its slots
 * (kvref/cache/quant.py's KiviResidual.write, byte for byte) */
void kvref_kv_store_kivi_k(const kvref_kv *kv, const kvref_kernels *kk, int64_t layer, int64_t p0,
                           const float *k, int64_t n);

/* per-thread scratch bytes (H query heads of D elements, G per kv head), and shared floats for
 * segment partials, of kvref_attention_run; the partials of T queries suffice for any run of up to T of
 * them over up to S keys (the fused forward's sub-chunks of a ring layer) */
size_t kvref_attention_scratch_bytes(int64_t H, int64_t G, int64_t D);
int64_t kvref_attention_partial_floats(int64_t T, int64_t Hkv, int64_t G, int64_t D, int64_t S);
/* One attention of a run: the caller sets a (checked arguments, S > 0), partial
 * (kvref_attention_partial_floats floats of its own) and out ([T, H, D], overlapping no input: it
 * holds the unnormalised outputs while the work runs); kvref_attention_run sets the rest. */
typedef struct kvref_attn_job {
    kvref_attn_args a;
    float *partial;            /* nseg > 1: [T, Hkv, nlive, G * (D + 2)] (m[G], l[G], acc[G, D]) */
    float *out;                /* [T, H, D] */
    const kvref_attn_kernels *kernels;
    int64_t nseg;              /* key segments of KVREF_ATTN_SEGMENT keys (1: all S keys in one) */
    int64_t k_begin, k_end;    /* the keys any query can see lie in [k_begin, k_end); k_begin is a
                                  multiple of KVREF_ATTN_CHUNK */
    int64_t seg_lo, nlive;     /* the segments holding those keys: seg_lo .. seg_lo + nlive - 1 */
    int64_t heads;             /* kv heads per unit: 1 or Hkv */
    int64_t span, runs;        /* consecutive segments per unit; units per query and block of heads */
    int64_t unit0, merge0;     /* its first unit among the run's, and first merge unit */
} kvref_attn_job;
/* the work of kvref_attention for n jobs (the sequences of a batched forward) in one dispatch to the
 * pool, each computed exactly as alone */
void kvref_attention_run(kvref_pool *pool, kvref_attn_job *jobs, int64_t n);

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
