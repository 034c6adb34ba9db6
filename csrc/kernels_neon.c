/* kernels_neon.c: the aarch64 kernel tables, KVREF_ISA_NEON (Advanced SIMD, every AArch64 CPU),
 * KVREF_ISA_NEON_DOTPROD (+ sdot) and KVREF_ISA_NEON_I8MM (+ sdot and smmla).
 *
 * Same algorithms and the same per-value rounding as kernels_avx2.c, four float lanes a vector:
 * quantized values are widened lane by lane (integer -> float, then the block's multiply or fused
 * multiply-add, one rounding as the NumPy dequantizer's), so every weight value is bit-identical to
 * the spec's and only the summation order of a dot product differs from scalar.c's. The entries
 * that scalar.c defines bit for bit (dequant, packed_dot, quantize_q8, gemm_q8, an I8 K's scores,
 * tile_columns, read_sum, to_fp16) give its bits here too; the float dot products, gemm_f32, the
 * attention kernels of float K/V and the exp-based activations are bounded, as on x86.
 *
 * The three tables differ only in the integer dot products of the int8 mode and of an I8 K: plain
 * widening multiplies (smull, pairwise adds), sdot (four byte products a lane), or smmla (a 2 x 8 by
 * 8 x 2 byte matrix product: two rows of x against two weight rows). The plain table has no 8-bit
 * GEMM (gemm_q8 NULL: many rows of x go through packed weights, as on AVX2); the other two have one
 * on the portable decoder's tiles (q8_tile NULL). The functions that use sdot or smmla carry target
 * attributes, and pool.c selects their tables only after the CPU reports the feature, so one build
 * runs on a plain ARMv8.0-A core (Cortex-A53) too. The kernels are written once with the integer step
 * a constant function argument, which the compiler inlines into each table's copy
 * (tests/test_build.py checks that no other function holds sdot or smmla).
 */
#include "internal.h"

#if KVREF_NEON

#include <arm_neon.h>
#include <math.h>

#define ALWAYS_INLINE __attribute__((always_inline)) inline
#if KVREF_NEON_DOT
/* the arm_neon.h of GCC declares sdot and smmla for armv8.2-a and up */
#define TARGET_DOT __attribute__((target("arch=armv8.2-a+dotprod")))
#define TARGET_I8MM __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
#endif

/* ---- loads and conversions ------------------------------------------------------------------ */

/* weights sit at any byte offset: every load goes through bytes */
static ALWAYS_INLINE float32x4_t load_f32x4(const uint8_t *p) { return vreinterpretq_f32_u8(vld1q_u8(p)); }
static ALWAYS_INLINE float32x4_t f16x4(const uint8_t *p) { return vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(p))); }
static ALWAYS_INLINE float32x4_t bf16x4(const uint8_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vreinterpret_u16_u8(vld1_u8(p)), 16));
}
static ALWAYS_INLINE float fp16_load(const uint8_t *p) {
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(kvref_load_u16(p)))), 0);
}
/* 16 signed bytes -> 4 x 4 float32 (exact) */
static ALWAYS_INLINE void s8_to_f32(int8x16_t q, float32x4_t f[4]) {
    const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_high_s8(q);
    f[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    f[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
    f[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    f[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
}
/* 4 bytes at p as float32 lanes: unsigned (Q4_K's scales and mins) or signed (Q6_K's scales) */
static ALWAYS_INLINE float32x4_t bytes4(const uint8_t *p, const int is_signed) {
    uint32_t w;
    memcpy(&w, p, 4);
    const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(w));
    return is_signed ? vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(b)))))
                     : vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(b))));
}
/* 16 bits -> 16 bytes, byte j 16 where bit j is set, else 0 */
static ALWAYS_INLINE uint8x16_t high_bits16(uint32_t bits) {
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t bytes = vcombine_u8(vdup_n_u8((uint8_t)bits), vdup_n_u8((uint8_t)(bits >> 8)));
    return vandq_u8(vtstq_u8(bytes, vld1q_u8(bit)), vdupq_n_u8(16));
}

/* ---- dot kernels, written once for R rows of x ------------------------------------------------
 *
 * As in kernels_avx2.c: dot_<type>(K, w, x, R, out, ldo) sets out[r * ldo] to the dot of the weight
 * row w with row r of x [R, K]; R is a constant once inlined, each row has its own four
 * accumulators and the operations of R = 1, so a row's result does not depend on R. */
#define ROWS_MAX 4

/* acc[r][j % 4] += v[j] * x[r * K + 4j ..] for the n value vectors of a block at x */
static ALWAYS_INLINE void fma_rows(float32x4_t acc[][4], const float32x4_t *v, const int n, const float *x, int64_t K,
                                   const int R) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < n; j++) acc[r][j % 4] = vfmaq_f32(acc[r][j % 4], v[j], vld1q_f32(x + r * K + 4 * j));
}

static ALWAYS_INLINE void zero_rows(float32x4_t acc[][4], const int R) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = vdupq_n_f32(0.0f);
}

static ALWAYS_INLINE float sum4(const float32x4_t a[4]) { return vaddvq_f32(vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3]))); }

static ALWAYS_INLINE void store_rows(float32x4_t acc[][4], const int R, float *out, int64_t ldo) {
    for (int r = 0; r < R; r++) out[r * ldo] = sum4(acc[r]);
}

/* ---- float rows: 16 values a step, the last K % 16 one by one ----------------------------- */

/* 4 weights at p of a float type: float32, float16 or bfloat16 */
static ALWAYS_INLINE float32x4_t float4(const uint8_t *p, const int32_t type) {
    return type == KVREF_TYPE_F16 ? f16x4(p) : type == KVREF_TYPE_BF16 ? bf16x4(p) : load_f32x4(p);
}
static ALWAYS_INLINE float float1(const uint8_t *p, const int32_t type) {
    if (type == KVREF_TYPE_F16) return fp16_load(p);
    if (type == KVREF_TYPE_BF16) return kvref_bf16_to_fp32(kvref_load_u16(p));
    float f;
    memcpy(&f, p, 4);
    return f;
}

static ALWAYS_INLINE void dot_float(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo,
                                    const int32_t type) {
    const int64_t width = type == KVREF_TYPE_F32 ? 4 : 2;
    float32x4_t a[ROWS_MAX][4];
    zero_rows(a, R);
    int64_t i = 0;
    for (; i + 16 <= K; i += 16) {
        float32x4_t v[4];
        for (int j = 0; j < 4; j++) v[j] = float4(w + width * (i + 4 * j), type);
        fma_rows(a, v, 4, x + i, K, R);
    }
    for (int r = 0; r < R; r++) {
        float acc = sum4(a[r]);
        for (int64_t k = i; k < K; k++) acc += float1(w + width * k, type) * x[r * K + k];
        out[r * ldo] = acc;
    }
}

static ALWAYS_INLINE void dot_f32(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    dot_float(K, w, x, R, out, ldo, KVREF_TYPE_F32);
}
static ALWAYS_INLINE void dot_f16(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    dot_float(K, w, x, R, out, ldo, KVREF_TYPE_F16);
}
static ALWAYS_INLINE void dot_bf16(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    dot_float(K, w, x, R, out, ldo, KVREF_TYPE_BF16);
}

/* ---- 32-value blocks: 16 bytes of nibbles (values 0-15 low, 16-31 high), or Q8_0's 32 bytes ---- */

/* signed integers lo (values 0-15) and hi (16-31) times d */
static ALWAYS_INLINE void scaled32(int8x16_t lo, int8x16_t hi, float d, float32x4_t v[8]) {
    s8_to_f32(lo, v);
    s8_to_f32(hi, v + 4);
    for (int j = 0; j < 8; j++) v[j] = vmulq_n_f32(v[j], d);
}

/* nibbles (below 128: read as signed bytes) times d plus m, each one fused multiply-add (d q is exact:
 * one rounding) */
static ALWAYS_INLINE void affine32(uint8x16_t lo, uint8x16_t hi, float d, float m, float32x4_t v[8]) {
    s8_to_f32(vreinterpretq_s8_u8(lo), v);
    s8_to_f32(vreinterpretq_s8_u8(hi), v + 4);
    for (int j = 0; j < 8; j++) v[j] = vfmaq_n_f32(vdupq_n_f32(m), v[j], d);
}

/* The 32 values of block w of a 32-value type, each rounded as the NumPy dequantizer rounds it:
 * Q4_0 d (q - 8); Q5_0 d (q - 16), q's fifth bit from qh; Q8_0 d q; Q4_1 d q + m; MXFP4 the doubled
 * E2M1 value of each nibble (a 16-byte table lookup) times 2**(e - 128), exact */
static ALWAYS_INLINE void block32(const uint8_t *w, const int32_t type, float32x4_t v[8]) {
    const uint8x16_t low4 = vdupq_n_u8(0xF);
    switch (type) {
    case KVREF_TYPE_Q8_0: scaled32(vld1q_s8((const int8_t *)(w + 2)), vld1q_s8((const int8_t *)(w + 18)), fp16_load(w), v); return;
    case KVREF_TYPE_Q4_1: {
        const uint8x16_t q = vld1q_u8(w + 4);
        affine32(vandq_u8(q, low4), vshrq_n_u8(q, 4), fp16_load(w), fp16_load(w + 2), v);
        return;
    }
    case KVREF_TYPE_MXFP4: {
        const int8x16_t table = vld1q_s8(kvref_mxfp4_values);
        const uint8x16_t q = vld1q_u8(w + 1);
        scaled32(vqtbl1q_s8(table, vandq_u8(q, low4)), vqtbl1q_s8(table, vshrq_n_u8(q, 4)), kvref_e8m0_half(w[0]), v);
        return;
    }
    case KVREF_TYPE_Q5_0: {
        const uint32_t qh = kvref_q5_high_bits(w);
        const uint8x16_t q = vld1q_u8(w + 6), off = vdupq_n_u8(16);
        const uint8x16_t lo = vorrq_u8(vandq_u8(q, low4), high_bits16(qh & 0xFFFF));
        const uint8x16_t hi = vorrq_u8(vshrq_n_u8(q, 4), high_bits16(qh >> 16));
        scaled32(vreinterpretq_s8_u8(vsubq_u8(lo, off)), vreinterpretq_s8_u8(vsubq_u8(hi, off)), fp16_load(w), v);
        return;
    }
    default: { /* KVREF_TYPE_Q4_0 */
        const uint8x16_t q = vld1q_u8(w + 2), off = vdupq_n_u8(8);
        scaled32(vreinterpretq_s8_u8(vsubq_u8(vandq_u8(q, low4), off)), vreinterpretq_s8_u8(vsubq_u8(vshrq_n_u8(q, 4), off)),
                 fp16_load(w), v);
    }
    }
}

static ALWAYS_INLINE void dot_blocks32(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo,
                                       const int32_t type) {
    const int64_t bytes = type == KVREF_TYPE_MXFP4 ? BYTES_MXFP4 : kvref_q8_block_bytes(type);
    float32x4_t a[ROWS_MAX][4];
    zero_rows(a, R);
    for (int64_t b = 0; b < K / 32; b++, w += bytes, x += 32) {
        float32x4_t v[8];
        block32(w, type, v);
        fma_rows(a, v, 8, x, K, R);
    }
    store_rows(a, R, out, ldo);
}

#define DOT_BLOCKS32(name, type)                                                                         \
    static ALWAYS_INLINE void dot_##name(int64_t K, const uint8_t *w, const float *x, const int R, float *out, \
                                         int64_t ldo) {                                                  \
        dot_blocks32(K, w, x, R, out, ldo, type);                                                        \
    }
DOT_BLOCKS32(q4_0, KVREF_TYPE_Q4_0)
DOT_BLOCKS32(q4_1, KVREF_TYPE_Q4_1)
DOT_BLOCKS32(q5_0, KVREF_TYPE_Q5_0)
DOT_BLOCKS32(q8_0, KVREF_TYPE_Q8_0)
DOT_BLOCKS32(mxfp4, KVREF_TYPE_MXFP4)

/* Q4_K: 32 bytes of nibbles per pair of sub-blocks, the low nibbles sub-block 2c, the high 2c + 1 */
static ALWAYS_INLINE void dot_q4_k(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    float32x4_t a[ROWS_MAX][4];
    zero_rows(a, R);
    for (int64_t b = 0; b < K / QK_K; b++, w += BYTES_Q4_K, x += QK_K) {
        const float d = fp16_load(w), dmin = fp16_load(w + 2);
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            kvref_q4k_scale_min(j, w + 4, &sc, &mn);
            const uint8_t *qs = w + 16 + 32 * (j / 2);
            uint8x16_t q[2] = {vld1q_u8(qs), vld1q_u8(qs + 16)};
            for (int h = 0; h < 2; h++) q[h] = j % 2 ? vshrq_n_u8(q[h], 4) : vandq_u8(q[h], vdupq_n_u8(0xF));
            float32x4_t v[8];
            affine32(q[0], q[1], d * (float)sc, -(dmin * (float)mn), v);
            fma_rows(a, v, 8, x + 32 * j, K, R);
        }
    }
    store_rows(a, R, out, ldo);
}

/* Q6_K: per half of a super-block and 16 values l0 .. l0+15 of its 32, four groups of 16 values,
 * each (q - 32) times its exact d * scale */
static ALWAYS_INLINE void dot_q6_k(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    const uint8x16_t low4 = vdupq_n_u8(0xF), three = vdupq_n_u8(3);
    float32x4_t a[ROWS_MAX][4];
    zero_rows(a, R);
    for (int64_t b = 0; b < K / QK_K; b++, w += BYTES_Q6_K, x += QK_K) {
        const int8_t *scales = (const int8_t *)(w + 192);
        const float d = fp16_load(w + 208);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = w + 64 * half, *qh = w + 128 + 32 * half;
            for (int l0 = 0; l0 < 32; l0 += 16) {
                const uint8x16_t la = vld1q_u8(ql + l0), lb = vld1q_u8(ql + 32 + l0), h = vld1q_u8(qh + l0);
                uint8x16_t q[4];
                q[0] = vorrq_u8(vandq_u8(la, low4), vshlq_n_u8(vandq_u8(h, three), 4));
                q[1] = vorrq_u8(vandq_u8(lb, low4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h, 2), three), 4));
                q[2] = vorrq_u8(vshrq_n_u8(la, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h, 4), three), 4));
                q[3] = vorrq_u8(vshrq_n_u8(lb, 4), vshlq_n_u8(vshrq_n_u8(h, 6), 4));
                for (int j = 0; j < 4; j++) {
                    const float ds = d * (float)scales[8 * half + 2 * j + l0 / 16];
                    float32x4_t v[4];
                    s8_to_f32(vsubq_s8(vreinterpretq_s8_u8(q[j]), vdupq_n_s8(32)), v);
                    for (int k = 0; k < 4; k++) v[k] = vmulq_n_f32(v[k], ds);
                    fma_rows(a, v, 4, x + 128 * half + 32 * j + l0, K, R);
                }
            }
        }
    }
    store_rows(a, R, out, ldo);
}

#define TARGET
/* 32 registers: four accumulators a row, four rows of x per block; two, one */
KVREF_DOT_KERNELS(f32, 4)
KVREF_DOT_KERNELS(f16, 4)
KVREF_DOT_KERNELS(bf16, 4)
KVREF_DOT_KERNELS(q4_0, 4)
KVREF_DOT_KERNELS(q4_1, 4)
KVREF_DOT_KERNELS(q5_0, 4)
KVREF_DOT_KERNELS(q8_0, 4)
KVREF_DOT_KERNELS(q4_k, 4)
KVREF_DOT_KERNELS(q6_k, 4)
KVREF_DOT_KERNELS(mxfp4, 4)
#undef TARGET

/* ---- tiles: the scalar dequantizers (already exact), float16 widened 8 at a time ------------ */

static void dequant_f16(int64_t K, const uint8_t *w, float *out) {
    int64_t i = 0;
    for (; i + 4 <= K; i += 4) vst1q_f32(out + i, f16x4(w + 2 * i));
    for (; i < K; i++) out[i] = fp16_load(w + 2 * i);
}

#define GENERIC_DEQUANT(name, type) \
    static void name(int64_t K, const uint8_t *w, float *out) { kvref_dequant_row(type, K, w, out); }
GENERIC_DEQUANT(dequant_f32, KVREF_TYPE_F32)
GENERIC_DEQUANT(dequant_bf16, KVREF_TYPE_BF16)
GENERIC_DEQUANT(dequant_q4_0, KVREF_TYPE_Q4_0)
GENERIC_DEQUANT(dequant_q4_1, KVREF_TYPE_Q4_1)
GENERIC_DEQUANT(dequant_q5_0, KVREF_TYPE_Q5_0)
GENERIC_DEQUANT(dequant_q8_0, KVREF_TYPE_Q8_0)
GENERIC_DEQUANT(dequant_q4_k, KVREF_TYPE_Q4_K)
GENERIC_DEQUANT(dequant_q6_k, KVREF_TYPE_Q6_K)
GENERIC_DEQUANT(dequant_mxfp4, KVREF_TYPE_MXFP4)

/* ---- float32 GEMM on a dequantized tile: outer products ------------------------------------ */

_Static_assert(KVREF_TILE_N == 32, "a tile row is eight NEON vectors, four per half");
#define GEMM_ROWS 6 /* rows of x per block: 24 accumulators and 4 tile vectors */

/* y[i, j] for the R rows of x at x (row stride K), the 16 tile columns at tile and j < ncols: one
 * fused multiply-add per k in k order for every output whatever R, as kernels_avx2.c's gemm_block */
static ALWAYS_INLINE void gemm_block(int64_t K, const float *x, const int R, const float *tile, int64_t ncols, float *y,
                                     int64_t ldy) {
    float32x4_t acc[GEMM_ROWS][4];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = vdupq_n_f32(0.0f);
    for (int64_t k = 0; k < K; k++) {
        float32x4_t w[4];
        for (int j = 0; j < 4; j++) w[j] = vld1q_f32(tile + k * KVREF_TILE_N + 4 * j);
        for (int i = 0; i < R; i++) {
            const float xv = x[i * K + k];
            for (int j = 0; j < 4; j++) acc[i][j] = vfmaq_n_f32(acc[i][j], w[j], xv);
        }
    }
    for (int i = 0; i < R; i++) {
        float row[16];
        for (int j = 0; j < 4; j++) vst1q_f32(row + 4 * j, acc[i][j]);
        memcpy(y + i * ldy, row, (size_t)(ncols < 16 ? ncols : 16) * sizeof(float));
    }
}

static void gemm_f32(int64_t K, const float *x, int64_t T, const float *tile, int64_t nw, float *y, int64_t ldy) {
    for (int64_t h = 0; h < nw; h += 16) {
        const float *half = tile + h;
        float *yh = y + h;
        int64_t t = 0;
        for (; t + GEMM_ROWS <= T; t += GEMM_ROWS) gemm_block(K, x + t * K, GEMM_ROWS, half, nw - h, yh + t * ldy, ldy);
        for (; t + 2 <= T; t += 2) gemm_block(K, x + t * K, 2, half, nw - h, yh + t * ldy, ldy);
        for (; t < T; t++) gemm_block(K, x + t * K, 1, half, nw - h, yh + t * ldy, ldy);
    }
}

/* r[j] = column j of the 4 x 4 block whose rows are r[0..3] */
static ALWAYS_INLINE void transpose4(float32x4_t r[4]) {
    const float32x4_t t0 = vtrn1q_f32(r[0], r[1]), t1 = vtrn2q_f32(r[0], r[1]);
    const float32x4_t t2 = vtrn1q_f32(r[2], r[3]), t3 = vtrn2q_f32(r[2], r[3]);
    r[0] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r[1] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
    r[2] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r[3] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
}

static void tile_columns(int64_t K, const float *rows, float *tile) {
    int64_t k = 0;
    for (; k + 4 <= K; k += 4)
        for (int h = 0; h < 16; h += 4) {
            float32x4_t r[4];
            for (int i = 0; i < 4; i++) r[i] = vld1q_f32(rows + (h + i) * K + k);
            transpose4(r);
            for (int j = 0; j < 4; j++) vst1q_f32(tile + (k + j) * KVREF_TILE_N + h, r[j]);
        }
    for (; k < K; k++)
        for (int64_t i = 0; i < 16; i++) tile[k * KVREF_TILE_N + i] = rows[i * K + k];
}

/* ---- the read-bandwidth probe: four 16-byte loads per step ---------------------------------- */

static uint64_t read_sum(const uint8_t *p, int64_t n) {
    uint64x2_t a[4];
    for (int j = 0; j < 4; j++) a[j] = vdupq_n_u64(0);
    for (int64_t i = 0; i < n; i += 64)
        for (int j = 0; j < 4; j++) a[j] = vaddq_u64(a[j], vreinterpretq_u64_u8(vld1q_u8(p + i + 16 * j)));
    const uint64x2_t s = vaddq_u64(vaddq_u64(a[0], a[1]), vaddq_u64(a[2], a[3]));
    return vgetq_lane_u64(s, 0) + vgetq_lane_u64(s, 1);
}

/* ---- exp (Cephes expf, as in kernels_avx2.c), SwiGLU and GeGLU ----------------------------- */

static ALWAYS_INLINE float32x4_t exp4(float32x4_t x) {
    /* vmaxq/vminq return NaN when either operand is NaN: a NaN stays NaN */
    x = vminq_f32(vdupq_n_f32(88.3762626647949f), vmaxq_f32(vdupq_n_f32(-88.3762626647949f), x));
    float32x4_t fx = vrndmq_f32(vfmaq_f32(vdupq_n_f32(0.5f), x, vdupq_n_f32(1.44269504088896341f)));
    x = vfmsq_f32(x, fx, vdupq_n_f32(0.693359375f));
    x = vfmsq_f32(x, fx, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t y = vdupq_n_f32(1.9875691500e-4f);
    y = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), y, x);
    y = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), y, x);
    y = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), y, x);
    y = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), y, x);
    y = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), y, x);
    y = vfmaq_f32(vaddq_f32(x, vdupq_n_f32(1.0f)), y, vmulq_f32(x, x));
    const int32x4_t n = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(fx), vdupq_n_s32(127)), 23);
    return vmulq_f32(y, vreinterpretq_f32_s32(n));
}

static ALWAYS_INLINE float32x4_t swiglu4(float32x4_t g, float32x4_t u) {
    const float32x4_t sig = vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.0f), exp4(vnegq_f32(g))));
    return vmulq_f32(sig, u);
}

/* gelu_tanh(g) * u as g / (1 + exp(-2y)) * u, y rounded as the spec rounds it (kernels_avx512.c) */
static ALWAYS_INLINE float32x4_t geglu4(float32x4_t g, float32x4_t u) {
    const float32x4_t cube = vmulq_f32(vmulq_f32(vmulq_n_f32(g, KVREF_GELU_K), g), g);
    const float32x4_t y = vmulq_n_f32(vaddq_f32(g, cube), KVREF_GELU_C);
    const float32x4_t e = exp4(vmulq_n_f32(y, -2.0f));
    return vmulq_f32(vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.0f), e)), u);
}

/* gpt-oss's clamped SwiGLU; vminq/vmaxq return NaN when either operand is NaN, so the clamps keep a
 * NaN a NaN */
static ALWAYS_INLINE float32x4_t swiglu_oai4(float32x4_t g, float32x4_t u) {
    const float32x4_t L = vdupq_n_f32(KVREF_SWIGLU_OAI_LIMIT), one = vdupq_n_f32(1.0f);
    g = vminq_f32(g, L);
    u = vmaxq_f32(vminq_f32(u, L), vnegq_f32(L));
    const float32x4_t e = exp4(vmulq_n_f32(g, -KVREF_SWIGLU_OAI_ALPHA));
    return vmulq_f32(vdivq_f32(g, vaddq_f32(one, e)), vaddq_f32(u, one));
}

/* The tail goes through the same vector code (via a padded copy), so each element's value does not
 * depend on where it sits (kernels_avx2.c's glu8) */
static ALWAYS_INLINE void glu4(int64_t n, const float *gate, const float *up, float *out, const int kind) {
#define GLU(g, u) (kind == 1 ? geglu4(g, u) : kind == 2 ? swiglu_oai4(g, u) : swiglu4(g, u))
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(out + i, GLU(vld1q_f32(gate + i), vld1q_f32(up + i)));
    if (i < n) {
        float g[4] = {0}, u[4] = {0}, o[4];
        memcpy(g, gate + i, (size_t)(n - i) * sizeof(float));
        memcpy(u, up + i, (size_t)(n - i) * sizeof(float));
        vst1q_f32(o, GLU(vld1q_f32(g), vld1q_f32(u)));
        memcpy(out + i, o, (size_t)(n - i) * sizeof(float));
    }
#undef GLU
}

static void swiglu(int64_t n, const float *gate, const float *up, float *out) { glu4(n, gate, up, out, 0); }
static void geglu(int64_t n, const float *gate, const float *up, float *out) { glu4(n, gate, up, out, 1); }
static void swiglu_oai(int64_t n, const float *gate, const float *up, float *out) { glu4(n, gate, up, out, 2); }

/* ---- attention chunk kernels (the skeleton that runs them: csrc/attention.c) -------------- */

/* 4 K/V values at element e of a chunk's K or V, as float32: F16 and BF16 widened, I8 times its
 * group's `scale` (these kernels take I8 only when 8 | group_size, their i8_lanes: a vector never
 * spans two groups) */
static ALWAYS_INLINE float32x4_t load_kv4(const uint8_t *base, const int32_t type, int64_t e, float scale) {
    if (type == KVREF_TYPE_I8) return vmulq_n_f32(bytes4(base + e, 1), scale);
    return float4(base + (type == KVREF_TYPE_F32 ? 4 : 2) * e, type);
}
static ALWAYS_INLINE float load_kv1(const uint8_t *base, const int32_t type, int64_t e) {
    return float1(base + (type == KVREF_TYPE_F32 ? 4 : 2) * e, type);
}

/* Scores of 4 keys (K vectors at kb + row[0..4)) for the gb <= 3 heads q[0..gb) of the group (float
 * K types): each K vector is loaded (and widened) once for all gb heads, into 4 x gb accumulators;
 * pairwise adds give each head's 4 sums, to which the head dim's last D % 4 products are added one
 * by one. */
static ALWAYS_INLINE void score4(const kvref_attn_args *a, const float *q, const uint8_t *kb, const int64_t *row,
                                 float *p, const int32_t k_type, const int gb) {
    const int64_t D = a->D, C = KVREF_ATTN_CHUNK, Dv = D / 4 * 4;
    float32x4_t d[3][4];
    for (int g = 0; g < gb; g++)
        for (int r = 0; r < 4; r++) d[g][r] = vdupq_n_f32(0.0f);
    for (int64_t i = 0; i < Dv; i += 4) {
        float32x4_t qv[3];
        for (int g = 0; g < gb; g++) qv[g] = vld1q_f32(q + g * D + i);
        for (int r = 0; r < 4; r++) {
            const float32x4_t kv = load_kv4(kb, k_type, row[r] + i, 0.0f);
            for (int g = 0; g < gb; g++) d[g][r] = vfmaq_f32(d[g][r], qv[g], kv);
        }
    }
    for (int g = 0; g < gb; g++) {
        float dots[4];
        vst1q_f32(dots, vpaddq_f32(vpaddq_f32(d[g][0], d[g][1]), vpaddq_f32(d[g][2], d[g][3])));
        for (int r = 0; r < 4; r++) {
            for (int64_t t = Dv; t < D; t++) dots[r] += q[g * D + t] * load_kv1(kb, k_type, row[r] + t);
            p[g * C + r] = kvref_attn_score_value(dots[r] * a->scale);
        }
    }
}

/* p[g * C + s] = (q_g . k_s) * scale for the chunk's keys (float K types), 4 at a time for up to 3
 * heads, the last n % 4 keys one by one; masked keys are scored like the rest (the skeleton hides
 * them). Every 8 keys, asks for the K and V of the keys a chunk ahead. */
static ALWAYS_INLINE void score_typed(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p, const int32_t k_type) {
    const int64_t n = c->n, G = a->G, D = a->D, C = KVREF_ATTN_CHUNK, Dv = D / 4 * 4;
    int64_t s = 0;
    for (; s + 4 <= n; s += 4) {
        if (s % 8 == 0) {
            kvref_attn_prefetch(c->k, a->k_type, D, c->row, s + KVREF_ATTN_PREFETCH_KEYS, c->nrows);
            kvref_attn_prefetch(c->v, a->v_type, D, c->row, s + KVREF_ATTN_PREFETCH_KEYS, c->nrows);
        }
        for (int64_t g0 = 0; g0 < G; g0 += 3) {
            const float *qg = c->q + g0 * D;
            float *pg = p + g0 * C + s;
            switch (G - g0) {
            case 1: score4(a, qg, c->k, c->row + s, pg, k_type, 1); break;
            case 2: score4(a, qg, c->k, c->row + s, pg, k_type, 2); break;
            default: score4(a, qg, c->k, c->row + s, pg, k_type, 3);
            }
        }
    }
    for (; s < n; s++)
        for (int64_t g = 0; g < G; g++) {
            float32x4_t d = vdupq_n_f32(0.0f);
            int64_t i = 0;
            for (; i < Dv; i += 4) d = vfmaq_f32(d, vld1q_f32(c->q + g * D + i), load_kv4(c->k, k_type, c->row[s] + i, 0.0f));
            float dot = vaddvq_f32(d);
            for (; i < D; i++) dot += c->q[g * D + i] * load_kv1(c->k, k_type, c->row[s] + i);
            p[g * C + s] = kvref_attn_score_value(dot * a->scale);
        }
}

/* acc[g] += p[g] V over the chunk's n keys for the gb <= 3 heads p[0..gb), acc[0..gb) of the group,
 * one 4-wide slice of the head dim at a time: each V vector is loaded (and widened) once for all gb
 * heads, `keys` keys per step so that several FMA chains are in flight. Masked keys never touch acc. */
static ALWAYS_INLINE void pv_block(const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc,
                                   const int32_t v_type, const int gb) {
#define load_v(s) load_kv4(c->v, v_type, c->row[s] + i, v_type == KVREF_TYPE_I8 ? c->v_scales[c->srow[s] + jg] : 0.0f)
    const int64_t n = c->n, D = a->Dv, C = KVREF_ATTN_CHUNK, Dv = D / 4 * 4; /* D: the values' width here */
    const int all = c->all, keys = gb == 1 ? 4 : 2;
    for (int64_t i = 0; i < Dv; i += 4) {
        const int64_t jg = v_type == KVREF_TYPE_I8 ? i / a->group_size : 0;
        float32x4_t ac[4][3];
        for (int k = 0; k < keys; k++)
            for (int g = 0; g < gb; g++) ac[k][g] = k == 0 ? vld1q_f32(acc + g * D + i) : vdupq_n_f32(0.0f);
        int64_t s = 0;
        if (all)
            for (; s + keys <= n; s += keys)
                for (int k = 0; k < keys; k++) {
                    const float32x4_t v = load_v(s + k);
                    for (int g = 0; g < gb; g++) ac[k][g] = vfmaq_n_f32(ac[k][g], v, p[g * C + s + k]);
                }
        for (; s < n; s++) {
            if (!all && kvref_attn_hidden(c, s)) continue;
            const float32x4_t v = load_v(s);
            for (int g = 0; g < gb; g++) ac[0][g] = vfmaq_n_f32(ac[0][g], v, p[g * C + s]);
        }
        for (int g = 0; g < gb; g++) {
            float32x4_t sum = ac[0][g];
            for (int k = 1; k < keys; k++) sum = vaddq_f32(sum, ac[k][g]);
            vst1q_f32(acc + g * D + i, sum);
        }
    }
    for (int64_t i = Dv; i < D; i++) /* the head dim's last D % 4 elements (float types only) */
        for (int g = 0; g < gb; g++) {
            float av = acc[g * D + i];
            for (int64_t s = 0; s < n; s++) {
                if (!all && kvref_attn_hidden(c, s)) continue;
                av += p[g * C + s] * load_kv1(c->v, v_type, c->row[s] + i);
            }
            acc[g * D + i] = av;
        }
#undef load_v
}

static ALWAYS_INLINE void pv_typed(const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc,
                                   const int32_t v_type) {
    const int64_t D = a->Dv, C = KVREF_ATTN_CHUNK; /* acc [G, Dv] */
    for (int64_t g0 = 0; g0 < a->G; g0 += 3) switch (a->G - g0) {
        case 1: pv_block(a, c, p + g0 * C, acc + g0 * D, v_type, 1); break;
        case 2: pv_block(a, c, p + g0 * C, acc + g0 * D, v_type, 2); break;
        default: pv_block(a, c, p + g0 * C, acc + g0 * D, v_type, 3);
        }
}

/* ---- KIVI4 (kvref/cache/quant.py; the skeleton hands them over when 16 divides head_dim and the
 * group size, the tables' kivi_lanes: 8 nibble bytes are 16 elements of one V group) ------------
 * Each key's K or V vector is decoded once into float32 (level * scale + zero, one fused
 * multiply-add a value), then used by every head of the group. */

#define KIVI_MAX_D 512 /* a decoded vector on the stack; wider heads run the scalar kernels */

/* the levels of nibble bytes b[0..8): elements 0-15 in order (element e in the low nibble of byte e / 2
 * when e is even) */
static ALWAYS_INLINE void kivi_levels16(const uint8_t *b, float32x4_t l[4]) {
    const uint8x8_t bytes = vld1_u8(b);
    const uint8x8x2_t e = vzip_u8(vand_u8(bytes, vdup_n_u8(15)), vshr_n_u8(bytes, 4));
    s8_to_f32(vreinterpretq_s8_u8(vcombine_u8(e.val[0], e.val[1])), l); /* levels below 16 */
}

/* Scores of a chunk's KIVI4 keys: a quantized key decoded with its group's per-channel scales and
 * zeros (params [2, D]), a key past the last full group read from its float16 residual row. Every
 * key is scored (the skeleton hides the masked ones). */
static void score_kivi(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p) {
    const int64_t G = a->G, D = a->D, C = KVREF_ATTN_CHUNK, gs = a->group_size, HD = a->Hkv * D;
    const int64_t c0 = c->kp - a->k_positions, nq = a->S - a->S % gs; /* keys below nq are quantized */
    if (D > KIVI_MAX_D) {
        kvref_attn_score_kivi_ref(a, c, p);
        return;
    }
    float k[KIVI_MAX_D];
    for (int64_t s = 0; s < c->n; s++) {
        if (s % 8 == 0) /* the keys a chunk ahead */
            for (int64_t r = s + KVREF_ATTN_PREFETCH_KEYS; r < s + KVREF_ATTN_PREFETCH_KEYS + 8 && r < c->nrows; r++)
                __builtin_prefetch(c->k + c->row[r] / 2, 0, 2);
        const int64_t key = c0 + s;
        if (key < nq) {
            const float *params = c->k_scales + (c->row[s] / HD / gs) * a->Hkv * 2 * D;
            for (int64_t i = 0; i < D; i += 16) {
                float32x4_t l[4];
                kivi_levels16(c->k + c->row[s] / 2 + i / 2, l);
                for (int j = 0; j < 4; j++)
                    vst1q_f32(k + i + 4 * j, vfmaq_f32(vld1q_f32(params + D + i + 4 * j), l[j], vld1q_f32(params + i + 4 * j)));
            }
        } else {
            const uint16_t *res = c->k_residual + (key % gs) * HD;
            for (int64_t i = 0; i < D; i += 4) vst1q_f32(k + i, f16x4((const uint8_t *)(res + i)));
        }
        for (int64_t g = 0; g < G; g++) {
            float32x4_t d[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
            for (int64_t i = 0; i < D; i += 16)
                for (int j = 0; j < 4; j++) d[j] = vfmaq_f32(d[j], vld1q_f32(c->q + g * D + i + 4 * j), vld1q_f32(k + i + 4 * j));
            p[g * C + s] = kvref_attn_score_value(sum4(d) * a->scale);
        }
    }
}

/* acc += p V over a chunk's KIVI4 values: each visible key's V decoded with its groups' (scale, zero)
 * pairs, then added into the G heads' sums */
static void values_kivi(const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc) {
    const int64_t G = a->G, D = a->D, C = KVREF_ATTN_CHUNK, gs = a->group_size;
    if (D > KIVI_MAX_D) {
        kvref_attn_values_kivi_ref(a, c, p, acc);
        return;
    }
    float v[KIVI_MAX_D];
    for (int64_t s = 0; s < c->n; s++) {
        if (s % 8 == 0)
            for (int64_t r = s + KVREF_ATTN_PREFETCH_KEYS; r < s + KVREF_ATTN_PREFETCH_KEYS + 8 && r < c->nrows; r++)
                __builtin_prefetch(c->v + c->row[r] / 2, 0, 2);
        if (!c->all && kvref_attn_hidden(c, s)) continue;
        const float *pairs = c->v_scales + 2 * c->srow[s]; /* [D / gs, 2] */
        for (int64_t i = 0; i < D; i += 16) {
            float32x4_t l[4];
            kivi_levels16(c->v + c->row[s] / 2 + i / 2, l);
            const float sc = pairs[2 * (i / gs)], zr = pairs[2 * (i / gs) + 1];
            for (int j = 0; j < 4; j++) vst1q_f32(v + i + 4 * j, vfmaq_n_f32(vdupq_n_f32(zr), l[j], sc));
        }
        for (int64_t g = 0; g < G; g++) {
            float *ag = acc + g * D;
            const float pg = p[g * C + s];
            for (int64_t i = 0; i < D; i += 4) vst1q_f32(ag + i, vfmaq_n_f32(vld1q_f32(ag + i), vld1q_f32(v + i), pg));
        }
    }
}

/* The integer dot of n bytes (n a multiple of 8) of q and k, exact: one table's instructions */
typedef int32_t (*i8_dot_fn)(const int8_t *q, const int8_t *k, int64_t n);

static ALWAYS_INLINE int32_t i8_dot_neon(const int8_t *q, const int8_t *k, int64_t n) {
    int32x4_t acc = vdupq_n_s32(0);
    for (int64_t j = 0; j < n; j += 8) acc = vpadalq_s16(acc, vmull_s8(vld1_s8(q + j), vld1_s8(k + j)));
    return vaddvq_s32(acc);
}

/* An I8 K's integer scoring (internal.h), key by key and head by head: each scale group's exact
 * integer dot I_b, then the float32 operations of kvref_attn_score_i8_ref, written as it writes them */
static ALWAYS_INLINE void score_i8(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p, const i8_dot_fn dot) {
    const int64_t G = a->G, D = a->D, C = KVREF_ATTN_CHUNK, gs = a->group_size, ng = D / gs;
    for (int64_t s = 0; s < c->n; s++) {
        if (s % 8 == 0) {
            kvref_attn_prefetch(c->k, a->k_type, D, c->row, s + KVREF_ATTN_PREFETCH_KEYS, c->nrows);
            kvref_attn_prefetch(c->v, a->v_type, D, c->row, s + KVREF_ATTN_PREFETCH_KEYS, c->nrows);
        }
        if (!c->all && kvref_attn_hidden(c, s)) continue;
        const int8_t *ks = (const int8_t *)c->k + c->row[s];
        const float *kd = c->k_scales + c->srow[s];
        for (int64_t g = 0; g < G; g++) {
            float score = 0.0f;
            for (int64_t b = 0; b < ng; b++)
                score += (float)dot(c->q8 + g * D + b * gs, ks + b * gs, gs) * (c->qe[g * ng + b] * kd[b]);
            p[g * C + s] = kvref_attn_score_value(score);
        }
    }
}

static ALWAYS_INLINE void attn_score_with(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p, const i8_dot_fn dot) {
    switch (a->k_type) {
    case KVREF_TYPE_KIVI4: score_kivi(a, c, p); break;
    case KVREF_TYPE_I8: score_i8(a, c, p, dot); break;
    case KVREF_TYPE_F16: score_typed(a, c, p, KVREF_TYPE_F16); break;
    case KVREF_TYPE_BF16: score_typed(a, c, p, KVREF_TYPE_BF16); break;
    default: score_typed(a, c, p, KVREF_TYPE_F32);
    }
}

static void attn_score(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p) {
    attn_score_with(a, c, p, i8_dot_neon);
}

static void attn_values(const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc) {
    switch (a->v_type) {
    case KVREF_TYPE_KIVI4: values_kivi(a, c, p, acc); break;
    case KVREF_TYPE_I8: pv_typed(a, c, p, acc, KVREF_TYPE_I8); break;
    case KVREF_TYPE_F16: pv_typed(a, c, p, acc, KVREF_TYPE_F16); break;
    case KVREF_TYPE_BF16: pv_typed(a, c, p, acc, KVREF_TYPE_BF16); break;
    default: pv_typed(a, c, p, acc, KVREF_TYPE_F32);
    }
}

/* each head's max and exponentials 4 keys at a time, the last n % 4 one by one (libm expf) */
static void attn_exp(int64_t G, int64_t n, const float *m, float *p, float *mnew, float *sum) {
    const int64_t nv = n / 4 * 4;
    for (int64_t g = 0; g < G; g++) {
        float *pg = p + g * KVREF_ATTN_CHUNK;
        float32x4_t vmax = vdupq_n_f32(-INFINITY);
        int64_t s = 0;
        for (; s < nv; s += 4) vmax = vmaxq_f32(vmax, vld1q_f32(pg + s));
        float cmax = vmaxvq_f32(vmax);
        for (; s < n; s++) cmax = pg[s] > cmax ? pg[s] : cmax;
        const float mx = cmax > m[g] ? cmax : m[g];
        float32x4_t vsum = vdupq_n_f32(0.0f);
        for (s = 0; s < nv; s += 4) {
            const float32x4_t e = exp4(vsubq_f32(vld1q_f32(pg + s), vdupq_n_f32(mx)));
            vst1q_f32(pg + s, e);
            vsum = vaddq_f32(vsum, e);
        }
        float total = vaddvq_f32(vsum);
        for (; s < n; s++) {
            pg[s] = expf(pg[s] - mx);
            total += pg[s];
        }
        mnew[g] = mx;
        sum[g] = total;
    }
}

/* ---- 8-bit activations ---------------------------------------------------------------------- */

/* the scalar kernel's blocks: the same d, 1/d and rint (vcvtnq rounds to nearest even) */
static void quantize_q8(int64_t K, const float *x, int8_t *qs, float *ds) {
    for (int64_t b = 0; b < K / 32; b++, x += 32, qs += 32, ds += 2) {
        float32x4_t v[8], amax = vdupq_n_f32(0.0f);
        uint32x4_t ok = vdupq_n_u32(~0u);
        for (int i = 0; i < 8; i++) {
            v[i] = vld1q_f32(x + 4 * i);
            amax = vmaxq_f32(amax, vabsq_f32(v[i]));
            /* v * 0 is NaN exactly for NaN and infinities */
            ok = vandq_u32(ok, vceqq_f32(vmulq_n_f32(v[i], 0.0f), vdupq_n_f32(0.0f)));
        }
        float d, id;
        kvref_q8_scale(vmaxvq_f32(amax), vminvq_u32(ok) != 0, &d, &id);
        int32x4_t q[8], sum = vdupq_n_s32(0);
        for (int i = 0; i < 8; i++) { /* vminnmq returns 127 for a NaN, as the scalar kernel maps NaN to 127 */
            const float32x4_t r = vmaxq_f32(vminnmq_f32(vmulq_n_f32(v[i], id), vdupq_n_f32(127.0f)), vdupq_n_f32(-127.0f));
            q[i] = vcvtnq_s32_f32(r);
            sum = vaddq_s32(sum, q[i]);
        }
        for (int h = 0; h < 2; h++) {
            const int16x8_t lo = vcombine_s16(vmovn_s32(q[4 * h]), vmovn_s32(q[4 * h + 1]));
            const int16x8_t hi = vcombine_s16(vmovn_s32(q[4 * h + 2]), vmovn_s32(q[4 * h + 3]));
            vst1q_s8(qs + 16 * h, vcombine_s8(vmovn_s16(lo), vmovn_s16(hi)));
        }
        ds[0] = d;
        ds[1] = d * (float)vaddvq_s32(sum); /* the sum of qs: an exact integer below 2**12 */
    }
}

/* The 8 value vectors of rows 8h .. 8h+7 of a packed record (internal.h), 4 rows a register: u[v][k]
 * holds values 4v .. 4v+3 of row 8h + 4k + i in its bytes 4i .. 4i+3, as u = q + bias (at most 63),
 * but for Q8_0 the signed q itself (u - 128: the products are of signed bytes). */
static ALWAYS_INLINE void packed_values(int32_t type, const uint8_t *rec, int h, int8x16_t u[8][2]) {
    const uint8_t *vals = rec + kvref_pack_values_at(type) + 32 * h, *high = rec + kvref_pack_planes_at(type);
    for (int k = 0; k < 2; k++) {
        if (type == KVREF_TYPE_Q8_0) {
            for (int v = 0; v < 8; v++) u[v][k] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(vals + 64 * v + 16 * k), vdupq_n_u8(0x80)));
            continue;
        }
        uint8x16_t w[8];
        for (int j = 0; j < 4; j++) {
            const uint8x16_t b = vld1q_u8(vals + 64 * j + 16 * k);
            w[j] = vandq_u8(b, vdupq_n_u8(0xF));
            w[j + 4] = vshrq_n_u8(b, 4);
        }
        if (type == KVREF_TYPE_Q5_0) /* bit 4 from its masks: bits 32h + 16k .. +15 are these rows' */
            for (int v = 0; v < 8; v++) {
                uint64_t mask;
                memcpy(&mask, high + 8 * v, 8);
                w[v] = vorrq_u8(w[v], high_bits16((uint32_t)(mask >> (32 * h + 16 * k)) & 0xFFFF));
            }
        if (type == KVREF_TYPE_Q6_K) /* bits 4-5: field v % 4 of vector v / 4 moved to bits 4-5, or-ed in */
            for (int g = 0; g < 2; g++) {
                const uint8x16_t f = vld1q_u8(high + 64 * g + 32 * h + 16 * k), m = vdupq_n_u8(0x30);
                w[4 * g] = vorrq_u8(w[4 * g], vandq_u8(vshlq_n_u8(f, 4), m));
                w[4 * g + 1] = vorrq_u8(w[4 * g + 1], vandq_u8(vshlq_n_u8(f, 2), m));
                w[4 * g + 2] = vorrq_u8(w[4 * g + 2], vandq_u8(f, m));
                w[4 * g + 3] = vorrq_u8(w[4 * g + 3], vandq_u8(vshrq_n_u8(f, 2), m));
            }
        for (int v = 0; v < 8; v++) u[v][k] = vreinterpretq_s8_u8(w[v]);
    }
}

/* a Q4_K header's 12 planes (internal.h) -> sm: the 16 rows' sc [8][16], then m [8][16], a byte
 * each; a plane is one register */
static ALWAYS_INLINE void q4k_header_scales_mins(const uint8_t *hd, uint8_t sm[256]) {
    for (int k = 0; k < 4; k++) {
        const uint8x16_t p0 = vld1q_u8(hd + 64 + 16 * k), p4 = vld1q_u8(hd + 128 + 16 * k), p8 = vld1q_u8(hd + 192 + 16 * k);
        vst1q_u8(sm + 16 * k, vandq_u8(p0, vdupq_n_u8(63)));
        vst1q_u8(sm + 128 + 16 * k, vandq_u8(p4, vdupq_n_u8(63)));
        /* sub-block k + 4: a nibble of plane 8 + k (vsli keeps the low one), bits 7:6 of plane k (4 + k
         * for the min) inserted above it */
        vst1q_u8(sm + 64 + 16 * k, vsliq_n_u8(p8, vshrq_n_u8(p0, 6), 4));
        vst1q_u8(sm + 192 + 16 * k, vsliq_n_u8(vshrq_n_u8(p8, 4), vshrq_n_u8(p4, 6), 4));
    }
}

/* rows 8h + 4k .. +3's scales of record j of a span (header hd, record rec, Q4_K's sm unpacked from
 * hd): s[k][0] d (Q6_K: of values 0-15), s[k][1] m (Q6_K: d of 16-31); the K-quants' from the
 * header's fields, each product exact, as kernels_avx2.c's packed_scales */
static ALWAYS_INLINE void packed_scales(int32_t type, const uint8_t *hd, const uint8_t *sm, const uint8_t *rec, int64_t j,
                                        int h, float32x4_t s[2][2]) {
    for (int k = 0; k < 2; k++) {
        const int r0 = 8 * h + 4 * k;
        if (type == KVREF_TYPE_Q4_K) {
            s[k][0] = vmulq_f32(f16x4(hd + 2 * r0), bytes4(sm + 16 * j + r0, 0));
            s[k][1] = vmulq_f32(vnegq_f32(f16x4(hd + 32 + 2 * r0)), bytes4(sm + 128 + 16 * j + r0, 0));
        } else if (type == KVREF_TYPE_Q6_K) {
            s[k][0] = vmulq_f32(f16x4(hd + 2 * r0), bytes4(hd + 32 + 32 * j + r0, 1));
            s[k][1] = vmulq_f32(f16x4(hd + 2 * r0), bytes4(hd + 48 + 32 * j + r0, 1));
        } else {
            s[k][0] = f16x4(rec + 2 * r0);
            s[k][1] = type == KVREF_TYPE_Q4_1 ? f16x4(rec + 32 + 2 * r0) : vdupq_n_f32(0.0f);
        }
    }
}

/* half[t][e][k] = the integer sums of row t of x (R rows at x, stride K) with the record's values
 * 16e .. 16e+15 of rows 8h + 4k .. +3 (u: packed_values), one lane a row: one table's instructions */
typedef void (*packed_isums_fn)(const int8x16_t u[8][2], const int8_t *x, int64_t K, int R, int32x4_t half[][2][2]);

/* four byte products a lane, without sdot: widening multiplies, then pairwise adds (a pair of products
 * is at most 2 x 128 x 127, within int16) */
static ALWAYS_INLINE int32x4_t dot4_neon(int32x4_t acc, int8x16_t u, int8x16_t x) {
    const int16x8_t pairs = vpaddq_s16(vmull_s8(vget_low_s8(u), vget_low_s8(x)), vmull_high_s8(u, x));
    return vpadalq_s16(acc, pairs);
}

static ALWAYS_INLINE void packed_isums_neon(const int8x16_t u[8][2], const int8_t *x, int64_t K, int R, int32x4_t half[][2][2]) {
    for (int t = 0; t < R; t++)
        for (int v = 0; v < 8; v++) {
            int32_t x4;
            memcpy(&x4, x + t * K + 4 * v, 4);
            const int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(x4));
            for (int k = 0; k < 2; k++) half[t][v / 4][k] = dot4_neon(half[t][v / 4][k], u[v][k], xv);
        }
}

/* R rows of x against rows 8h .. 8h+7 of one packed group: the scalar kernel's operations per lane
 * (Q8_0's sums are q x directly, the others' u x less the bias times x's sums) */
static ALWAYS_INLINE void packed_dot_half(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs, const float *ds,
                                          const int32_t *xsum, const int R, int h, float *out, const packed_isums_fn isums) {
    const int64_t nb = K / 32, rec_bytes = kvref_pack_record_bytes(type), span = kvref_pack_span(type);
    const int64_t header = kvref_pack_header_bytes(type);
    const int32_t bias = type == KVREF_TYPE_Q8_0 ? 0 : kvref_pack_bias(type);
    float32x4_t acc[ROWS_MAX][2];
    uint8_t sm[256];
    for (int t = 0; t < R; t++) acc[t][0] = acc[t][1] = vdupq_n_f32(0.0f);
    for (int64_t b0 = 0; b0 < nb; b0 += span) {
        const uint8_t *hd = kvref_pack_header(type, group, b0);
        if (type == KVREF_TYPE_Q4_K) q4k_header_scales_mins(hd, sm);
        for (int64_t j = 0; j < span; j++) {
            const int64_t b = b0 + j;
            const uint8_t *rec = hd + header + j * rec_bytes;
            if (R >= 4 && h == 0) kvref_pack_prefetch(rec + KVREF_PACK_PREFETCH_RECORDS * rec_bytes, rec_bytes);
            int8x16_t u[8][2];
            packed_values(type, rec, h, u);
            float32x4_t sc[2][2];
            packed_scales(type, hd, sm, rec, j, h, sc);
            int32x4_t half[ROWS_MAX][2][2];
            for (int t = 0; t < R; t++)
                for (int e = 0; e < 2; e++) half[t][e][0] = half[t][e][1] = vdupq_n_s32(-bias * xsum[t * (K / 16) + 2 * b + e]);
            isums(u, qs + 32 * b, K, R, half);
            for (int t = 0; t < R; t++) {
                const float dx = ds[(t * nb + b) * 2];
                for (int k = 0; k < 2; k++) {
                    if (type == KVREF_TYPE_Q6_K) { /* a scale per 16 values */
                        acc[t][k] = vfmaq_f32(acc[t][k], vcvtq_f32_s32(half[t][0][k]), vmulq_n_f32(sc[k][0], dx));
                        acc[t][k] = vfmaq_f32(acc[t][k], vcvtq_f32_s32(half[t][1][k]), vmulq_n_f32(sc[k][1], dx));
                        continue;
                    }
                    const int32x4_t isum = vaddq_s32(half[t][0][k], half[t][1][k]);
                    acc[t][k] = vfmaq_f32(acc[t][k], vcvtq_f32_s32(isum), vmulq_n_f32(sc[k][0], dx));
                    if (type == KVREF_TYPE_Q4_1 || type == KVREF_TYPE_Q4_K)
                        acc[t][k] = vfmaq_n_f32(acc[t][k], sc[k][1], ds[(t * nb + b) * 2 + 1]);
                }
            }
        }
    }
    for (int t = 0; t < R; t++)
        for (int k = 0; k < 2; k++) vst1q_f32(out + KVREF_PACK_ROWS * t + 8 * h + 4 * k, acc[t][k]);
}

/* T <= 8 rows of x in blocks of 4, 2, 1, each half of the group's rows in turn */
static ALWAYS_INLINE void packed_dot_type(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs, const float *ds,
                                          const int32_t *xsum, int64_t T, float *out, const packed_isums_fn isums) {
    const int64_t nd = K / 16; /* ds and xsum per row of x */
    for (int h = 0; h < 2; h++) {
        int64_t t = 0;
        for (; t + 4 <= T; t += 4) packed_dot_half(type, K, group, qs + t * K, ds + t * nd, xsum + t * nd, 4, h, out + 16 * t, isums);
        for (; t + 2 <= T; t += 2) packed_dot_half(type, K, group, qs + t * K, ds + t * nd, xsum + t * nd, 2, h, out + 16 * t, isums);
        for (; t < T; t++) packed_dot_half(type, K, group, qs + t * K, ds + t * nd, xsum + t * nd, 1, h, out + 16 * t, isums);
    }
}

/* the type a constant in each copy */
static ALWAYS_INLINE void packed_dot_with(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs, const float *ds,
                                          const int32_t *xsum, int64_t T, float *out, const packed_isums_fn isums) {
    switch (type) {
    case KVREF_TYPE_Q4_0: packed_dot_type(KVREF_TYPE_Q4_0, K, group, qs, ds, xsum, T, out, isums); break;
    case KVREF_TYPE_Q4_1: packed_dot_type(KVREF_TYPE_Q4_1, K, group, qs, ds, xsum, T, out, isums); break;
    case KVREF_TYPE_Q5_0: packed_dot_type(KVREF_TYPE_Q5_0, K, group, qs, ds, xsum, T, out, isums); break;
    case KVREF_TYPE_Q8_0: packed_dot_type(KVREF_TYPE_Q8_0, K, group, qs, ds, xsum, T, out, isums); break;
    case KVREF_TYPE_Q4_K: packed_dot_type(KVREF_TYPE_Q4_K, K, group, qs, ds, xsum, T, out, isums); break;
    default: packed_dot_type(KVREF_TYPE_Q6_K, K, group, qs, ds, xsum, T, out, isums);
    }
}

static void packed_dot(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs, const float *ds,
                       const int32_t *xsum, int64_t T, float *out) {
    packed_dot_with(type, K, group, qs, ds, xsum, T, out, packed_isums_neon);
}

static void to_fp16(int64_t n, const float *x, uint16_t *out) {
    int64_t i = 0; /* vcvt rounds to nearest even, as kvref_fp32_to_fp16 */
    for (; i + 4 <= n; i += 4) vst1_u16(out + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(x + i))));
    for (; i < n; i++) out[i] = kvref_fp32_to_fp16(x[i]);
}

/* ---- sdot and smmla (the dotprod and i8mm tables) ------------------------------------------- */

#if KVREF_NEON_DOT

TARGET_DOT static inline int32_t i8_dot_sdot(const int8_t *q, const int8_t *k, int64_t n) {
    int32x4_t acc = vdupq_n_s32(0);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) acc = vdotq_s32(acc, vld1q_s8(q + j), vld1q_s8(k + j));
    int32_t dot = vaddvq_s32(acc);
    if (j < n) dot += vaddv_s32(vdot_s32(vdup_n_s32(0), vld1_s8(q + j), vld1_s8(k + j)));
    return dot;
}

TARGET_DOT static inline void packed_isums_sdot(const int8x16_t u[8][2], const int8_t *x, int64_t K, int R,
                                                int32x4_t half[][2][2]) {
    for (int t = 0; t < R; t++) {
        const int8x16_t xv[2] = {vld1q_s8(x + t * K), vld1q_s8(x + t * K + 16)};
        for (int v = 0; v < 8; v++)
            for (int k = 0; k < 2; k++) {
                int32x4_t *hk = &half[t][v / 4][k];
                switch (v % 4) { /* the lane a constant */
                case 0: *hk = vdotq_laneq_s32(*hk, u[v][k], xv[v / 4], 0); break;
                case 1: *hk = vdotq_laneq_s32(*hk, u[v][k], xv[v / 4], 1); break;
                case 2: *hk = vdotq_laneq_s32(*hk, u[v][k], xv[v / 4], 2); break;
                default: *hk = vdotq_laneq_s32(*hk, u[v][k], xv[v / 4], 3);
                }
            }
    }
}

/* smmla multiplies two rows of x by two weight rows, 8 values each: the weight operand of rows
 * (4k, 4k + 1) is the 32-bit interleave of vectors v, v + 1 (each row's values 4v .. 4v+7), and
 * the result [t r0, t r1, t' r0, t' r1] is put back into a lane per row. An odd last row of x goes
 * in as its own pair and its second half is dropped. */
TARGET_I8MM static inline void packed_isums_smmla(const int8x16_t u[8][2], const int8_t *x, int64_t K, int R,
                                                  int32x4_t half[][2][2]) {
    int8x16_t w[4][2][2]; /* [v / 2][k][rows 0-1 or 2-3 of the four] */
    for (int v = 0; v < 8; v += 2)
        for (int k = 0; k < 2; k++) {
            const int32x4_t a = vreinterpretq_s32_s8(u[v][k]), b = vreinterpretq_s32_s8(u[v + 1][k]);
            w[v / 2][k][0] = vreinterpretq_s8_s32(vzip1q_s32(a, b));
            w[v / 2][k][1] = vreinterpretq_s8_s32(vzip2q_s32(a, b));
        }
    for (int t = 0; t < R; t += 2) {
        const int8_t *x0 = x + t * K, *x1 = t + 1 < R ? x0 + K : x0;
        for (int e = 0; e < 2; e++)
            for (int k = 0; k < 2; k++) {
                int32x4_t mm[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
                for (int c = 2 * e; c < 2 * e + 2; c++) {
                    const int8x16_t xv = vcombine_s8(vld1_s8(x0 + 8 * c), vld1_s8(x1 + 8 * c));
                    for (int p = 0; p < 2; p++) mm[p] = vmmlaq_s32(mm[p], xv, w[c][k][p]);
                }
                const int64x2_t m0 = vreinterpretq_s64_s32(mm[0]), m1 = vreinterpretq_s64_s32(mm[1]);
                half[t][e][k] = vaddq_s32(half[t][e][k], vreinterpretq_s32_s64(vzip1q_s64(m0, m1)));
                if (t + 1 < R) half[t + 1][e][k] = vaddq_s32(half[t + 1][e][k], vreinterpretq_s32_s64(vzip2q_s64(m0, m1)));
            }
    }
}

/* ---- the 8-bit GEMM on tiles (internal.h, kvref_gemm_q8_fn) ---------------------------------
 * Both kernels take x back to signed bytes (xu - 128: sdot and smmla multiply signed by signed), so
 * each block's integer is sum x q directly, the same exact I_b as the definition's zero + sum xu q;
 * then the definition's fused multiply-adds per column. 16 columns (4 vectors) of the tile at a time. */

#define Q8_GEMM_ROWS 3 /* sdot: rows of x per block, 8 registers each */

/* acc[j] += fl(dx d_w) I (and m_w sx with affine) for the 4 column vectors of record rec at column c0 */
static ALWAYS_INLINE void gemm_q8_update(float32x4_t acc[4], const int32x4_t isum[4], const uint8_t *rec, int64_t bv,
                                         int64_t c0, float dx, float sx, int affine) {
    for (int j = 0; j < 4; j++) {
        const float32x4_t d = load_f32x4(rec + KVREF_Q8_TILE_D(bv) + 4 * (c0 + 4 * j));
        acc[j] = vfmaq_f32(acc[j], vcvtq_f32_s32(isum[j]), vmulq_n_f32(d, dx));
        if (affine) acc[j] = vfmaq_n_f32(acc[j], load_f32x4(rec + KVREF_Q8_TILE_M(bv) + 4 * (c0 + 4 * j)), sx);
    }
}

static ALWAYS_INLINE void store_cols(const float32x4_t acc[4], int64_t ncols, float *y) {
    float row[16];
    for (int j = 0; j < 4; j++) vst1q_f32(row + 4 * j, acc[j]);
    memcpy(y, row, (size_t)(ncols < 16 ? ncols : 16) * sizeof(float));
}

/* R rows of x (xu, xds at their first row) against tile columns c0 .. c0+15 */
TARGET_DOT static ALWAYS_INLINE void gemm_q8_sdot_block(int64_t K, const uint8_t *xu, const float *xds, const int R,
                                                       const uint8_t *tile, int64_t bv, int64_t c0, int64_t nw,
                                                       int affine, float *y, int64_t ldy) {
    float32x4_t acc[Q8_GEMM_ROWS][4];
    for (int t = 0; t < R; t++)
        for (int j = 0; j < 4; j++) acc[t][j] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < K / bv; b++) {
        const uint8_t *rec = tile + b * KVREF_Q8_TILE_RECORD(bv);
        int32x4_t isum[Q8_GEMM_ROWS][4];
        for (int t = 0; t < R; t++)
            for (int j = 0; j < 4; j++) isum[t][j] = vdupq_n_s32(0);
        for (int64_t s = 0; s < bv / 4; s++) {
            int8x16_t w[4];
            for (int j = 0; j < 4; j++) w[j] = vld1q_s8((const int8_t *)rec + s * 4 * KVREF_TILE_N + 4 * (c0 + 4 * j));
            for (int t = 0; t < R; t++) {
                uint32_t x4;
                memcpy(&x4, xu + t * K + b * bv + 4 * s, 4);
                const int8x16_t xv = vreinterpretq_s8_u32(vdupq_n_u32(x4 ^ 0x80808080u));
                for (int j = 0; j < 4; j++) isum[t][j] = vdotq_s32(isum[t][j], w[j], xv);
            }
        }
        for (int t = 0; t < R; t++) {
            const float *xd = xds + (t * (K / 32) + b * bv / 32) * 2;
            gemm_q8_update(acc[t], isum[t], rec, bv, c0, xd[0], xd[1], affine);
        }
    }
    for (int t = 0; t < R; t++) store_cols(acc[t], nw - c0, y + t * ldy + c0);
}

TARGET_DOT static void gemm_q8_dotprod(int64_t K, const uint8_t *xu, const float *xds, int64_t T, const uint8_t *tile,
                                       int64_t bv, int64_t nw, int affine, float *y, int64_t ldy) {
    const int64_t nd = K / 16; /* xds per row of x */
    for (int64_t c0 = 0; c0 < nw; c0 += 16) {
        int64_t t = 0;
        for (; t + Q8_GEMM_ROWS <= T; t += Q8_GEMM_ROWS)
            gemm_q8_sdot_block(K, xu + t * K, xds + t * nd, Q8_GEMM_ROWS, tile, bv, c0, nw, affine, y + t * ldy, ldy);
        for (; t < T; t++) gemm_q8_sdot_block(K, xu + t * K, xds + t * nd, 1, tile, bv, c0, nw, affine, y + t * ldy, ldy);
    }
}

/* Two rows of x (the second is the first again, and not stored, when `two` is 0) against tile
 * columns c0 .. c0+15: per 8 values of a block, smmla multiplies the rows' bytes by those of a pair of
 * columns, the interleave of the tile's 4-byte groups s and s + 1 (as packed_isums_smmla) */
TARGET_I8MM static ALWAYS_INLINE void gemm_q8_smmla_pair(int64_t K, const uint8_t *xu, const float *xds, const int two,
                                                        const uint8_t *tile, int64_t bv, int64_t c0, int64_t nw,
                                                        int affine, float *y, int64_t ldy) {
    const int64_t nd = K / 16;
    const uint8_t *xu1 = two ? xu + K : xu;
    float32x4_t acc[2][4];
    for (int t = 0; t < 2; t++)
        for (int j = 0; j < 4; j++) acc[t][j] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < K / bv; b++) {
        const uint8_t *rec = tile + b * KVREF_Q8_TILE_RECORD(bv);
        int32x4_t mm[4][2];
        for (int j = 0; j < 4; j++) mm[j][0] = mm[j][1] = vdupq_n_s32(0);
        for (int64_t c = 0; c < bv / 8; c++) {
            const uint8x16_t xb = vcombine_u8(vld1_u8(xu + b * bv + 8 * c), vld1_u8(xu1 + b * bv + 8 * c));
            const int8x16_t xv = vreinterpretq_s8_u8(veorq_u8(xb, vdupq_n_u8(0x80)));
            for (int j = 0; j < 4; j++) {
                const int8_t *g = (const int8_t *)rec + 2 * c * 4 * KVREF_TILE_N + 4 * (c0 + 4 * j);
                const int32x4_t lo = vreinterpretq_s32_s8(vld1q_s8(g)), hi = vreinterpretq_s32_s8(vld1q_s8(g + 4 * KVREF_TILE_N));
                mm[j][0] = vmmlaq_s32(mm[j][0], xv, vreinterpretq_s8_s32(vzip1q_s32(lo, hi)));
                mm[j][1] = vmmlaq_s32(mm[j][1], xv, vreinterpretq_s8_s32(vzip2q_s32(lo, hi)));
            }
        }
        int32x4_t isum[2][4];
        for (int j = 0; j < 4; j++) {
            const int64x2_t m0 = vreinterpretq_s64_s32(mm[j][0]), m1 = vreinterpretq_s64_s32(mm[j][1]);
            isum[0][j] = vreinterpretq_s32_s64(vzip1q_s64(m0, m1));
            isum[1][j] = vreinterpretq_s32_s64(vzip2q_s64(m0, m1));
        }
        for (int t = 0; t < 1 + two; t++) {
            const float *xd = xds + t * nd + b * bv / 32 * 2;
            gemm_q8_update(acc[t], isum[t], rec, bv, c0, xd[0], xd[1], affine);
        }
    }
    for (int t = 0; t < 1 + two; t++) store_cols(acc[t], nw - c0, y + t * ldy + c0);
}

TARGET_I8MM static void gemm_q8_i8mm(int64_t K, const uint8_t *xu, const float *xds, int64_t T, const uint8_t *tile,
                                     int64_t bv, int64_t nw, int affine, float *y, int64_t ldy) {
    const int64_t nd = K / 16;
    for (int64_t c0 = 0; c0 < nw; c0 += 16)
        for (int64_t t = 0; t < T; t += 2) {
            if (t + 1 < T) gemm_q8_smmla_pair(K, xu + t * K, xds + t * nd, 1, tile, bv, c0, nw, affine, y + t * ldy, ldy);
            else gemm_q8_smmla_pair(K, xu + t * K, xds + t * nd, 0, tile, bv, c0, nw, affine, y + t * ldy, ldy);
        }
}

TARGET_DOT static void attn_score_dotprod(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p) {
    attn_score_with(a, c, p, i8_dot_sdot);
}

TARGET_DOT static void packed_dot_dotprod(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs,
                                          const float *ds, const int32_t *xsum, int64_t T, float *out) {
    packed_dot_with(type, K, group, qs, ds, xsum, T, out, packed_isums_sdot);
}

TARGET_I8MM static void packed_dot_i8mm(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs,
                                        const float *ds, const int32_t *xsum, int64_t T, float *out) {
    packed_dot_with(type, K, group, qs, ds, xsum, T, out, packed_isums_smmla);
}

#endif /* KVREF_NEON_DOT */

/* ---- the tables ------------------------------------------------------------------------------ */

const kvref_kernels kvref_kernels_neon = {
    .isa = KVREF_ISA_NEON,
    KVREF_SIMD_TABLE_COMMON,
    .attn = {.score = attn_score, .exp = attn_exp, .values = attn_values, .i8_lanes = 8, .kivi_lanes = 16},
    .packed_dot = packed_dot,
};

#if KVREF_NEON_DOT
const kvref_kernels kvref_kernels_neon_dotprod = {
    .isa = KVREF_ISA_NEON_DOTPROD,
    KVREF_SIMD_TABLE_COMMON,
    .attn = {.score = attn_score_dotprod, .exp = attn_exp, .values = attn_values, .i8_lanes = 8, .kivi_lanes = 16},
    .packed_dot = packed_dot_dotprod,
    .gemm_q8 = gemm_q8_dotprod,
};

const kvref_kernels kvref_kernels_neon_i8mm = {
    .isa = KVREF_ISA_NEON_I8MM,
    KVREF_SIMD_TABLE_COMMON,
    .attn = {.score = attn_score_dotprod, .exp = attn_exp, .values = attn_values, .i8_lanes = 8, .kivi_lanes = 16},
    .packed_dot = packed_dot_i8mm,
    .gemm_q8 = gemm_q8_i8mm,
};
#endif

#endif /* KVREF_NEON */
