/* scalar.c: the reference kernels in portable C, one plain loop each.
 *
 * They are the KVREF_ISA_SCALAR kernel table (any CPU, including aarch64), the definition the
 * SIMD tables are tested against, and the fallback the SIMD files call for shapes they do not
 * specialise. Dequantization rounds each value exactly as the NumPy dequantizers do (one rounding
 * of the exact block value), so a dequantized row here is bit-identical to the spec's.
 */
#include <math.h>

#include "internal.h"

/* ---- dequantization: one row of K values -> float32 ------------------------------------------ */

static void dequant_f32(int64_t K, const uint8_t *w, float *out) { memcpy(out, w, (size_t)K * 4); }

static void dequant_f16(int64_t K, const uint8_t *w, float *out) {
    for (int64_t i = 0; i < K; i++) out[i] = kvref_load_fp16(w + 2 * i);
}

static void dequant_bf16(int64_t K, const uint8_t *w, float *out) {
    for (int64_t i = 0; i < K; i++) out[i] = kvref_bf16_to_fp32(kvref_load_u16(w + 2 * i));
}

static void dequant_q4_0(int64_t K, const uint8_t *w, float *out) {
    for (int64_t b = 0; b < K / QK4_0; b++, w += BYTES_Q4_0, out += QK4_0) {
        float d = kvref_load_fp16(w);
        const uint8_t *qs = w + 2;
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((qs[j] & 0xF) - 8);
            out[j + 16] = d * (float)((qs[j] >> 4) - 8);
        }
    }
}

static void dequant_q4_1(int64_t K, const uint8_t *w, float *out) {
    for (int64_t b = 0; b < K / QK4_1; b++, w += BYTES_Q4_1, out += QK4_1) {
        float d = kvref_load_fp16(w), m = kvref_load_fp16(w + 2);
        const uint8_t *qs = w + 4;
        for (int j = 0; j < 16; j++) {
            /* d * q is exact in float32 (11 x 4 bits): the sum is the one rounding, as in NumPy */
            out[j] = d * (float)(qs[j] & 0xF) + m;
            out[j + 16] = d * (float)(qs[j] >> 4) + m;
        }
    }
}

static void dequant_q5_0(int64_t K, const uint8_t *w, float *out) {
    for (int64_t b = 0; b < K / 32; b++, w += BYTES_Q5_0, out += 32) {
        const float d = kvref_load_fp16(w);
        const uint32_t qh = kvref_q5_high_bits(w);
        const uint8_t *qs = w + 6;
        for (int j = 0; j < 16; j++) { /* d * (q - 16) is exact (11 x 5 bits), as in NumPy */
            out[j] = d * (float)((int)((qs[j] & 0xF) | ((qh >> j & 1u) << 4)) - 16);
            out[j + 16] = d * (float)((int)((qs[j] >> 4) | ((qh >> (j + 16) & 1u) << 4)) - 16);
        }
    }
}

static void dequant_q8_0(int64_t K, const uint8_t *w, float *out) {
    for (int64_t b = 0; b < K / QK8_0; b++, w += BYTES_Q8_0, out += QK8_0) {
        float d = kvref_load_fp16(w);
        const int8_t *qs = (const int8_t *)(w + 2);
        for (int j = 0; j < 32; j++) out[j] = d * (float)qs[j];
    }
}

static void dequant_mxfp4(int64_t K, const uint8_t *w, float *out) {
    for (int64_t b = 0; b < K / 32; b++, w += BYTES_MXFP4, out += 32) {
        const float d = kvref_e8m0_half(w[0]);
        const uint8_t *qs = w + 1;
        for (int j = 0; j < 16; j++) { /* a power of two times a small integer: exact, as in NumPy */
            out[j] = d * (float)kvref_mxfp4_values[qs[j] & 0xF];
            out[j + 16] = d * (float)kvref_mxfp4_values[qs[j] >> 4];
        }
    }
}

static void dequant_q4_k(int64_t K, const uint8_t *w, float *out) {
    for (int64_t b = 0; b < K / QK_K; b++, w += BYTES_Q4_K, out += QK_K) {
        float d = kvref_load_fp16(w), dmin = kvref_load_fp16(w + 2);
        const uint8_t *scales = w + 4, *qs = w + 16;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            kvref_q4k_scale_min(j, scales, &sc, &mn);
            float ds = d * (float)sc, dm = dmin * (float)mn; /* both exact (11 x 6 bits) */
            const uint8_t *q = qs + 32 * (j / 2);
            int shift = 4 * (j % 2);
            for (int i = 0; i < 32; i++) out[32 * j + i] = ds * (float)((q[i] >> shift) & 0xF) - dm;
        }
    }
}

static void dequant_q6_k(int64_t K, const uint8_t *w, float *out) {
    for (int64_t b = 0; b < K / QK_K; b++, w += BYTES_Q6_K, out += QK_K) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *scales = (const int8_t *)(w + 192);
        float d = kvref_load_fp16(w + 208);
        for (int half = 0; half < 2; half++) {
            const uint8_t *l = ql + 64 * half, *h = qh + 32 * half;
            float *o = out + 128 * half;
            const int8_t *sc = scales + 8 * half;
            for (int i = 0; i < 32; i++) {
                int q0 = (l[i] & 0xF) | (((h[i] >> 0) & 3) << 4);
                int q1 = (l[i + 32] & 0xF) | (((h[i] >> 2) & 3) << 4);
                int q2 = (l[i] >> 4) | (((h[i] >> 4) & 3) << 4);
                int q3 = (l[i + 32] >> 4) | (((h[i] >> 6) & 3) << 4);
                /* d * scale is exact (11 x 8 bits); times (q - 32) is the one rounding */
                o[i] = (d * (float)sc[i / 16]) * (float)(q0 - 32);
                o[i + 32] = (d * (float)sc[2 + i / 16]) * (float)(q1 - 32);
                o[i + 64] = (d * (float)sc[4 + i / 16]) * (float)(q2 - 32);
                o[i + 96] = (d * (float)sc[6 + i / 16]) * (float)(q3 - 32);
            }
        }
    }
}

void kvref_dequant_row(int32_t type, int64_t K, const uint8_t *w_row, float *out) {
    switch (type) {
    case KVREF_TYPE_F32: dequant_f32(K, w_row, out); break;
    case KVREF_TYPE_F16: dequant_f16(K, w_row, out); break;
    case KVREF_TYPE_BF16: dequant_bf16(K, w_row, out); break;
    case KVREF_TYPE_Q4_0: dequant_q4_0(K, w_row, out); break;
    case KVREF_TYPE_Q4_1: dequant_q4_1(K, w_row, out); break;
    case KVREF_TYPE_Q5_0: dequant_q5_0(K, w_row, out); break;
    case KVREF_TYPE_Q8_0: dequant_q8_0(K, w_row, out); break;
    case KVREF_TYPE_Q4_K: dequant_q4_k(K, w_row, out); break;
    case KVREF_TYPE_Q6_K: dequant_q6_k(K, w_row, out); break;
    case KVREF_TYPE_MXFP4: dequant_mxfp4(K, w_row, out); break;
    default: break; /* unreachable: callers validate the type */
    }
}

/* ---- dot products: dequantize a block into a small buffer, then one float accumulator ------- */

/* w may sit at any byte offset (a view into a file): load through memcpy, never a float* */
static float vec_dot_f32(int64_t K, const uint8_t *w, const float *x) {
    float acc = 0.0f;
    for (int64_t i = 0; i < K; i++) {
        float wi;
        memcpy(&wi, w + 4 * i, 4);
        acc += wi * x[i];
    }
    return acc;
}

#define BLOCKWISE_DOT(name, type, qk, bytes)                                       \
    static float name(int64_t K, const uint8_t *w, const float *x) {               \
        float buf[qk];                                                             \
        float acc = 0.0f;                                                          \
        for (int64_t b = 0; b < K / (qk); b++) {                                   \
            kvref_dequant_row(type, qk, w + b * (bytes), buf);                     \
            for (int i = 0; i < (qk); i++) acc += buf[i] * x[b * (qk) + i];        \
        }                                                                          \
        return acc;                                                                \
    }

BLOCKWISE_DOT(vec_dot_f16, KVREF_TYPE_F16, 32, 64)
BLOCKWISE_DOT(vec_dot_bf16, KVREF_TYPE_BF16, 32, 64)
BLOCKWISE_DOT(vec_dot_q4_0, KVREF_TYPE_Q4_0, QK4_0, BYTES_Q4_0)
BLOCKWISE_DOT(vec_dot_q4_1, KVREF_TYPE_Q4_1, QK4_1, BYTES_Q4_1)
BLOCKWISE_DOT(vec_dot_q5_0, KVREF_TYPE_Q5_0, 32, BYTES_Q5_0)
BLOCKWISE_DOT(vec_dot_q8_0, KVREF_TYPE_Q8_0, QK8_0, BYTES_Q8_0)
BLOCKWISE_DOT(vec_dot_q4_k, KVREF_TYPE_Q4_K, QK_K, BYTES_Q4_K)
BLOCKWISE_DOT(vec_dot_q6_k, KVREF_TYPE_Q6_K, QK_K, BYTES_Q6_K)
BLOCKWISE_DOT(vec_dot_mxfp4, KVREF_TYPE_MXFP4, 32, BYTES_MXFP4)

/* F16/BF16 rows are any length: the 32-value blocks above, then a tail one value at a time */
static float vec_dot_f16_any(int64_t K, const uint8_t *w, const float *x) {
    int64_t main = K / 32 * 32;
    float acc = vec_dot_f16(main, w, x);
    for (int64_t i = main; i < K; i++) acc += kvref_load_fp16(w + 2 * i) * x[i];
    return acc;
}

static float vec_dot_bf16_any(int64_t K, const uint8_t *w, const float *x) {
    int64_t main = K / 32 * 32;
    float acc = vec_dot_bf16(main, w, x);
    for (int64_t i = main; i < K; i++) acc += kvref_bf16_to_fp32(kvref_load_u16(w + 2 * i)) * x[i];
    return acc;
}

static void tile_columns(int64_t K, const float *rows, float *tile) {
    for (int64_t k = 0; k < K; k++)
        for (int64_t i = 0; i < 16; i++) tile[k * KVREF_TILE_N + i] = rows[i * K + k];
}

/* one x row at a time against the whole tile: the inner loop over a tile row vectorizes, and each
 * output is still its own running sum in k order */
static void gemm_f32(int64_t K, const float *x, int64_t T, const float *tile, int64_t nw, float *y,
                     int64_t ldy) {
    for (int64_t t = 0; t < T; t++) {
        float acc[KVREF_TILE_N] = {0.0f};
        for (int64_t k = 0; k < K; k++)
            for (int64_t n = 0; n < KVREF_TILE_N; n++) acc[n] += x[t * K + k] * tile[k * KVREF_TILE_N + n];
        for (int64_t n = 0; n < nw; n++) y[t * ldy + n] = acc[n];
    }
}

/* ---- attention chunk kernels ----------------------------------------------------------------- */

/* element e of a chunk's K or V (base: c->k or c->v; e = row[s] + i), as float32; an I8 element
 * times its group's scale (the group of element e is e / group_size: rows start on a group) */
static inline float kv_value(const uint8_t *base, const float *scales, int32_t type, int64_t group_size, int64_t e) {
    switch (type) {
    case KVREF_TYPE_F16: return kvref_load_fp16(base + 2 * e);
    case KVREF_TYPE_BF16: return kvref_bf16_to_fp32(kvref_load_u16(base + 2 * e));
    case KVREF_TYPE_I8: return (float)((const int8_t *)base)[e] * scales[e / group_size];
    default: return ((const float *)(const void *)base)[e];
    }
}

/* The portable chunk kernels: plain loops, any K/V type and group size. They are the scalar table's,
 * and what the SIMD tables run for I8 scale groups narrower than their vectors. The score and value
 * loops are instantiated per element type (`type` a constant once inlined), so the element loads do
 * not test the type. */

/* p[g * C + s] = (q_g . k_s) * scale, the visible keys only, each dot summed in element order (float
 * K types; an I8 K is scored with integers, kvref_attn_score_i8_ref) */
static inline void score_ref(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p, const int32_t type) {
    const int64_t G = a->G, D = a->D, C = KVREF_ATTN_CHUNK, gs = a->group_size, n = c->n;
    const float *q = c->q, *scales = c->k_scales;
    const uint8_t *k = c->k;
    const int64_t *row = c->row;
    const int all = c->all;
    for (int64_t s = 0; s < n; s++) {
        if (!all && kvref_attn_hidden(c, s)) continue;
        for (int64_t g = 0; g < G; g++) {
            float dot = 0.0f;
            for (int64_t i = 0; i < D; i++) dot += q[g * D + i] * kv_value(k, scales, type, gs, row[s] + i);
            p[g * C + s] = kvref_attn_score_value(dot * a->scale);
        }
    }
}

/* acc += p V: key by key, each value loaded once for the G heads; V's first Dv elements */
static inline void values_ref(const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc,
                              const int32_t type) {
    const int64_t G = a->G, Dv = a->Dv, C = KVREF_ATTN_CHUNK, gs = a->group_size, n = c->n;
    const float *scales = c->v_scales;
    const uint8_t *v = c->v;
    const int64_t *row = c->row;
    const int all = c->all;
    for (int64_t s = 0; s < n; s++) {
        if (!all && kvref_attn_hidden(c, s)) continue;
        for (int64_t i = 0; i < Dv; i++) {
            const float vi = kv_value(v, scales, type, gs, row[s] + i);
            for (int64_t g = 0; g < G; g++) acc[g * Dv + i] += p[g * C + s] * vi;
        }
    }
}

/* An I8 K's integer scoring (internal.h): per visible key and head, each group's exact integer dot,
 * then the float32 operations in their defined order */
void kvref_attn_score_i8_ref(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p) {
    const int64_t G = a->G, D = a->D, C = KVREF_ATTN_CHUNK, gs = a->group_size, ng = D / gs;
    const int8_t *k = (const int8_t *)c->k;
    for (int64_t s = 0; s < c->n; s++) {
        if (!c->all && kvref_attn_hidden(c, s)) continue;
        const int8_t *ks = k + c->row[s];
        const float *kd = c->k_scales + c->srow[s];
        for (int64_t g = 0; g < G; g++) {
            const int8_t *q8 = c->q8 + g * D;
            float score = 0.0f;
            for (int64_t b = 0; b < ng; b++) {
                int32_t dot = 0;
                for (int64_t j = b * gs; j < (b + 1) * gs; j++) dot += (int32_t)q8[j] * ks[j];
                score += (float)dot * (c->qe[g * ng + b] * kd[b]);
            }
            p[g * C + s] = kvref_attn_score_value(score);
        }
    }
}

/* ---- KIVI4 (kvref/cache/quant.py): nibbles read as q * scale + zero, K per channel over a group of
 * positions (its float16 residual past the last full group), V per token over a group of elements */

/* level of element e of the nibbles at b (element e in the low nibble of byte e / 2 when e is even) */
static inline float kivi_level(const uint8_t *b, int64_t e) { return (float)((b[e / 2] >> (4 * (e % 2))) & 15); }

/* p[g * C + s] = (q_g . k_s) * scale, k_s decoded element by element, summed in element order */
void kvref_attn_score_kivi_ref(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p) {
    const int64_t G = a->G, D = a->D, C = KVREF_ATTN_CHUNK, gs = a->group_size, HD = a->Hkv * D;
    const int64_t c0 = c->kp - a->k_positions, nq = a->S - a->S % gs; /* keys below nq are quantized */
    for (int64_t s = 0; s < c->n; s++) {
        if (!c->all && kvref_attn_hidden(c, s)) continue;
        const int64_t key = c0 + s;
        const uint8_t *kb = c->k + c->row[s] / 2;
        const float *params = c->k_scales + (c->row[s] / HD / gs) * a->Hkv * 2 * D; /* [2, D]: its group's */
        const uint16_t *res = c->k_residual + (key % gs) * HD;
        for (int64_t g = 0; g < G; g++) {
            float dot = 0.0f;
            for (int64_t i = 0; i < D; i++) {
                const float k = key < nq ? kivi_level(kb, i) * params[i] + params[D + i] : kvref_fp16_to_fp32(res[i]);
                dot += c->q[g * D + i] * k;
            }
            p[g * C + s] = kvref_attn_score_value(dot * a->scale);
        }
    }
}

/* acc += p V, V decoded element by element with its group's (scale, zero) */
void kvref_attn_values_kivi_ref(const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc) {
    const int64_t G = a->G, D = a->D, C = KVREF_ATTN_CHUNK, gs = a->group_size;
    for (int64_t s = 0; s < c->n; s++) {
        if (!c->all && kvref_attn_hidden(c, s)) continue;
        const uint8_t *vb = c->v + c->row[s] / 2;
        const float *pairs = c->v_scales + 2 * c->srow[s]; /* [D / gs, 2] */
        for (int64_t i = 0; i < D; i++) {
            const float vi = kivi_level(vb, i) * pairs[2 * (i / gs)] + pairs[2 * (i / gs) + 1];
            for (int64_t g = 0; g < G; g++) acc[g * D + i] += p[g * C + s] * vi;
        }
    }
}

static void attn_score_ref(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p) {
    switch (a->k_type) {
    case KVREF_TYPE_KIVI4: kvref_attn_score_kivi_ref(a, c, p); break;
    case KVREF_TYPE_F16: score_ref(a, c, p, KVREF_TYPE_F16); break;
    case KVREF_TYPE_BF16: score_ref(a, c, p, KVREF_TYPE_BF16); break;
    case KVREF_TYPE_I8: kvref_attn_score_i8_ref(a, c, p); break;
    default: score_ref(a, c, p, KVREF_TYPE_F32);
    }
}

static void attn_values_ref(const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc) {
    switch (a->v_type) {
    case KVREF_TYPE_KIVI4: kvref_attn_values_kivi_ref(a, c, p, acc); break;
    case KVREF_TYPE_F16: values_ref(a, c, p, acc, KVREF_TYPE_F16); break;
    case KVREF_TYPE_BF16: values_ref(a, c, p, acc, KVREF_TYPE_BF16); break;
    case KVREF_TYPE_I8: values_ref(a, c, p, acc, KVREF_TYPE_I8); break;
    default: values_ref(a, c, p, acc, KVREF_TYPE_F32);
    }
}

/* each head's max, then p = exp(p - mnew) and their sum, one key at a time */
static void attn_exp_ref(int64_t G, int64_t n, const float *m, float *p, float *mnew, float *sum) {
    for (int64_t g = 0; g < G; g++) {
        float *pg = p + g * KVREF_ATTN_CHUNK;
        float cmax = -INFINITY;
        for (int64_t s = 0; s < n; s++) cmax = pg[s] > cmax ? pg[s] : cmax;
        const float mx = cmax > m[g] ? cmax : m[g];
        float total = 0.0f;
        for (int64_t s = 0; s < n; s++) {
            pg[s] = expf(pg[s] - mx); /* masked: exp(-inf) = 0 */
            total += pg[s];
        }
        mnew[g] = mx;
        sum[g] = total;
    }
}

/* ---- 8-bit activations ------------------------------------------------------------------- */

/* fl(a b + c), one rounding: the fused multiply-add the 8-bit kernels are defined by. libm's fmaf is
 * that (glibc, macOS, Microsoft's C runtime; an instruction where the target has FMA), but mingw-w64's
 * (libmingwex) rounds twice: under wine, 30 % of random triples came out an ulp off, and the SIMD
 * tables' bit-identity with this one broke (tests/harness). So mingw builds compute it: a b is exact in
 * double (24 + 24 bits), TwoSum gives the sum's rounding error exactly, and the sum rounded to odd (its
 * last bit set when inexact) then rounds to float32 correctly (Boldo and Melquiond, "Emulation of FMA
 * and correctly rounded sums: proved algorithms using rounding to odd", IEEE TC 2008). Checked against
 * glibc's fmaf on 2 * 10**7 random triples, special values included: no difference. */
static inline float fma_f32(float a, float b, float c) {
#if defined(__MINGW32__)
    const double p = (double)a * (double)b, s = p + (double)c;
    const double pv = s - (double)c, err = (p - pv) + ((double)c - (s - pv));
    uint64_t bits;
    memcpy(&bits, &s, 8);
    if (err != 0.0 && err == err && (bits & 1) == 0) { /* inexact and even: the odd neighbour towards err */
        bits += (err > 0) == (s > 0) ? 1 : UINT64_MAX;
        double odd;
        memcpy(&odd, &bits, 8);
        return (float)odd;
    }
    return (float)s;
#else
    return fmaf(a, b, c);
#endif
}

/* x [K] -> qs [K], ds [K/32, 2]: per block d = max|x| / 127, qs = rint(x * (1/d)) (ties to even),
 * s = d * sum of qs (internal.h says why not the sum of x) */
static void quantize_q8_scalar(int64_t K, const float *x, int8_t *qs, float *ds) {
    for (int64_t b = 0; b < K / 32; b++, x += 32, qs += 32, ds += 2) {
        float amax = 0.0f;
        int finite = 1;
        for (int j = 0; j < 32; j++) {
            const float a = fabsf(x[j]);
            amax = a > amax ? a : amax;
            finite &= x[j] * 0.0f == 0.0f; /* NaN for NaN and infinities */
        }
        float d, id;
        kvref_q8_scale(amax, finite, &d, &id);
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) {
            float v = rintf(x[j] * id);          /* |v| <= 127 for finite x (see internal.h) */
            v = v < 127.0f ? v : 127.0f;
            v = v > -127.0f ? v : -127.0f;       /* NaN has gone to 127 on the line above */
            qs[j] = (int8_t)v;
            sum += qs[j];
        }
        ds[0] = d;
        ds[1] = d * (float)sum;
    }
}

/* value i of vector v of row r in a packed record (internal.h): the unsigned u = q + bias */
static int32_t packed_value(int32_t type, const uint8_t *rec, int v, int r, int i) {
    const uint8_t *vals = rec + kvref_pack_values_at(type), *planes = rec + kvref_pack_planes_at(type);
    const int lane = 4 * r + i;
    if (type == KVREF_TYPE_Q8_0) return vals[64 * v + lane];
    const uint8_t byte = vals[64 * (v % 4) + lane];
    int32_t u = v < 4 ? byte & 15 : byte >> 4;
    if (type == KVREF_TYPE_Q5_0) u |= (planes[8 * v + lane / 8] >> (lane % 8) & 1) << 4;
    if (type == KVREF_TYPE_Q6_K) u |= (planes[64 * (v / 4) + lane] >> (2 * (v % 4)) & 3) << 4;
    return u;
}

/* scale `which` of row r for record b of a packed group: 0 d (Q6_K: of values 0-15), 1 m (Q6_K: d
 * of 16-31); the K-quants' are kvref_q8_block_scales's products of their header's fields */
static float packed_scale(int32_t type, const uint8_t *group, int64_t b, int which, int r) {
    if (!kvref_pack_kquant(type)) return kvref_load_fp16(kvref_pack_record(type, group, b) + 32 * which + 2 * r);
    const uint8_t *h = kvref_pack_header(type, group, b);
    const int j = (int)(b % kvref_pack_span(type));
    if (type == KVREF_TYPE_Q6_K) return kvref_load_fp16(h + 2 * r) * (float)(int8_t)h[32 + 16 * (2 * j + which) + r];
    uint8_t scales[12], sc, m; /* row r's 12 bytes of the file's scales and mins, one from each plane */
    for (int k = 0; k < 12; k++) scales[k] = h[64 + 16 * k + r];
    kvref_q4k_scale_min((int)j, scales, &sc, &m);
    return which == 0 ? kvref_load_fp16(h + 2 * r) * (float)sc : -(kvref_load_fp16(h + 32 + 2 * r) * (float)m);
}

/* the definition of the packed kernels (internal.h, kvref_packed_dot_fn) */
static void packed_dot(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs, const float *ds,
                       const int32_t *xsum, int64_t T, float *out) {
    const int64_t nb = K / 32;
    const int32_t bias = kvref_pack_bias(type);
    for (int64_t t = 0; t < T; t++)
        for (int r = 0; r < KVREF_PACK_ROWS; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *rec = kvref_pack_record(type, group, b);
                const int8_t *x = qs + t * K + 32 * b;
                const float *xd = ds + (t * nb + b) * 2;
                const int32_t *xs = xsum + t * (K / 16) + 2 * b;
                int32_t half[2] = {-bias * xs[0], -bias * xs[1]}; /* values 0-15, 16-31 */
                for (int v = 0; v < 8; v++)
                    for (int i = 0; i < 4; i++) half[v / 4] += packed_value(type, rec, v, r, i) * (int32_t)x[4 * v + i];
                if (type == KVREF_TYPE_Q6_K) { /* a scale per 16 values */
                    acc = fma_f32((float)half[0], xd[0] * packed_scale(type, group, b, 0, r), acc);
                    acc = fma_f32((float)half[1], xd[0] * packed_scale(type, group, b, 1, r), acc);
                    continue;
                }
                acc = fma_f32((float)(half[0] + half[1]), xd[0] * packed_scale(type, group, b, 0, r), acc);
                if (type == KVREF_TYPE_Q4_1 || type == KVREF_TYPE_Q4_K) acc = fma_f32(packed_scale(type, group, b, 1, r), xd[1], acc);
            }
            out[t * KVREF_PACK_ROWS + r] = acc;
        }
}

/* the definition the SIMD 8-bit GEMMs reproduce bit for bit (internal.h) */
static void gemm_q8(int64_t K, const uint8_t *xu, const float *xds, int64_t T, const uint8_t *tile, int64_t bv,
                    int64_t nw, int affine, float *y, int64_t ldy) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < nw; n++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < K / bv; b++) {
                const uint8_t *rec = tile + b * KVREF_Q8_TILE_RECORD(bv), *x = xu + t * K + b * bv;
                const float *xd = xds + (t * (K / 32) + b * bv / 32) * 2;
                int32_t zero, isum;
                float d, m;
                memcpy(&zero, rec + KVREF_Q8_TILE_ZERO(bv) + 4 * n, 4);
                memcpy(&d, rec + KVREF_Q8_TILE_D(bv) + 4 * n, 4);
                memcpy(&m, rec + KVREF_Q8_TILE_M(bv) + 4 * n, 4);
                isum = zero;
                for (int j = 0; j < bv; j++)
                    isum += (int32_t)x[j] * (int32_t)(int8_t)rec[(j / 4) * 4 * KVREF_TILE_N + 4 * n + j % 4];
                acc = fma_f32((float)isum, xd[0] * d, acc);
                if (affine) acc = fma_f32(m, xd[1], acc);
            }
            y[t * ldy + n] = acc;
        }
}

static uint64_t read_sum(const uint8_t *p, int64_t n) {
    uint64_t sum = 0;
    for (int64_t i = 0; i < n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        sum += w;
    }
    return sum;
}

void kvref_to_fp16_ref(int64_t n, const float *x, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = kvref_fp32_to_fp16(x[i]);
}

/* ---- SwiGLU and GeGLU ---------------------------------------------------------------------- */

float kvref_silu_ref(float g) { return g / (1.0f + expf(-g)); }

/* kvref.spec.ops.gelu_tanh, operation for operation in float32 */
static float gelu_tanh(float g) {
    const float cube = KVREF_GELU_K * g * g * g;
    return 0.5f * g * (1.0f + tanhf(KVREF_GELU_C * (g + cube)));
}

static void geglu_scalar(int64_t n, const float *gate, const float *up, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = gelu_tanh(gate[i]) * up[i];
}

static void swiglu_scalar(int64_t n, const float *gate, const float *up, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = kvref_silu_ref(gate[i]) * up[i];
}

/* the clamps written so that a NaN fails every comparison and passes through */
static void swiglu_oai_scalar(int64_t n, const float *gate, const float *up, float *out) {
    const float L = KVREF_SWIGLU_OAI_LIMIT;
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i] > L ? L : gate[i];
        const float u = up[i] > L ? L : up[i] < -L ? -L : up[i];
        out[i] = g / (1.0f + expf(-KVREF_SWIGLU_OAI_ALPHA * g)) * (u + 1.0f);
    }
}

const kvref_kernels kvref_kernels_scalar = {
    .isa = KVREF_ISA_SCALAR,
    .vec_dot = {
        [KVREF_TYPE_F32] = vec_dot_f32, [KVREF_TYPE_F16] = vec_dot_f16_any,
        [KVREF_TYPE_BF16] = vec_dot_bf16_any, [KVREF_TYPE_Q4_0] = vec_dot_q4_0,
        [KVREF_TYPE_Q4_1] = vec_dot_q4_1, [KVREF_TYPE_Q5_0] = vec_dot_q5_0, [KVREF_TYPE_Q8_0] = vec_dot_q8_0,
        [KVREF_TYPE_Q4_K] = vec_dot_q4_k, [KVREF_TYPE_Q6_K] = vec_dot_q6_k, [KVREF_TYPE_MXFP4] = vec_dot_mxfp4,
    },
    .dequant = {
        [KVREF_TYPE_F32] = dequant_f32, [KVREF_TYPE_F16] = dequant_f16,
        [KVREF_TYPE_BF16] = dequant_bf16, [KVREF_TYPE_Q4_0] = dequant_q4_0,
        [KVREF_TYPE_Q4_1] = dequant_q4_1, [KVREF_TYPE_Q5_0] = dequant_q5_0, [KVREF_TYPE_Q8_0] = dequant_q8_0,
        [KVREF_TYPE_Q4_K] = dequant_q4_k, [KVREF_TYPE_Q6_K] = dequant_q6_k, [KVREF_TYPE_MXFP4] = dequant_mxfp4,
    },
    .gemm_f32 = gemm_f32,
    .tile_columns = tile_columns,
    .attn = {.score = attn_score_ref, .exp = attn_exp_ref, .values = attn_values_ref, .i8_lanes = 1, .kivi_lanes = 1},
    .swiglu = swiglu_scalar,
    .geglu = geglu_scalar,
    .swiglu_oai = swiglu_oai_scalar,
    .packed_dot = packed_dot,
    .quantize_q8 = quantize_q8_scalar,
    .gemm_q8 = gemm_q8,
    .read_sum = read_sum,
    .to_fp16 = kvref_to_fp16_ref,
};
