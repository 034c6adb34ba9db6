/* kernels_avx2.c: the KVREF_ISA_AVX2 kernel table (AVX2 + FMA + F16C, 8 float lanes).
 *
 * Same algorithms and the same per-value rounding as kernels_avx512.c; tails shorter than a
 * vector run the plain scalar loop. Quantized values are converted lane by lane
 * (integer -> float, then the block's fma/mul), which rounds them exactly as the NumPy
 * dequantizer does.
 */
#include "internal.h"

#if KVREF_X86

#include <immintrin.h>
#include <math.h>

#define TARGET __attribute__((target("avx2,fma,f16c")))

TARGET static inline float fp16_load(const uint8_t *p) { return _cvtsh_ss(kvref_load_u16(p)); }

TARGET static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

TARGET static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

TARGET static inline float load_f32(const uint8_t *p) { float f; memcpy(&f, p, 4); return f; }

/* 8 bytes -> 8 int32 lanes */
TARGET static inline __m256i bytes8_u(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
TARGET static inline __m256i bytes8_s(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

/* ---- dot kernels, written once for R rows of x ------------------------------------------------
 *
 * As in kernels_avx512.c: dot_<type>(K, w, x, R, out, ldo) sets out[r * ldo] to the dot of the weight
 * row w with row r of x [R, K]; R is a constant once inlined, each row has its own accumulators and
 * the operations of R = 1, so a row's result does not depend on R, and the rows share the weight
 * loads and decoding. */
#define ROWS_MAX 4
#define ALWAYS_INLINE __attribute__((always_inline)) inline

/* acc[r][j] = fma(v, x[r * K + i], acc[r][j]) for the R rows */
#define FMA_ROWS(acc, j, v, x, i)                                                                        \
    for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(v, _mm256_loadu_ps((x) + r * K + (i)), acc[r][j])

#define ZERO_ROWS(acc, n)                                                                                \
    for (int r = 0; r < R; r++)                                                                          \
        for (int j = 0; j < (n); j++) acc[r][j] = _mm256_setzero_ps()

/* ---- float rows ---------------------------------------------------------------------------- */

TARGET static ALWAYS_INLINE void dot_f32(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    const float *wf = (const float *)(const void *)w;
    __m256 a[ROWS_MAX][4];
    ZERO_ROWS(a, 4);
    int64_t i = 0;
    for (; i + 32 <= K; i += 32)
        for (int j = 0; j < 4; j++) {
            const __m256 v = _mm256_loadu_ps(wf + i + 8 * j);
            FMA_ROWS(a, j, v, x, i + 8 * j);
        }
    for (; i + 8 <= K; i += 8) {
        const __m256 v = _mm256_loadu_ps(wf + i);
        FMA_ROWS(a, 0, v, x, i);
    }
    for (int r = 0; r < R; r++) {
        float acc = hsum8(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
        for (int64_t k = i; k < K; k++) acc += load_f32(w + 4 * k) * x[r * K + k];
        out[r * ldo] = acc;
    }
}

/* 8 half-precision weights at p: float16, or bfloat16 with bf16 */
TARGET static ALWAYS_INLINE __m256 half8(const uint8_t *p, const int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}

TARGET static ALWAYS_INLINE void dot_half(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo,
                                          const int bf16) {
    __m256 a[ROWS_MAX][2];
    ZERO_ROWS(a, 2);
    int64_t i = 0;
    for (; i + 16 <= K; i += 16) {
        const __m256 v0 = half8(w + 2 * i, bf16), v1 = half8(w + 2 * i + 16, bf16);
        FMA_ROWS(a, 0, v0, x, i);
        FMA_ROWS(a, 1, v1, x, i + 8);
    }
    for (int r = 0; r < R; r++) {
        float acc = hsum8(_mm256_add_ps(a[r][0], a[r][1]));
        for (int64_t k = i; k < K; k++)
            acc += (bf16 ? kvref_bf16_to_fp32(kvref_load_u16(w + 2 * k)) : fp16_load(w + 2 * k)) * x[r * K + k];
        out[r * ldo] = acc;
    }
}

TARGET static ALWAYS_INLINE void dot_f16(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    dot_half(K, w, x, R, out, ldo, 0);
}

TARGET static ALWAYS_INLINE void dot_bf16(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    dot_half(K, w, x, R, out, ldo, 1);
}

TARGET static ALWAYS_INLINE void store_sum2(const int R, __m256 acc[][2], float *out, int64_t ldo) {
    for (int r = 0; r < R; r++) out[r * ldo] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1]));
}

/* ---- 32-value blocks: two 8-byte halves of qs, low and high nibbles ------------------------ */

TARGET static ALWAYS_INLINE void dot_q4_0(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    const __m256i low4 = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
    __m256 a[ROWS_MAX][2];
    ZERO_ROWS(a, 2);
    for (int64_t b = 0; b < K / QK4_0; b++, w += BYTES_Q4_0, x += QK4_0) {
        const __m256 d = _mm256_set1_ps(fp16_load(w));
        for (int h = 0; h < 2; h++) {
            const __m256i q = bytes8_u(w + 2 + 8 * h);
            const __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q, low4), eight)), d);
            const __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q, 4), eight)), d);
            FMA_ROWS(a, 0, lo, x, 8 * h);
            FMA_ROWS(a, 1, hi, x, 16 + 8 * h);
        }
    }
    store_sum2(R, a, out, ldo);
}

/* MXFP4: each nibble looks its (doubled) E2M1 value up in a 16-byte table (pshufb), widened to float and
 * scaled by the block's 2**(e - 128): exact, as the spec's values */
TARGET static ALWAYS_INLINE void dot_mxfp4(int64_t K, const uint8_t *w, const float *x, const int R, float *out,
                                           int64_t ldo) {
    const __m128i table = _mm_loadu_si128((const __m128i *)(const void *)kvref_mxfp4_values), low4 = _mm_set1_epi8(0xF);
    __m256 a[ROWS_MAX][2];
    ZERO_ROWS(a, 2);
    for (int64_t b = 0; b < K / 32; b++, w += BYTES_MXFP4, x += 32) {
        const __m256 d = _mm256_set1_ps(kvref_e8m0_half(w[0]));
        const __m128i qs = _mm_loadu_si128((const __m128i *)(const void *)(w + 1));
        const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(qs, low4));  /* values 0..15 */
        const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(qs, 4), low4));  /* 16..31 */
        for (int h = 0; h < 2; h++) {
            const __m256 vlo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(lo, 8) : lo)), d);
            const __m256 vhi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(hi, 8) : hi)), d);
            FMA_ROWS(a, 0, vlo, x, 8 * h);
            FMA_ROWS(a, 1, vhi, x, 16 + 8 * h);
        }
    }
    store_sum2(R, a, out, ldo);
}

TARGET static ALWAYS_INLINE void dot_q4_1(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    const __m256i low4 = _mm256_set1_epi32(0xF);
    __m256 a[ROWS_MAX][2];
    ZERO_ROWS(a, 2);
    for (int64_t b = 0; b < K / QK4_1; b++, w += BYTES_Q4_1, x += QK4_1) {
        const __m256 d = _mm256_set1_ps(fp16_load(w)), m = _mm256_set1_ps(fp16_load(w + 2));
        for (int h = 0; h < 2; h++) {
            const __m256i q = bytes8_u(w + 4 + 8 * h);
            const __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, low4)), d, m);
            const __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d, m);
            FMA_ROWS(a, 0, lo, x, 8 * h);
            FMA_ROWS(a, 1, hi, x, 16 + 8 * h);
        }
    }
    store_sum2(R, a, out, ldo);
}

/* Q5_0: the Q4_0 nibbles, each with its fifth bit from qh (a variable shift per lane) */
TARGET static ALWAYS_INLINE void dot_q5_0(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    const __m256i low4 = _mm256_set1_epi32(0xF), one = _mm256_set1_epi32(1), sixteen = _mm256_set1_epi32(16);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 a[ROWS_MAX][2];
    ZERO_ROWS(a, 2);
    for (int64_t b = 0; b < K / 32; b++, w += BYTES_Q5_0, x += 32) {
        const __m256 d = _mm256_set1_ps(fp16_load(w));
        const __m256i qh = _mm256_set1_epi32((int)kvref_q5_high_bits(w));
        for (int h = 0; h < 2; h++) {
            const __m256i q = bytes8_u(w + 6 + 8 * h);
            const __m256i hlo = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(qh, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * h))), one), 4);
            const __m256i hhi = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(qh, _mm256_add_epi32(lane, _mm256_set1_epi32(16 + 8 * h))), one), 4);
            const __m256i qlo = _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(q, low4), hlo), sixteen);
            const __m256i qhi = _mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(q, 4), hhi), sixteen);
            const __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(qlo), d), hi = _mm256_mul_ps(_mm256_cvtepi32_ps(qhi), d);
            FMA_ROWS(a, 0, lo, x, 8 * h);
            FMA_ROWS(a, 1, hi, x, 16 + 8 * h);
        }
    }
    store_sum2(R, a, out, ldo);
}

TARGET static ALWAYS_INLINE void dot_q8_0(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    __m256 a[ROWS_MAX][2];
    ZERO_ROWS(a, 2);
    for (int64_t b = 0; b < K / QK8_0; b++, w += BYTES_Q8_0, x += QK8_0) {
        const __m256 d = _mm256_set1_ps(fp16_load(w));
        for (int h = 0; h < 4; h += 2) {
            const __m256 v0 = _mm256_mul_ps(_mm256_cvtepi32_ps(bytes8_s(w + 2 + 8 * h)), d);
            const __m256 v1 = _mm256_mul_ps(_mm256_cvtepi32_ps(bytes8_s(w + 10 + 8 * h)), d);
            FMA_ROWS(a, 0, v0, x, 8 * h);
            FMA_ROWS(a, 1, v1, x, 8 * h + 8);
        }
    }
    store_sum2(R, a, out, ldo);
}

/* dm[j] = d * sc_j and dm[8 + j] = -(dmin * m_j) for the eight sub-blocks j of the Q4_K super-block w
 * (both products exact): each sub-block's scale and min are then two broadcast loads */
TARGET static inline void q4_k_scales(const uint8_t *w, float dm[16]) {
    uint8_t sm[16];
    kvref_q4k_scales_mins(w + 4, sm);
    _mm256_storeu_ps(dm, _mm256_mul_ps(_mm256_cvtepi32_ps(bytes8_u(sm)), _mm256_set1_ps(fp16_load(w))));
    _mm256_storeu_ps(dm + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(bytes8_u(sm + 8)), _mm256_set1_ps(-fp16_load(w + 2))));
}

TARGET static ALWAYS_INLINE void dot_q4_k(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    const __m256i low4 = _mm256_set1_epi32(0xF);
    float dm[16];
    __m256 a[ROWS_MAX][2];
    ZERO_ROWS(a, 2);
    for (int64_t b = 0; b < K / QK_K; b++, w += BYTES_Q4_K, x += QK_K) {
        const uint8_t *qs = w + 16;
        q4_k_scales(w, dm);
        for (int c = 0; c < 4; c++) {
            const __m256 d0 = _mm256_set1_ps(dm[2 * c]), n0 = _mm256_set1_ps(dm[8 + 2 * c]);
            const __m256 d1 = _mm256_set1_ps(dm[2 * c + 1]), n1 = _mm256_set1_ps(dm[8 + 2 * c + 1]);
            for (int g = 0; g < 4; g++) {
                const __m256i q = bytes8_u(qs + 32 * c + 8 * g);
                const __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, low4)), d0, n0);
                const __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d1, n1);
                FMA_ROWS(a, 0, lo, x, 64 * c + 8 * g);
                FMA_ROWS(a, 1, hi, x, 64 * c + 32 + 8 * g);
            }
        }
    }
    store_sum2(R, a, out, ldo);
}

/* q[i] = q_i - 32 for the 256 values of the Q6_K super-block w, in order, as int8 (kernels_avx512.c's
 * q6_k_bytes, 32 values a vector): value 128 h + 32 r + l is ql's nibble with bits 2r+1:2r of
 * qh[32 h + l] shifted into bits 5:4 (per 16-bit word: a byte's neighbour lands outside them) */
TARGET static inline void q6_k_bytes(const uint8_t *w, int8_t q[QK_K]) {
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
        const __m256i la = _mm256_loadu_si256((const __m256i *)(const void *)(w + 64 * h));
        const __m256i lb = _mm256_loadu_si256((const __m256i *)(const void *)(w + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(const void *)(w + 128 + 32 * h));
        const __m256i v[4] = {
            _mm256_or_si256(_mm256_and_si256(la, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top)),
            _mm256_or_si256(_mm256_and_si256(lb, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), low), _mm256_and_si256(qh, top)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), low), _mm256_and_si256(_mm256_srli_epi16(qh, 2), top)),
        };
        for (int r = 0; r < 4; r++) _mm256_storeu_si256((__m256i *)(void *)(q + 128 * h + 32 * r), _mm256_sub_epi8(v[r], off));
    }
}

/* Decoded to int8 first, then 8 values at a time (d * scale) * (q - 32), the first product exact,
 * one rounding as NumPy's. Values 8i.. go to accumulator i / 4 % 4: the 32-value runs of the
 * super-block's layout, each accumulator's in the order of the layout's halves. */
TARGET static ALWAYS_INLINE void dot_q6_k(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    _Alignas(32) int8_t q[QK_K];
    float ds[16];
    __m256 a[ROWS_MAX][4];
    ZERO_ROWS(a, 4);
    for (int64_t b = 0; b < K / QK_K; b++, w += BYTES_Q6_K, x += QK_K) {
        const __m256 d = _mm256_set1_ps(fp16_load(w + 208));
        q6_k_bytes(w, q);
        for (int h = 0; h < 2; h++) /* exact: an 11-bit by an 8-bit integer */
            _mm256_storeu_ps(ds + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(bytes8_s(w + 192 + 8 * h)), d));
        for (int i = 0; i < QK_K / 8; i++) {
            const __m256 wv = _mm256_mul_ps(_mm256_cvtepi32_ps(bytes8_s((const uint8_t *)q + 8 * i)), _mm256_set1_ps(ds[i / 2]));
            FMA_ROWS(a, i / 4 % 4, wv, x, 8 * i);
        }
    }
    for (int r = 0; r < R; r++)
        out[r * ldo] = hsum8(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
}

/* sixteen registers: two accumulators a row, four rows of x per block; four, two */
KVREF_DOT_KERNELS(f32, 2)
KVREF_DOT_KERNELS(f16, 4)
KVREF_DOT_KERNELS(bf16, 4)
KVREF_DOT_KERNELS(q4_0, 4)
KVREF_DOT_KERNELS(q4_1, 4)
KVREF_DOT_KERNELS(q5_0, 4)
KVREF_DOT_KERNELS(q8_0, 4)
KVREF_DOT_KERNELS(q4_k, 4)
KVREF_DOT_KERNELS(q6_k, 2)
KVREF_DOT_KERNELS(mxfp4, 4)


/* ---- tiles: the scalar dequantizers (already exact); the GEMM is where the time goes ------- */

TARGET static void dequant_f16(int64_t K, const uint8_t *w, float *out) {
    int64_t i = 0;
    for (; i + 8 <= K; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * i))));
    for (; i < K; i++) out[i] = fp16_load(w + 2 * i);
}

#define GENERIC_DEQUANT(name, type) \
    TARGET static void name(int64_t K, const uint8_t *w, float *out) { kvref_dequant_row(type, K, w, out); }
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

_Static_assert(KVREF_TILE_N == 32, "a tile row is four AVX2 vectors, two per half");
#define GEMM_ROWS 6 /* rows of x per block: 12 accumulators, 2 tile vectors and a broadcast of 16 */

/* y[i, h + j] for the R rows of x at x (row stride K), half h (0 or 16) of the tile and j < the
 * masks' lanes: as kernels_avx512.c's gemm_block, one fused multiply-add per k in k order for every
 * output whatever R. */
TARGET static inline __attribute__((always_inline)) void gemm_block(int64_t K, const float *x, const int R,
                                                                    const float *tile, __m256i m0, __m256i m1,
                                                                    float *y, int64_t ldy) {
    __m256 acc[GEMM_ROWS][2];
    for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 w0 = _mm256_load_ps(tile + k * KVREF_TILE_N), w1 = _mm256_load_ps(tile + k * KVREF_TILE_N + 8);
        for (int i = 0; i < R; i++) {
            const __m256 xv = _mm256_broadcast_ss(x + i * K + k);
            acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
        }
    }
    for (int i = 0; i < R; i++) {
        _mm256_maskstore_ps(y + i * ldy, m0, acc[i][0]);
        _mm256_maskstore_ps(y + i * ldy + 8, m1, acc[i][1]);
    }
}

/* lanes j of a maskstore mask are set for j < n */
TARGET static inline __m256i lane_mask(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* r[j] = column j of the 8 x 8 block whose rows are r[0..7] */
TARGET static inline void transpose8(__m256 r[8]) {
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
        t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
}

TARGET static void tile_columns(int64_t K, const float *rows, float *tile) {
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
        for (int h = 0; h < 16; h += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(rows + (h + i) * K + k);
            transpose8(r);
            for (int j = 0; j < 8; j++) _mm256_store_ps(tile + (k + j) * KVREF_TILE_N + h, r[j]);
        }
    for (; k < K; k++)
        for (int64_t i = 0; i < 16; i++) tile[k * KVREF_TILE_N + i] = rows[i * K + k];
}

TARGET static void gemm_f32(int64_t K, const float *x, int64_t T, const float *tile, int64_t nw, float *y, int64_t ldy) {
    for (int64_t h = 0; h < nw; h += 16) {
        const __m256i m0 = lane_mask(nw - h), m1 = lane_mask(nw - h - 8);
        const float *half = tile + h;
        float *yh = y + h;
        int64_t t = 0;
        for (; t + GEMM_ROWS <= T; t += GEMM_ROWS) gemm_block(K, x + t * K, GEMM_ROWS, half, m0, m1, yh + t * ldy, ldy);
        for (; t + 2 <= T; t += 2) gemm_block(K, x + t * K, 2, half, m0, m1, yh + t * ldy, ldy);
        for (; t < T; t++) gemm_block(K, x + t * K, 1, half, m0, m1, yh + t * ldy, ldy);
    }
}

/* ---- the read-bandwidth probe: eight 32-byte loads per step, as in kernels_avx512.c ---------- */

TARGET static uint64_t read_sum(const uint8_t *p, int64_t n) {
    __m256i a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_si256();
    for (int64_t i = 0; i < n; i += 256)
        for (int j = 0; j < 8; j++) a[j] = _mm256_add_epi64(a[j], _mm256_load_si256((const __m256i *)(const void *)(p + i + 32 * j)));
    for (int j = 1; j < 8; j++) a[0] = _mm256_add_epi64(a[0], a[j]);
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)(void *)lanes, a[0]);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

/* ---- exp (Cephes expf, as in kernels_avx512.c), SwiGLU and GeGLU ----------------------------------------------- */

TARGET static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), _mm256_max_ps(_mm256_set1_ps(-88.3762626647949f), x));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

TARGET static inline __m256 swiglu8(__m256 g, __m256 u) {
    const __m256 sig = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    return _mm256_mul_ps(sig, u);
}

/* gelu_tanh(g) * u as g / (1 + exp(-2y)) * u, y rounded as the spec rounds it (kernels_avx512.c) */
TARGET static inline __m256 geglu8(__m256 g, __m256 u) {
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(KVREF_GELU_K), g), g), g);
    const __m256 y = _mm256_mul_ps(_mm256_set1_ps(KVREF_GELU_C), _mm256_add_ps(g, cube));
    const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), y));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* gpt-oss's clamped SwiGLU; min/max return their second operand when either is NaN, so the
 * clamps (the limit first) keep a NaN a NaN */
TARGET static inline __m256 swiglu_oai8(__m256 g, __m256 u) {
    const __m256 L = _mm256_set1_ps(KVREF_SWIGLU_OAI_LIMIT), one = _mm256_set1_ps(1.0f);
    g = _mm256_min_ps(L, g);
    u = _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), L), _mm256_min_ps(L, u));
    const __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-KVREF_SWIGLU_OAI_ALPHA), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_add_ps(u, one));
}

/* The tail goes through the same vector code (via a padded copy), so each element's value does not
 * depend on where it sits: the fused forward applies SwiGLU to row ranges, the single kernel to a
 * whole [T, F] array, and both must agree bit for bit. */
TARGET __attribute__((always_inline)) static inline void glu8(int64_t n, const float *gate, const float *up, float *out,
                                                               const int kind) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i);
        _mm256_storeu_ps(out + i, kind == 1 ? geglu8(g, u) : kind == 2 ? swiglu_oai8(g, u) : swiglu8(g, u));
    }
    if (i < n) {
        float g[8] = {0}, u[8] = {0}, o[8];
        memcpy(g, gate + i, (size_t)(n - i) * sizeof(float));
        memcpy(u, up + i, (size_t)(n - i) * sizeof(float));
        const __m256 gv = _mm256_loadu_ps(g), uv = _mm256_loadu_ps(u);
        _mm256_storeu_ps(o, kind == 1 ? geglu8(gv, uv) : kind == 2 ? swiglu_oai8(gv, uv) : swiglu8(gv, uv));
        memcpy(out + i, o, (size_t)(n - i) * sizeof(float));
    }
}

TARGET static void swiglu(int64_t n, const float *gate, const float *up, float *out) { glu8(n, gate, up, out, 0); }
TARGET static void geglu(int64_t n, const float *gate, const float *up, float *out) { glu8(n, gate, up, out, 1); }
TARGET static void swiglu_oai(int64_t n, const float *gate, const float *up, float *out) { glu8(n, gate, up, out, 2); }

/* ---- attention chunk kernels (the skeleton that runs them: csrc/attention.c) -------------- */

/* 8 K/V values at element e of a chunk's K or V, as float32: F16 and BF16 widened, I8 times its
 * group's `scale` (these kernels take I8 only when 8 | group_size, their i8_lanes: a vector never
 * spans two groups) */
TARGET static inline __m256 load_kv8(const uint8_t *base, int32_t type, int64_t e, float scale) {
    switch (type) {
    case KVREF_TYPE_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(base + 2 * e)));
    case KVREF_TYPE_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(base + 2 * e))), 16));
    case KVREF_TYPE_I8: return _mm256_mul_ps(_mm256_cvtepi32_ps(bytes8_s(base + e)), _mm256_set1_ps(scale));
    default: return _mm256_loadu_ps((const float *)(const void *)base + e);
    }
}

/* one value of a float type (the tail of a head dim that is not a multiple of 8; never I8) */
TARGET static inline float load_kv1(const uint8_t *base, int32_t type, int64_t e) {
    switch (type) {
    case KVREF_TYPE_F16: return fp16_load(base + 2 * e);
    case KVREF_TYPE_BF16: return kvref_bf16_to_fp32(kvref_load_u16(base + 2 * e));
    default: return load_f32(base + 4 * e);
    }
}

/* Scores of 4 keys (K vectors at kb + row[0..4)) for the gb <= 3 heads q[0..gb) of the group (float
 * K types): each K vector is loaded (and widened) once for all gb heads, into 4 x gb independent
 * accumulators; two rounds of hadd give each head's 4 sums, to which the head dim's last D % 8
 * products are added one by one. */
TARGET __attribute__((always_inline)) static inline void score4(
    const kvref_attn_args *a, const float *q, const uint8_t *kb, const int64_t *row, float *p,
    const int32_t k_type, const int gb) {
    const int64_t D = a->D, C = KVREF_ATTN_CHUNK, Dv = D / 8 * 8;
    __m256 d[3][4];
    for (int g = 0; g < gb; g++)
        for (int r = 0; r < 4; r++) d[g][r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < Dv; i += 8) {
        __m256 qv[3];
        for (int g = 0; g < gb; g++) qv[g] = _mm256_loadu_ps(q + g * D + i);
        for (int r = 0; r < 4; r++) {
            const __m256 kv = load_kv8(kb, k_type, row[r] + i, 0.0f);
            for (int g = 0; g < gb; g++) d[g][r] = _mm256_fmadd_ps(qv[g], kv, d[g][r]);
        }
    }
    for (int g = 0; g < gb; g++) {
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(d[g][0], d[g][1]), _mm256_hadd_ps(d[g][2], d[g][3]));
        float dots[4];
        _mm_storeu_ps(dots, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
        for (int r = 0; r < 4; r++) {
            for (int64_t t = Dv; t < D; t++) dots[r] += q[g * D + t] * load_kv1(kb, k_type, row[r] + t);
            p[g * C + r] = kvref_attn_score_value(dots[r] * a->scale);
        }
    }
}

/* p[g * C + s] = (q_g . k_s) * scale for the chunk's keys (float K types), 4 at a time for up to 3
 * heads, the last n % 4 keys one by one; masked keys are scored like the rest (cheaper than testing
 * each key; the skeleton hides them). Every 8 keys, asks for the K and V of the keys a chunk ahead. */
TARGET __attribute__((always_inline)) static inline void score_typed(
    const kvref_attn_args *a, const kvref_attn_chunk *c, float *p, const int32_t k_type) {
    const float *q = c->q;
    const uint8_t *kb = c->k;
    const int64_t *row = c->row;
    const int64_t n = c->n, nrows = c->nrows;
    const int64_t G = a->G, D = a->D, C = KVREF_ATTN_CHUNK, Dv = D / 8 * 8;
    int64_t s = 0;
    for (; s + 4 <= n; s += 4) {
        if (s % 8 == 0) {
            kvref_attn_prefetch(kb, a->k_type, D, row, s + KVREF_ATTN_PREFETCH_KEYS, nrows);
            kvref_attn_prefetch(c->v, a->v_type, D, row, s + KVREF_ATTN_PREFETCH_KEYS, nrows);
        }
        for (int64_t g0 = 0; g0 < G; g0 += 3) {
            const float *qg = q + g0 * D;
            float *pg = p + g0 * C + s;
            switch (G - g0) {
            case 1: score4(a, qg, kb, row + s, pg, k_type, 1); break;
            case 2: score4(a, qg, kb, row + s, pg, k_type, 2); break;
            default: score4(a, qg, kb, row + s, pg, k_type, 3);
            }
        }
    }
    for (; s < n; s++)
        for (int64_t g = 0; g < G; g++) {
            __m256 d = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i < Dv; i += 8) d = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i), load_kv8(kb, k_type, row[s] + i, 0.0f), d);
            float dot = hsum8(d);
            for (; i < D; i++) dot += q[g * D + i] * load_kv1(kb, k_type, row[s] + i);
            p[g * C + s] = kvref_attn_score_value(dot * a->scale);
        }
}

/* acc[g] += p[g] V over the chunk's n keys for the gb <= 3 heads p[0..gb), acc[0..gb) of the group,
 * one 8-wide slice of the head dim at a time: each V vector is loaded (and widened) once for all gb
 * heads, `keys` keys per step so that 4 to 6 FMA chains are in flight. Masked keys never touch acc. */
TARGET __attribute__((always_inline)) static inline void pv_block(
    const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc, const int32_t v_type, const int gb) {
#define load_v(s) load_kv8(vb, v_type, row[s] + i, v_type == KVREF_TYPE_I8 ? vs[srow[s] + jg] : 0.0f)
    const uint8_t *vb = c->v;
    const float *vs = c->v_scales;
    const int64_t *row = c->row, *srow = c->srow;
    const int64_t n = c->n;
    const int all = c->all;
    const int64_t D = a->Dv, C = KVREF_ATTN_CHUNK, Dv = D / 8 * 8; /* D: the values' width here */
    const int keys = gb == 1 ? 4 : 2;
    for (int64_t i = 0; i < Dv; i += 8) {
        const int64_t jg = v_type == KVREF_TYPE_I8 ? i / a->group_size : 0;
        __m256 ac[4][3];
        for (int k = 0; k < keys; k++)
            for (int g = 0; g < gb; g++) ac[k][g] = k == 0 ? _mm256_loadu_ps(acc + g * D + i) : _mm256_setzero_ps();
        int64_t s = 0;
        if (all)
            for (; s + keys <= n; s += keys)
                for (int k = 0; k < keys; k++) {
                    const __m256 v = load_v(s + k);
                    for (int g = 0; g < gb; g++) ac[k][g] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * C + s + k]), v, ac[k][g]);
                }
        for (; s < n; s++) {
            if (!all && kvref_attn_hidden(c, s)) continue;
            const __m256 v = load_v(s);
            for (int g = 0; g < gb; g++) ac[0][g] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * C + s]), v, ac[0][g]);
        }
        for (int g = 0; g < gb; g++) {
            __m256 sum = ac[0][g];
            for (int k = 1; k < keys; k++) sum = _mm256_add_ps(sum, ac[k][g]);
            _mm256_storeu_ps(acc + g * D + i, sum);
        }
    }
    for (int64_t i = Dv; i < D; i++) /* the head dim's last D % 8 elements (float types only) */
        for (int g = 0; g < gb; g++) {
            float av = acc[g * D + i];
            for (int64_t s = 0; s < n; s++) {
                if (!all && kvref_attn_hidden(c, s)) continue;
                av += p[g * C + s] * load_kv1(vb, v_type, row[s] + i);
            }
            acc[g * D + i] = av;
        }
#undef load_v
}

TARGET __attribute__((always_inline)) static inline void pv_typed(
    const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc, const int32_t v_type) {
    const int64_t D = a->Dv, C = KVREF_ATTN_CHUNK; /* acc [G, Dv] */
    for (int64_t g0 = 0; g0 < a->G; g0 += 3) {
        const float *pg = p + g0 * C;
        float *ag = acc + g0 * D;
        switch (a->G - g0) {
        case 1: pv_block(a, c, pg, ag, v_type, 1); break;
        case 2: pv_block(a, c, pg, ag, v_type, 2); break;
        default: pv_block(a, c, pg, ag, v_type, 3);
        }
    }
}

/* r[m] = dword m of the 8 rows r[0..8) in lane k (row k): an 8 x 8 transpose of 32-bit lanes, in
 * pairs, quads, then 128-bit halves */
TARGET static inline void transpose8x8_epi32(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++) {
            u[4 * i + 2 * h] = _mm256_unpacklo_epi64(t[4 * i + h], t[4 * i + 2 + h]);
            u[4 * i + 2 * h + 1] = _mm256_unpackhi_epi64(t[4 * i + h], t[4 * i + 2 + h]);
        }
    for (int m = 0; m < 4; m++) {
        r[m] = _mm256_permute2x128_si256(u[m], u[4 + m], 0x20);
        r[4 + m] = _mm256_permute2x128_si256(u[m], u[4 + m], 0x31);
    }
}

/* Scores of the nk <= 8 keys s .. s + nk - 1 for heads g0 .. g0 + gb - 1 (gb <= 3), key k in lane k.
 * K is read 32 bytes of eight keys at a time and transposed, so that vector m holds each key's
 * dword m; against the head's dword m of q8, broadcast, maddubs and madd sum its four products in
 * the key's lane (maddubs multiplies unsigned by signed bytes, so |k| meets q with k's sign, and a
 * pair of products, at most 2 x 128 x 127, fits int16). The dwords of a scale group add up to its
 * exact integer dot I_b, then the float32 operations of kvref_attn_score_i8_ref, in its order, on 8
 * keys at once. No horizontal sum per key and head, as a key-by-key kernel needs. */
TARGET __attribute__((always_inline)) static inline void score8_i8(
    const kvref_attn_args *a, const kvref_attn_chunk *c, int64_t s, int64_t nk, int64_t g0, const int gb, float *p) {
    const int64_t D = a->D, C = KVREF_ATTN_CHUNK, ng = D / a->group_size, per_group = a->group_size / 4;
    const int8_t *kb = (const int8_t *)c->k;
    int64_t row[8], srow[8]; /* keys past nk read key s's K and scales (their lanes are not stored) */
    for (int i = 0; i < 8; i++) {
        row[i] = c->row[s + (i < nk ? i : 0)];
        srow[i] = c->srow[s + (i < nk ? i : 0)];
    }
    __m256i gsum[3];
    __m256 score[3];
    for (int g = 0; g < gb; g++) {
        gsum[g] = _mm256_setzero_si256();
        score[g] = _mm256_setzero_ps();
    }
    int64_t b = 0, left = per_group; /* the scale group of the next dword, and its dwords left */
    for (int64_t e0 = 0; e0 < D; e0 += 32) {
        const int64_t nd = D - e0 < 32 ? (D - e0) / 4 : 8; /* dwords in this block (the group size is a multiple of 8) */
        const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)nd), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256i k[8], ka[8];
        for (int r = 0; r < 8; r++) k[r] = _mm256_maskload_epi32((const int *)(const void *)(kb + row[r] + e0), mk);
        transpose8x8_epi32(k);
        for (int m = 0; m < 8; m++) ka[m] = _mm256_abs_epi8(k[m]);
        for (int m = 0; m < 8; m++) {
            if (m >= nd) break; /* m a constant: the vectors stay in registers */
            for (int g = 0; g < gb; g++) {
                int32_t qd;
                memcpy(&qd, c->q8 + (g0 + g) * D + e0 + 4 * m, sizeof qd);
                const __m256i pairs = _mm256_maddubs_epi16(ka[m], _mm256_sign_epi8(_mm256_set1_epi32(qd), k[m]));
                gsum[g] = _mm256_add_epi32(gsum[g], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
            }
            if (--left > 0) continue;
            left = per_group;
            float kd[8];
            for (int r = 0; r < 8; r++) kd[r] = c->k_scales[srow[r] + b];
            const __m256 ks = _mm256_loadu_ps(kd);
            for (int g = 0; g < gb; g++) {
                const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(c->qe[(g0 + g) * ng + b]), ks);
                score[g] = _mm256_add_ps(score[g], _mm256_mul_ps(_mm256_cvtepi32_ps(gsum[g]), scale));
                gsum[g] = _mm256_setzero_si256();
            }
            b++;
        }
    }
    for (int g = 0; g < gb; g++) { /* kvref_attn_score_value: non-finite -> NaN */
        float out[8];
        _mm256_storeu_ps(out, _mm256_add_ps(score[g], _mm256_mul_ps(score[g], _mm256_setzero_ps())));
        for (int64_t r = 0; r < nk; r++) p[(g0 + g) * C + s + r] = out[r];
    }
}

/* An I8 K's integer scoring (internal.h): the chunk's keys 8 at a time, up to the last visible one
 * (every key's score is its own lane's, so where the cut falls changes none), heads 3 at a time;
 * every 8 keys, asks for the K and V of the keys a chunk ahead. AVX-512 CPUs without VNNI run this
 * kernel too. */
TARGET void kvref_avx2_attn_score_i8(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p) {
    int64_t n = c->n;
    while (!c->all && kvref_attn_hidden(c, n - 1)) n--; /* some key is visible */
    for (int64_t s = 0; s < n; s += 8) {
        kvref_attn_prefetch(c->k, a->k_type, a->D, c->row, s + KVREF_ATTN_PREFETCH_KEYS, c->nrows);
        kvref_attn_prefetch(c->v, a->v_type, a->D, c->row, s + KVREF_ATTN_PREFETCH_KEYS, c->nrows);
        const int64_t nk = n - s < 8 ? n - s : 8;
        for (int64_t g0 = 0; g0 < a->G; g0 += 3)
            switch (a->G - g0) {
            case 1: score8_i8(a, c, s, nk, g0, 1, p); break;
            case 2: score8_i8(a, c, s, nk, g0, 2, p); break;
            default: score8_i8(a, c, s, nk, g0, 3, p);
            }
    }
}

/* ---- KIVI4 (kvref/cache/quant.py; the skeleton hands them over when 16 divides head_dim and the
 * group size, the table's kivi_lanes: 8 nibble bytes are 16 elements of one V group) ------------
 * As the AVX-512 kernels, they work in "split order": the 16 elements of 8 nibble bytes as two
 * vectors, the even elements (low nibbles) then the odd ones, one widening and a mask or a shift
 * each; q' and the V sums are permuted into that order once per run of keys instead. */

/* The levels of nibble bytes b[0..8) in split order: even = elements 0, 2, .., 14; odd = 1, 3, .., 15 */
TARGET static inline void kivi_levels(const uint8_t *b, __m256 *even, __m256 *odd) {
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)b));
    *even = _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(15)));
    *odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));
}

/* natural order (x0 = elements 0-7, x1 = 8-15) <-> split order (even, odd): the in-lane shuffle
 * gives pairs (0, 2), (8, 10), (4, 6), (12, 14), which the quadword permute puts in order */
TARGET static inline void kivi_split(__m256 x0, __m256 x1, __m256 *even, __m256 *odd) {
    *even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(x0, x1, 0x88)), 0xD8));
    *odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(x0, x1, 0xDD)), 0xD8));
}

TARGET static inline void kivi_merge(__m256 even, __m256 odd, __m256 *x0, __m256 *x1) {
    const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
    *x0 = _mm256_permute2f128_ps(lo, hi, 0x20);
    *x1 = _mm256_permute2f128_ps(lo, hi, 0x31);
}

#define KIVI_MAX_VECTORS 32 /* D <= 256: 32 vectors of q' per head */

/* Scores of 4 keys (rows row[0..4)) of one quantized group for gb <= 3 heads: q' [gb][D / 8] in split
 * order, zero[gb] = q . zero; each key's levels widened once for the gb heads, two rounds of hadd per
 * head; the first nk scores stored. */
TARGET __attribute__((always_inline)) static inline void kivi_score4(
    const kvref_attn_args *a, const __m256 qs[3][KIVI_MAX_VECTORS], const float *zero, const uint8_t *kb,
    const int64_t *row, float *p, const int gb, int64_t nk) {
    const int64_t C = KVREF_ATTN_CHUNK, nv = a->D / 8;
    __m256 d[3][4];
    for (int g = 0; g < gb; g++)
        for (int r = 0; r < 4; r++) d[g][r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nv; j += 2)
        for (int r = 0; r < 4; r++) {
            __m256 even, odd;
            kivi_levels(kb + row[r] / 2 + 4 * j, &even, &odd);
            for (int g = 0; g < gb; g++)
                d[g][r] = _mm256_fmadd_ps(qs[g][j + 1], odd, _mm256_fmadd_ps(qs[g][j], even, d[g][r]));
        }
    for (int g = 0; g < gb; g++) {
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(d[g][0], d[g][1]), _mm256_hadd_ps(d[g][2], d[g][3]));
        __m128 sg = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        sg = _mm_mul_ps(_mm_add_ps(sg, _mm_set1_ps(zero[g])), _mm_set1_ps(a->scale));
        sg = _mm_add_ps(sg, _mm_mul_ps(sg, _mm_setzero_ps())); /* kvref_attn_score_value: non-finite -> NaN */
        float out[4];
        _mm_storeu_ps(out, sg);
        for (int64_t r = 0; r < nk; r++) p[g * C + r] = out[r];
    }
}

/* Scores of the keys s .. end-1 of a chunk, one quantized group (params [2, D]: its channels' scales,
 * then zeros), for the G heads: per block of up to 3 heads, q' = q * scale (split order) and q . zero
 * once, then 4 keys at a time (a last partial block reads its last key's row again). Every 8 keys,
 * asks for the K of the keys a chunk ahead. */
TARGET static void kivi_score_run(const kvref_attn_args *a, const kvref_attn_chunk *c, const float *params,
                                  int64_t s, int64_t end, float *p) {
    const int64_t G = a->G, D = a->D, C = KVREF_ATTN_CHUNK;
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int gb = G - g0 < 3 ? (int)(G - g0) : 3;
        __m256 qs[3][KIVI_MAX_VECTORS];
        float zero[3];
        for (int g = 0; g < gb; g++) {
            const float *q = c->q + (g0 + g) * D;
            __m256 z = _mm256_setzero_ps();
            for (int64_t j = 0; j < D / 8; j += 2) {
                const __m256 q0 = _mm256_loadu_ps(q + 8 * j), q1 = _mm256_loadu_ps(q + 8 * j + 8);
                z = _mm256_fmadd_ps(q0, _mm256_loadu_ps(params + D + 8 * j), z);
                z = _mm256_fmadd_ps(q1, _mm256_loadu_ps(params + D + 8 * j + 8), z);
                kivi_split(_mm256_mul_ps(q0, _mm256_loadu_ps(params + 8 * j)),
                           _mm256_mul_ps(q1, _mm256_loadu_ps(params + 8 * j + 8)), &qs[g][j], &qs[g][j + 1]);
            }
            zero[g] = hsum8(z);
        }
        for (int64_t t = s; t < end; t += 4) {
            if (g0 == 0 && (t - s) % 8 == 0) /* the keys a chunk ahead */
                for (int64_t r = t + KVREF_ATTN_PREFETCH_KEYS; r < t + KVREF_ATTN_PREFETCH_KEYS + 8 && r < c->nrows; r++)
                    __builtin_prefetch(c->k + c->row[r] / 2, 0, 2);
            const int64_t nk = end - t < 4 ? end - t : 4;
            int64_t row[4];
            for (int64_t r = 0; r < 4; r++) row[r] = c->row[t + (r < nk ? r : nk - 1)];
            float *pg = p + g0 * C + t;
            switch (gb) {
            case 1: kivi_score4(a, qs, zero, c->k, row, pg, 1, nk); break;
            case 2: kivi_score4(a, qs, zero, c->k, row, pg, 2, nk); break;
            default: kivi_score4(a, qs, zero, c->k, row, pg, 3, nk);
            }
        }
    }
}

/* Scores of a chunk's KIVI4 keys: runs of keys of one quantized group (kivi_score_run), and keys past
 * the last full group, float16 residual rows. Every key is scored (the skeleton hides the masked ones). */
TARGET static void score_kivi(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p) {
    const int64_t G = a->G, D = a->D, C = KVREF_ATTN_CHUNK, gs = a->group_size, HD = a->Hkv * D;
    const int64_t c0 = c->kp - a->k_positions, nq = a->S - a->S % gs, n = c->n;
    if (D / 8 > KIVI_MAX_VECTORS) {
        kvref_attn_score_kivi_ref(a, c, p);
        return;
    }
    for (int64_t s = 0; s < n;) {
        const int64_t key = c0 + s;
        if (key >= nq) { /* a residual row */
            const uint16_t *r = c->k_residual + (key % gs) * HD;
            for (int64_t g = 0; g < G; g++) {
                __m256 d = _mm256_setzero_ps();
                for (int64_t i = 0; i < D; i += 8)
                    d = _mm256_fmadd_ps(_mm256_loadu_ps(c->q + g * D + i),
                                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(r + i))), d);
                p[g * C + s] = kvref_attn_score_value(hsum8(d) * a->scale);
            }
            s++;
            continue;
        }
        const int64_t group_end = (key / gs + 1) * gs < nq ? (key / gs + 1) * gs : nq;
        const int64_t end = group_end - c0 < n ? group_end - c0 : n;
        kivi_score_run(a, c, c->k_scales + (c->row[s] / HD / gs) * a->Hkv * 2 * D, s, end, p);
        s = end;
    }
}

/* acc += p V over a chunk's KIVI4 values for heads g0 .. g0+gb-1 and the 32 elements from e0 on (16
 * when that is all the head dim has left): their sums held in registers in split order over the
 * chunk's keys, each key's V widened once (its group's scale and zero applied), added to acc at the
 * end. Every 8 keys of the first pass, asks for the V of the keys a chunk ahead. */
TARGET __attribute__((always_inline)) static inline void kivi_values_slice(
    const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc, int64_t g0, int64_t e0,
    const int gb) {
    const int64_t D = a->D, C = KVREF_ATTN_CHUNK, gs = a->group_size, np = D - e0 < 32 ? 1 : 2;
    __m256 sum[3][4];
    for (int g = 0; g < gb; g++)
        for (int j = 0; j < 4; j++) sum[g][j] = _mm256_setzero_ps();
    for (int64_t s = 0; s < c->n; s++) {
        if (g0 == 0 && e0 == 0 && s % 8 == 0)
            for (int64_t r = s + KVREF_ATTN_PREFETCH_KEYS; r < s + KVREF_ATTN_PREFETCH_KEYS + 8 && r < c->nrows; r++)
                __builtin_prefetch(c->v + c->row[r] / 2, 0, 2);
        if (!c->all && kvref_attn_hidden(c, s)) continue;
        const uint8_t *vb = c->v + c->row[s] / 2;
        const float *pairs = c->v_scales + 2 * c->srow[s]; /* [D / gs, 2] */
        __m256 pg[3];
        for (int g = 0; g < gb; g++) pg[g] = _mm256_set1_ps(p[(g0 + g) * C + s]);
        for (int64_t t = 0; t < np; t++) {
            const int64_t e = e0 + 16 * t, grp = e / gs;
            const __m256 sc = _mm256_set1_ps(pairs[2 * grp]), zr = _mm256_set1_ps(pairs[2 * grp + 1]);
            __m256 even, odd;
            kivi_levels(vb + e / 2, &even, &odd);
            even = _mm256_fmadd_ps(even, sc, zr);
            odd = _mm256_fmadd_ps(odd, sc, zr);
            for (int g = 0; g < gb; g++) {
                sum[g][2 * t] = _mm256_fmadd_ps(pg[g], even, sum[g][2 * t]);
                sum[g][2 * t + 1] = _mm256_fmadd_ps(pg[g], odd, sum[g][2 * t + 1]);
            }
        }
    }
    for (int g = 0; g < gb; g++)
        for (int64_t t = 0; t < np; t++) {
            float *ag = acc + (g0 + g) * D + e0 + 16 * t;
            __m256 x0, x1;
            kivi_merge(sum[g][2 * t], sum[g][2 * t + 1], &x0, &x1);
            _mm256_storeu_ps(ag, _mm256_add_ps(_mm256_loadu_ps(ag), x0));
            _mm256_storeu_ps(ag + 8, _mm256_add_ps(_mm256_loadu_ps(ag + 8), x1));
        }
}

/* acc += p V for a chunk's KIVI4 values, per block of up to 3 heads and 32 elements */
TARGET static void values_kivi(const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc) {
    for (int64_t g0 = 0; g0 < a->G; g0 += 3)
        for (int64_t e0 = 0; e0 < a->D; e0 += 32) switch (a->G - g0) {
            case 1: kivi_values_slice(a, c, p, acc, g0, e0, 1); break;
            case 2: kivi_values_slice(a, c, p, acc, g0, e0, 2); break;
            default: kivi_values_slice(a, c, p, acc, g0, e0, 3);
            }
}

/* One instantiation per element type: the type must be a compile-time constant, or every K/V
 * load would test it. */
TARGET static void attn_score(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p) {
    switch (a->k_type) {
    case KVREF_TYPE_KIVI4: score_kivi(a, c, p); break;
    case KVREF_TYPE_I8: kvref_avx2_attn_score_i8(a, c, p); break;
    case KVREF_TYPE_F16: score_typed(a, c, p, KVREF_TYPE_F16); break;
    case KVREF_TYPE_BF16: score_typed(a, c, p, KVREF_TYPE_BF16); break;
    default: score_typed(a, c, p, KVREF_TYPE_F32);
    }
}

TARGET static void attn_values(const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc) {
    switch (a->v_type) {
    case KVREF_TYPE_KIVI4: values_kivi(a, c, p, acc); break;
    case KVREF_TYPE_I8: pv_typed(a, c, p, acc, KVREF_TYPE_I8); break;
    case KVREF_TYPE_F16: pv_typed(a, c, p, acc, KVREF_TYPE_F16); break;
    case KVREF_TYPE_BF16: pv_typed(a, c, p, acc, KVREF_TYPE_BF16); break;
    default: pv_typed(a, c, p, acc, KVREF_TYPE_F32);
    }
}

/* each head's max and exponentials 8 keys at a time, the last n % 8 one by one (libm expf) */
TARGET static void attn_exp(int64_t G, int64_t n, const float *m, float *p, float *mnew, float *sum) {
    const int64_t nv = n / 8 * 8;
    for (int64_t g = 0; g < G; g++) {
        float *pg = p + g * KVREF_ATTN_CHUNK;
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        int64_t s = 0;
        for (; s < nv; s += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(pg + s));
        float cmax = hmax8(vmax);
        for (; s < n; s++) cmax = pg[s] > cmax ? pg[s] : cmax;
        const float mx = cmax > m[g] ? cmax : m[g];
        const __m256 vm = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (s = 0; s < nv; s += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pg + s), vm));
            _mm256_storeu_ps(pg + s, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float total = hsum8(vsum);
        for (; s < n; s++) {
            pg[s] = expf(pg[s] - mx);
            total += pg[s];
        }
        mnew[g] = mx;
        sum[g] = total;
    }
}

/* ---- 8-bit activations: integer dot products with maddubs ---------------------------------- */

/* 32 bits -> 32 bytes, byte j 16 where bit j is set, else 0 (llama.cpp's bytes_from_bits_32: each
 * byte of the bits copied to 8 lanes, then one bit tested per lane) */
TARGET static inline __m256i high_bits32(uint32_t bits) {
    const __m256i shuf = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(16));
}

/* The 8 value vectors of rows 8h .. 8h+7 of a packed record (internal.h): u[v] holds values 4v ..
 * 4v+3 of row 8h + r in lane r, unsigned, but for Q8_0 the signed q (u - 128: maddubs's unsigned
 * operand must stay below 128 for its int16 pair sums, so Q8_0's signs move onto x). */
TARGET static ALWAYS_INLINE void packed_values(int32_t type, const uint8_t *rec, int h, __m256i u[8]) {
    const uint8_t *vals = rec + kvref_pack_values_at(type) + 32 * h;
    if (type == KVREF_TYPE_Q8_0) {
        for (int v = 0; v < 8; v++)
            u[v] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(const void *)(vals + 64 * v)), _mm256_set1_epi8(-128));
        return;
    }
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(vals + 64 * j));
        u[j] = _mm256_and_si256(b, low4);
        u[j + 4] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    }
    const uint8_t *high = rec + kvref_pack_planes_at(type);
    if (type == KVREF_TYPE_Q5_0) /* bit 4 from its masks */
        for (int v = 0; v < 8; v++) {
            uint64_t mask;
            memcpy(&mask, high + 8 * v, 8);
            u[v] = _mm256_or_si256(u[v], high_bits32((uint32_t)(mask >> (32 * h))));
        }
    if (type == KVREF_TYPE_Q6_K) /* bits 4-5: field v % 4 of vector v / 4 moved to bits 4-5, or-ed in */
        for (int g = 0; g < 2; g++) {
            const __m256i f = _mm256_loadu_si256((const __m256i *)(const void *)(high + 64 * g + 32 * h));
            const __m256i at45[4] = {_mm256_slli_epi16(f, 4), _mm256_slli_epi16(f, 2), f, _mm256_srli_epi16(f, 2)};
            for (int k = 0; k < 4; k++) u[4 * g + k] = _mm256_or_si256(u[4 * g + k], _mm256_and_si256(at45[k], _mm256_set1_epi8(0x30)));
        }
}

/* One row of x's integer sums of values 0-15 (half[0]) and 16-31 (half[1]) against the 8 value
 * vectors: maddubs pairs, widened to int32 lanes. A pair reaches 2 * 31 * 127 for 4- and 5-bit u,
 * so four add up in int16, 2 * 63 * 127 for Q6_K (two), and |q| |x| <= 2 * 128 * 127 for Q8_0 (one). */
TARGET static ALWAYS_INLINE void packed_isums(int32_t type, const __m256i u[8], const int8_t *x, __m256i half[2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int group = type == KVREF_TYPE_Q8_0 ? 1 : type == KVREF_TYPE_Q6_K ? 2 : 4;
    for (int v0 = 0; v0 < 8; v0 += group) {
        __m256i pairs = _mm256_setzero_si256();
        for (int v = v0; v < v0 + group; v++) {
            int32_t x4;
            memcpy(&x4, x + 4 * v, 4);
            const __m256i xv = _mm256_set1_epi32(x4);
            pairs = _mm256_add_epi16(pairs, type == KVREF_TYPE_Q8_0
                                                ? _mm256_maddubs_epi16(_mm256_sign_epi8(u[v], u[v]), _mm256_sign_epi8(xv, u[v]))
                                                : _mm256_maddubs_epi16(u[v], xv));
        }
        half[v0 / 4] = _mm256_add_epi32(half[v0 / 4], _mm256_madd_epi16(pairs, ones));
    }
}

/* 8 bytes of a K-quant header as float32: unsigned (Q4_K's scales and mins) or signed (Q6_K's scales) */
TARGET static ALWAYS_INLINE __m256 header_bytes(const uint8_t *p, const int is_signed) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)(const void *)p);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

TARGET static ALWAYS_INLINE __m256 fp16x8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p));
}

/* a Q4_K header's 12 planes (internal.h) -> sm: the 16 rows' sc [8][16], then m [8][16], a byte
 * each; planes 0-3, 4-7 and 8-11 are two vectors each */
TARGET static ALWAYS_INLINE void q4k_header_scales_mins(const uint8_t *hd, uint8_t sm[256]) {
    const __m256i six = _mm256_set1_epi8(63), low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    for (int i = 0; i < 64; i += 32) {
        const __m256i p0 = _mm256_loadu_si256((const __m256i *)(const void *)(hd + 64 + i));
        const __m256i p4 = _mm256_loadu_si256((const __m256i *)(const void *)(hd + 128 + i));
        const __m256i p8 = _mm256_loadu_si256((const __m256i *)(const void *)(hd + 192 + i));
        _mm256_store_si256((__m256i *)(void *)(sm + i), _mm256_and_si256(p0, six));
        _mm256_store_si256((__m256i *)(void *)(sm + 64 + i),
                           _mm256_or_si256(_mm256_and_si256(p8, low), _mm256_and_si256(_mm256_srli_epi16(p0, 2), top)));
        _mm256_store_si256((__m256i *)(void *)(sm + 128 + i), _mm256_and_si256(p4, six));
        _mm256_store_si256((__m256i *)(void *)(sm + 192 + i), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p8, 4), low),
                                                                             _mm256_and_si256(_mm256_srli_epi16(p4, 2), top)));
    }
}

/* rows 8h .. 8h+7's scales of record j of a span (header hd, record rec, Q4_K's sm unpacked from hd):
 * s[0] d (Q6_K: of values 0-15), s[1] m (Q6_K: d of 16-31); the K-quants' from the header's d (and
 * -dmin, nd), each product exact */
TARGET static ALWAYS_INLINE void packed_scales(int32_t type, const uint8_t *hd, const uint8_t *sm, const uint8_t *rec,
                                               int64_t j, int h, __m256 d, __m256 nd, __m256 s[2]) {
    if (type == KVREF_TYPE_Q4_K) {
        s[0] = _mm256_mul_ps(d, header_bytes(sm + 16 * j + 8 * h, 0));
        s[1] = _mm256_mul_ps(nd, header_bytes(sm + 128 + 16 * j + 8 * h, 0));
    } else if (type == KVREF_TYPE_Q6_K) {
        s[0] = _mm256_mul_ps(d, header_bytes(hd + 32 + 32 * j + 8 * h, 1));
        s[1] = _mm256_mul_ps(d, header_bytes(hd + 48 + 32 * j + 8 * h, 1));
    } else {
        s[0] = fp16x8(rec + 16 * h);
        if (type == KVREF_TYPE_Q4_1) s[1] = fp16x8(rec + 32 + 16 * h);
    }
}

/* R rows of x against rows 8h .. 8h+7 of one packed group: the scalar kernel's operations per lane
 * (Q8_0's sums are q x directly, the others' u x less the bias times x's sums) */
TARGET static ALWAYS_INLINE void packed_dot_half(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs,
                                                 const float *ds, const int32_t *xsum, const int R, int h, float *out) {
    const int64_t nb = K / 32, rec_bytes = kvref_pack_record_bytes(type), span = kvref_pack_span(type);
    const int64_t header = kvref_pack_header_bytes(type);
    const int32_t bias = type == KVREF_TYPE_Q8_0 ? 0 : kvref_pack_bias(type);
    __m256 acc[4];
    _Alignas(32) uint8_t sm[256];
    for (int t = 0; t < R; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += span) {
        const uint8_t *hd = kvref_pack_header(type, group, b0);
        __m256 d = _mm256_setzero_ps(), nd = _mm256_setzero_ps();
        if (kvref_pack_kquant(type)) d = fp16x8(hd + 16 * h);
        if (type == KVREF_TYPE_Q4_K) {
            nd = _mm256_xor_ps(fp16x8(hd + 32 + 16 * h), _mm256_set1_ps(-0.0f));
            q4k_header_scales_mins(hd, sm);
        }
        for (int64_t j = 0; j < span; j++) {
            const int64_t b = b0 + j;
            const uint8_t *rec = hd + header + j * rec_bytes;
            if (R >= 4 && h == 0) kvref_pack_prefetch(rec + KVREF_PACK_PREFETCH_RECORDS * rec_bytes, rec_bytes);
            __m256i u[8];
            packed_values(type, rec, h, u);
            __m256 sc[2];
            packed_scales(type, hd, sm, rec, j, h, d, nd, sc);
            for (int t = 0; t < R; t++) {
                const int32_t *xs = xsum + t * (K / 16) + 2 * b;
                __m256i half[2] = {_mm256_set1_epi32(-bias * xs[0]), _mm256_set1_epi32(-bias * xs[1])};
                packed_isums(type, u, qs + t * K + 32 * b, half);
                const __m256 dx = _mm256_set1_ps(ds[(t * nb + b) * 2]);
                if (type == KVREF_TYPE_Q6_K) { /* a scale per 16 values */
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half[0]), _mm256_mul_ps(dx, sc[0]), acc[t]);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half[1]), _mm256_mul_ps(dx, sc[1]), acc[t]);
                    continue;
                }
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(half[0], half[1])), _mm256_mul_ps(dx, sc[0]), acc[t]);
                if (type == KVREF_TYPE_Q4_1 || type == KVREF_TYPE_Q4_K)
                    acc[t] = _mm256_fmadd_ps(sc[1], _mm256_set1_ps(ds[(t * nb + b) * 2 + 1]), acc[t]);
            }
        }
    }
    for (int t = 0; t < R; t++) _mm256_storeu_ps(out + KVREF_PACK_ROWS * t + 8 * h, acc[t]);
}

/* T <= 8 rows of x in blocks of 4, 2, 1, each half of the group's rows in turn */
TARGET static ALWAYS_INLINE void packed_dot_type(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs,
                                                 const float *ds, const int32_t *xsum, int64_t T, float *out) {
    const int64_t nd = K / 16; /* ds and xsum per row of x */
    for (int h = 0; h < 2; h++) {
        int64_t t = 0;
        for (; t + 4 <= T; t += 4) packed_dot_half(type, K, group, qs + t * K, ds + t * nd, xsum + t * nd, 4, h, out + 16 * t);
        for (; t + 2 <= T; t += 2) packed_dot_half(type, K, group, qs + t * K, ds + t * nd, xsum + t * nd, 2, h, out + 16 * t);
        for (; t < T; t++) packed_dot_half(type, K, group, qs + t * K, ds + t * nd, xsum + t * nd, 1, h, out + 16 * t);
    }
}

TARGET void kvref_avx2_packed_dot(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs, const float *ds,
                                  const int32_t *xsum, int64_t T, float *out) {
    switch (type) { /* the type a constant in each copy */
    case KVREF_TYPE_Q4_0: packed_dot_type(KVREF_TYPE_Q4_0, K, group, qs, ds, xsum, T, out); break;
    case KVREF_TYPE_Q4_1: packed_dot_type(KVREF_TYPE_Q4_1, K, group, qs, ds, xsum, T, out); break;
    case KVREF_TYPE_Q5_0: packed_dot_type(KVREF_TYPE_Q5_0, K, group, qs, ds, xsum, T, out); break;
    case KVREF_TYPE_Q8_0: packed_dot_type(KVREF_TYPE_Q8_0, K, group, qs, ds, xsum, T, out); break;
    case KVREF_TYPE_Q4_K: packed_dot_type(KVREF_TYPE_Q4_K, K, group, qs, ds, xsum, T, out); break;
    default: packed_dot_type(KVREF_TYPE_Q6_K, K, group, qs, ds, xsum, T, out);
    }
}

/* the scalar kernel's blocks: the same d, 1/d and rint (cvtps rounds to nearest even) */
TARGET static void quantize_q8(int64_t K, const float *x, int8_t *qs, float *ds) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / 32; b++, x += 32, qs += 32, ds += 2) {
        __m256 v[4], amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
            /* v * 0 is NaN exactly for NaN and infinities */
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_mul_ps(v[i], _mm256_setzero_ps()), _mm256_setzero_ps(), _CMP_NEQ_UQ));
        }
        float d, id;
        kvref_q8_scale(hmax8(amax), _mm256_movemask_ps(bad) == 0, &d, &id);
        const __m256 vid = _mm256_set1_ps(id);
        const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
        __m256i q[4];
        for (int i = 0; i < 4; i++) /* min(v, hi) returns hi for NaN, as the scalar kernel maps NaN to 127 */
            q[i] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(v[i], vid), hi), lo));
        const __m256i p16 = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i p8 = _mm256_packs_epi16(p16, p16b); /* 32-bit groups in lane-interleaved order */
        _mm256_storeu_si256((__m256i *)qs, _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        /* the sum of qs in float32: exact, every partial sum is an integer below 2**12 */
        const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        ds[0] = d;
        ds[1] = d * hsum8(_mm256_cvtepi32_ps(sum));
    }
}

TARGET static void to_fp16(int64_t n, const float *x, uint16_t *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) out[i] = kvref_fp32_to_fp16(x[i]);
}

const kvref_kernels kvref_kernels_avx2 = {
    .isa = KVREF_ISA_AVX2,
    KVREF_SIMD_TABLE_COMMON,
    .attn = {.score = attn_score, .exp = attn_exp, .values = attn_values, .i8_lanes = 8, .kivi_lanes = 16},
    .packed_dot = kvref_avx2_packed_dot,
};

#endif /* KVREF_X86 */
