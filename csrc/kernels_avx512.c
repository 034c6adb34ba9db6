/* kernels_avx512.c: the KVREF_ISA_AVX512 kernel table (AVX-512 F/BW/VL/DQ + FMA + F16C).
 *
 * Compiled for baseline x86-64: every function carries a target attribute, and pool.c selects
 * this table only after CPUID and XGETBV confirm the CPU and OS support it. On other
 * architectures the file is empty.
 *
 * Float weights (F32/F16/BF16) take any K, with a masked final vector as the tail. Quantized
 * weights are decoded in registers, never to memory: a 4-bit block's 16 possible values are
 * computed once per block (value = fma(q, d, m), one rounding, as the NumPy dequantizer rounds)
 * and each nibble selects its value with a permute, so every weight value is bit-identical to
 * the spec's dequantized weight and only the summation order differs.
 */
#include "internal.h"

#if KVREF_X86

#include <immintrin.h>
#include <math.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

TARGET static inline float fp16_load(const uint8_t *p) { return _cvtsh_ss(kvref_load_u16(p)); }

TARGET static inline __mmask16 tail_mask(int64_t n) { return (__mmask16)((1u << n) - 1u); }

/* the float16 at p, converted and broadcast to 16 lanes (two vector ops, no scalar round trip) */
TARGET static inline __m512 bcast_fp16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_set1_epi16((short)kvref_load_u16(p)));
}

/* the float16 pair (d, m) at p, each broadcast to 16 lanes */
TARGET static inline void bcast_fp16_pair(const uint8_t *p, __m512 *d, __m512 *m) {
    uint32_t dm;
    memcpy(&dm, p, 4);
    const __m512 v = _mm512_cvtph_ps(_mm256_set1_epi32((int)dm)); /* d, m, d, m, ... */
    *d = _mm512_moveldup_ps(v);
    *m = _mm512_movehdup_ps(v);
}

TARGET static inline __m512 iota16(void) {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* ---- dot kernels, written once for R rows of x ------------------------------------------------
 *
 * dot_<type>(K, w, x, R, out, ldo): out[r * ldo] = the dot of the weight row w with row r of x [R, K].
 * R is a constant once inlined (1 for vec_dot, up to ROWS_MAX for vec_dot_rows), so the accumulators
 * live in registers; each row of x has its own accumulators and gets the operations of R = 1 in the
 * same order, so a row's result does not depend on R. The rows share the weight loads and decoding. */
#define ROWS_MAX 8
#define ALWAYS_INLINE __attribute__((always_inline)) inline
/* GCC keeps a row loop's accumulators in registers only once the loop is unrolled, which it does by
 * itself for small bodies only (the 8-bit kernels' spilled to the stack) */
#define UNROLL_ROWS _Pragma("GCC unroll 8")

/* acc[r][j] = fma(v, x[r * K + i], acc[r][j]) for the R rows */
#define FMA_ROWS(acc, j, v, x, i)                                                                        \
    for (int r = 0; r < R; r++) acc[r][j] = _mm512_fmadd_ps(v, _mm512_loadu_ps((x) + r * K + (i)), acc[r][j])

#define ZERO_ROWS(acc, n)                                                                                \
    for (int r = 0; r < R; r++)                                                                          \
        for (int j = 0; j < (n); j++) acc[r][j] = _mm512_setzero_ps()

TARGET static ALWAYS_INLINE void store_sum4(const int R, __m512 acc[][4], float *out, int64_t ldo) {
    for (int r = 0; r < R; r++)
        out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}

TARGET static ALWAYS_INLINE void store_sum2(const int R, __m512 acc[][2], float *out, int64_t ldo) {
    for (int r = 0; r < R; r++) out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

/* ---- float rows ---------------------------------------------------------------------------- */

TARGET static ALWAYS_INLINE void dot_f32(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    const float *wf = (const float *)(const void *)w; /* loadu: any alignment */
    __m512 a[ROWS_MAX][4];
    ZERO_ROWS(a, 4);
    int64_t i = 0;
    for (; i + 64 <= K; i += 64)
        for (int j = 0; j < 4; j++) {
            const __m512 v = _mm512_loadu_ps(wf + i + 16 * j);
            FMA_ROWS(a, j, v, x, i + 16 * j);
        }
    for (; i + 16 <= K; i += 16) {
        const __m512 v = _mm512_loadu_ps(wf + i);
        FMA_ROWS(a, 0, v, x, i);
    }
    if (i < K) {
        const __mmask16 mk = tail_mask(K - i);
        const __m512 v = _mm512_maskz_loadu_ps(mk, wf + i);
        for (int r = 0; r < R; r++) a[r][1] = _mm512_fmadd_ps(v, _mm512_maskz_loadu_ps(mk, x + r * K + i), a[r][1]);
    }
    store_sum4(R, a, out, ldo);
}

TARGET static inline __m512 bf16_to_ps(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 half-precision weights (float16, or bfloat16 with bf16) at p, the first n of them (others 0) */
TARGET static ALWAYS_INLINE __m512 half16(const uint8_t *p, __mmask16 mk, const int bf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(mk, p);
    return bf16 ? bf16_to_ps(h) : _mm512_cvtph_ps(h);
}

TARGET static ALWAYS_INLINE void dot_half(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo,
                                          const int bf16) {
    __m512 a[ROWS_MAX][2];
    ZERO_ROWS(a, 2);
    int64_t i = 0;
    for (; i + 32 <= K; i += 32) {
        const __m512 v0 = half16(w + 2 * i, 0xffff, bf16), v1 = half16(w + 2 * i + 32, 0xffff, bf16);
        FMA_ROWS(a, 0, v0, x, i);
        FMA_ROWS(a, 1, v1, x, i + 16);
    }
    for (; i < K; i += 16) {
        const __mmask16 mk = K - i >= 16 ? (__mmask16)0xffff : tail_mask(K - i);
        const __m512 v = half16(w + 2 * i, mk, bf16);
        for (int r = 0; r < R; r++) a[r][0] = _mm512_fmadd_ps(v, _mm512_maskz_loadu_ps(mk, x + r * K + i), a[r][0]);
    }
    store_sum2(R, a, out, ldo);
}

TARGET static ALWAYS_INLINE void dot_f16(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    dot_half(K, w, x, R, out, ldo, 0);
}

TARGET static ALWAYS_INLINE void dot_bf16(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    dot_half(K, w, x, R, out, ldo, 1);
}

/* ---- 32-value blocks --------------------------------------------------------------------- */

/* nibble bytes qs[16] -> int32 lanes; the permute reads bits 3:0 (low nibble), >> 4 gives the high */
TARGET static inline __m512i load_nibble_bytes(const uint8_t *qs) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
}

TARGET static ALWAYS_INLINE void dot_q4_0(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    const __m512 centred = _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f));
    __m512 a[ROWS_MAX][2];
    ZERO_ROWS(a, 2);
    for (int64_t b = 0; b < K / QK4_0; b++, w += BYTES_Q4_0, x += QK4_0) {
        const __m512 table = _mm512_mul_ps(centred, bcast_fp16(w)); /* d * (q - 8), exact */
        const __m512i q = load_nibble_bytes(w + 2);
        const __m512 v0 = _mm512_permutexvar_ps(q, table), v1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
        FMA_ROWS(a, 0, v0, x, 0);
        FMA_ROWS(a, 1, v1, x, 16);
    }
    store_sum2(R, a, out, ldo);
}

/* The row's (d, m) pairs are converted to float32 first, 64 blocks at a time, so each block's
 * table is built from two broadcast loads instead of a broadcast and two lane shuffles (shuffles
 * are the scarce resource here: the nibble widening and the two table lookups need them too). */
TARGET static ALWAYS_INLINE void dot_q4_1(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    const __m512 iota = iota16();
    const int64_t nb = K / QK4_1;
    float dm[2 * 64];
    __m512 a[ROWS_MAX][4];
    ZERO_ROWS(a, 4);
    for (int64_t b0 = 0; b0 < nb; b0 += 64) {
        const int64_t n = nb - b0 < 64 ? nb - b0 : 64;
        const uint8_t *wb = w + b0 * BYTES_Q4_1;
        const float *xb = x + b0 * QK4_1;
        for (int64_t b = 0; b < n; b++) {
            uint32_t v;
            memcpy(&v, wb + b * BYTES_Q4_1, 4);
            _mm_storel_pi((__m64 *)(void *)(dm + 2 * b), _mm_cvtph_ps(_mm_cvtsi32_si128((int)v)));
        }
        int64_t b = 0;
        for (; b + 2 <= n; b += 2, wb += 2 * BYTES_Q4_1, xb += 2 * QK4_1) {
            /* d * q + m for q = 0..15: one rounding, as NumPy */
            const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[2 * b]), _mm512_set1_ps(dm[2 * b + 1]));
            const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[2 * b + 2]), _mm512_set1_ps(dm[2 * b + 3]));
            const __m512i q0 = load_nibble_bytes(wb + 4), q1 = load_nibble_bytes(wb + BYTES_Q4_1 + 4);
            const __m512 v0 = _mm512_permutexvar_ps(q0, t0), v1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), t0);
            const __m512 v2 = _mm512_permutexvar_ps(q1, t1), v3 = _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), t1);
            FMA_ROWS(a, 0, v0, xb, 0);
            FMA_ROWS(a, 1, v1, xb, 16);
            FMA_ROWS(a, 2, v2, xb, 32);
            FMA_ROWS(a, 3, v3, xb, 48);
        }
        if (b < n) {
            const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[2 * b]), _mm512_set1_ps(dm[2 * b + 1]));
            const __m512i q0 = load_nibble_bytes(wb + 4);
            const __m512 v0 = _mm512_permutexvar_ps(q0, t0), v1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), t0);
            FMA_ROWS(a, 0, v0, xb, 0);
            FMA_ROWS(a, 1, v1, xb, 16);
        }
    }
    store_sum4(R, a, out, ldo);
}

/* MXFP4: the block's table is its 16 (doubled) E2M1 values times 2**(e - 128), exact; each nibble
 * picks its value with a permute, as Q4_0 */
TARGET static inline __m512 mxfp4_table(const uint8_t *w) {
    const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)kvref_mxfp4_values)));
    return _mm512_mul_ps(values, _mm512_set1_ps(kvref_e8m0_half(w[0])));
}

TARGET static ALWAYS_INLINE void dot_mxfp4(int64_t K, const uint8_t *w, const float *x, const int R, float *out,
                                           int64_t ldo) {
    __m512 a[ROWS_MAX][2];
    ZERO_ROWS(a, 2);
    for (int64_t b = 0; b < K / 32; b++, w += BYTES_MXFP4, x += 32) {
        const __m512 table = mxfp4_table(w);
        const __m512i q = load_nibble_bytes(w + 1);
        const __m512 v0 = _mm512_permutexvar_ps(q, table), v1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
        FMA_ROWS(a, 0, v0, x, 0);
        FMA_ROWS(a, 1, v1, x, 16);
    }
    store_sum2(R, a, out, ldo);
}

/* Q5_0 has 32 possible values per block: d * (q - 16) for q < 16 in one table, q >= 16 in the other,
 * and each value's index is its nibble with the fifth bit set from qh (a mask op), so a two-table
 * permute selects it */
TARGET static inline void q5_0_block(const uint8_t *w, const __m512 iota, __m512 *lo, __m512 *hi) {
    const __m512 d = bcast_fp16(w);
    const __m512 t0 = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(16.0f)), d), t1 = _mm512_mul_ps(iota, d); /* exact */
    const uint32_t qh = kvref_q5_high_bits(w);
    const __m512i q = load_nibble_bytes(w + 6), sixteen = _mm512_set1_epi32(16);
    const __m512i i0 = _mm512_mask_or_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0xF)), (__mmask16)(qh & 0xFFFFu),
                                            q, sixteen);
    const __m512i i1 = _mm512_mask_or_epi32(_mm512_srli_epi32(q, 4), (__mmask16)(qh >> 16), _mm512_srli_epi32(q, 4), sixteen);
    *lo = _mm512_permutex2var_ps(t0, i0, t1);
    *hi = _mm512_permutex2var_ps(t0, i1, t1);
}

TARGET static ALWAYS_INLINE void dot_q5_0(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    const __m512 iota = iota16();
    __m512 a[ROWS_MAX][2];
    ZERO_ROWS(a, 2);
    for (int64_t b = 0; b < K / 32; b++, w += BYTES_Q5_0, x += 32) {
        __m512 lo, hi;
        q5_0_block(w, iota, &lo, &hi);
        FMA_ROWS(a, 0, lo, x, 0);
        FMA_ROWS(a, 1, hi, x, 16);
    }
    store_sum2(R, a, out, ldo);
}

TARGET static ALWAYS_INLINE void dot_q8_0(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    __m512 a[ROWS_MAX][2];
    ZERO_ROWS(a, 2);
    for (int64_t b = 0; b < K / QK8_0; b++, w += BYTES_Q8_0, x += QK8_0) {
        const __m512 d = bcast_fp16(w);
        const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 2))));
        const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 18))));
        const __m512 v0 = _mm512_mul_ps(q0, d), v1 = _mm512_mul_ps(q1, d); /* d * q exact */
        FMA_ROWS(a, 0, v0, x, 0);
        FMA_ROWS(a, 1, v1, x, 16);
    }
    store_sum2(R, a, out, ldo);
}

/* ---- 256-value super-blocks ------------------------------------------------------------------ */

/* Keep the `bytes` bytes at p in memory for the reads that follow: each read is then a load (a broadcast,
 * or a widening from memory), which GCC would otherwise turn into lane permutes or extracts of the
 * register just stored (a shuffle each, the scarce resource of these kernels) */
#define IN_MEMORY(p, bytes) __asm__("" : "+m"(*(char(*)[bytes])(void *)(p)))

/* dm[j] = d * sc_j and dm[8 + j] = -(dmin * m_j) for the eight sub-blocks j of the Q4_K super-block w
 * (d, dmin its scales; both products exact), all sixteen in one vector: each sub-block's table is then
 * built from two broadcast loads, with no scalar unpacking, conversion or register broadcast per sub-block */
TARGET static inline void q4_k_scales(const uint8_t *w, float dm[16]) {
    uint8_t sm[16];
    kvref_q4k_scales_mins(w + 4, sm);
    __m512 d, dmin;
    bcast_fp16_pair(w, &d, &dmin);
    const __m512 by = _mm512_mask_blend_ps(0xFF00, d, _mm512_xor_ps(dmin, _mm512_set1_ps(-0.0f))); /* d x 8, -dmin x 8 */
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)sm)));
    _mm512_storeu_ps(dm, _mm512_mul_ps(q, by));
    IN_MEMORY(dm, 16 * sizeof(float));
}

/* v[0..3] = the 64 values of sub-blocks 2c and 2c+1 of the Q4_K super-block w (dm: q4_k_scales),
 * in order: the 32 bytes hold sub-block 2c in the low nibbles, 2c+1 in the high; each value is
 * d * sc * q - dmin * m with both products exact, one rounding as NumPy's */
TARGET static inline void q4_k_values(const uint8_t *w, const float *dm, int c, __m512 iota, __m512 v[4]) {
    const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[2 * c]), _mm512_set1_ps(dm[8 + 2 * c]));
    const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[2 * c + 1]), _mm512_set1_ps(dm[8 + 2 * c + 1]));
    const __m512i q0 = load_nibble_bytes(w + 16 + 32 * c), q1 = load_nibble_bytes(w + 16 + 32 * c + 16);
    v[0] = _mm512_permutexvar_ps(q0, t0);
    v[1] = _mm512_permutexvar_ps(q1, t0);
    v[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), t1);
    v[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), t1);
}

TARGET static ALWAYS_INLINE void dot_q4_k(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    const __m512 iota = iota16();
    float dm[16];
    __m512 a[ROWS_MAX][4];
    ZERO_ROWS(a, 4);
    for (int64_t b = 0; b < K / QK_K; b++, w += BYTES_Q4_K, x += QK_K) {
        q4_k_scales(w, dm);
        for (int c = 0; c < 4; c++) {
            __m512 v[4];
            q4_k_values(w, dm, c, iota, v);
            for (int j = 0; j < 4; j++) FMA_ROWS(a, j, v[j], x, 64 * c + 16 * j);
        }
    }
    store_sum4(R, a, out, ldo);
}

/* q[i] = q_i - 32 for the 256 values of the Q6_K super-block w, in order, as int8: 64 values a vector,
 * their low four bits from ql's nibbles and the top two from qh, shifted into bits 5:4 per 16-bit word
 * (a byte's neighbour lands outside them). Value 128 h + 32 r + l takes bits 2r+1:2r of qh[32 h + l]. */
TARGET static inline void q6_k_bytes(const uint8_t *w, int8_t q[QK_K]) {
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(32);
    /* shifts per 16-bit word: the first 32 bytes' values (l) take qh's bits 1:0 and 5:4, the last 32's (32 + l) 3:2 and 7:6 */
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512(w + 64 * h);  /* values l and 32 + l (low nibbles), 64 + l and 96 + l (high) */
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(const void *)(w + 128 + 32 * h)));
        const __m512i h01 = _mm512_and_si512(_mm512_sllv_epi16(qh, up), top);
        const __m512i h23 = _mm512_and_si512(_mm512_srlv_epi16(qh, down), top);
        const __m512i q01 = _mm512_or_si512(_mm512_and_si512(ql, low), h01);
        const __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low), h23);
        _mm512_storeu_si512(q + 128 * h, _mm512_sub_epi8(q01, off));
        _mm512_storeu_si512(q + 128 * h + 64, _mm512_sub_epi8(q23, off));
    }
    IN_MEMORY(q, QK_K);
}

/* ds[j] = d * scale_j for the 16 sub-blocks of the Q6_K super-block w (exact: an 11-bit by an 8-bit integer) */
TARGET static inline void q6_k_scales(const uint8_t *w, float ds[16]) {
    const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(w + 192))));
    _mm512_storeu_ps(ds, _mm512_mul_ps(s, bcast_fp16(w + 208)));
    IN_MEMORY(ds, 16 * sizeof(float));
}

/* the 16 values of sub-block j: (d * scale_j) * (q - 32), one rounding as NumPy's */
TARGET static inline __m512 q6_k_values(const int8_t *q, const float *ds, int j) {
    const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(const void *)(q + 16 * j))));
    return _mm512_mul_ps(qf, _mm512_set1_ps(ds[j]));
}

/* The super-block's values are decoded to int8 first, 64 at a time with byte operations, then
 * widened 16 at a time: a widening, a conversion and a multiply per 16 values, where decoding each
 * 16 from its own bytes took ~10 vector operations. Sub-block j goes to accumulator j / 2 % 4, the
 * order of the 32-value runs the super-block's layout interleaves. */
TARGET static ALWAYS_INLINE void dot_q6_k(int64_t K, const uint8_t *w, const float *x, const int R, float *out, int64_t ldo) {
    _Alignas(64) int8_t q[QK_K];
    float ds[16];
    __m512 a[ROWS_MAX][4];
    ZERO_ROWS(a, 4);
    for (int64_t b = 0; b < K / QK_K; b++, w += BYTES_Q6_K, x += QK_K) {
        q6_k_bytes(w, q);
        q6_k_scales(w, ds);
        for (int j = 0; j < 16; j++) {
            const __m512 v = q6_k_values(q, ds, j);
            FMA_ROWS(a, j / 2 % 4, v, x, 16 * j);
        }
    }
    store_sum4(R, a, out, ldo);
}

/* four accumulators a row: four rows of x per block (16 accumulators); two: eight */
KVREF_DOT_KERNELS(f32, 4)
KVREF_DOT_KERNELS(f16, 8)
KVREF_DOT_KERNELS(bf16, 8)
KVREF_DOT_KERNELS(q4_0, 8)
KVREF_DOT_KERNELS(q4_1, 4)
KVREF_DOT_KERNELS(q5_0, 8)
KVREF_DOT_KERNELS(q8_0, 8)
KVREF_DOT_KERNELS(q4_k, 4)
KVREF_DOT_KERNELS(q6_k, 4)
KVREF_DOT_KERNELS(mxfp4, 8)

/* ---- dequantize a row to memory (GEMM tiles); same values as the dot kernels use ----------- */

TARGET static void dequant_q4_1(int64_t K, const uint8_t *w, float *out) {
    const __m512 iota = iota16();
    for (int64_t b = 0; b < K / QK4_1; b++, w += BYTES_Q4_1, out += QK4_1) {
        __m512 d, m;
        bcast_fp16_pair(w, &d, &m);
        const __m512 table = _mm512_fmadd_ps(iota, d, m); /* d * q + m: one rounding, as NumPy */
        const __m512i q = load_nibble_bytes(w + 4);
        _mm512_storeu_ps(out, _mm512_permutexvar_ps(q, table));
        _mm512_storeu_ps(out + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
    }
}

TARGET static void dequant_mxfp4(int64_t K, const uint8_t *w, float *out) {
    for (int64_t b = 0; b < K / 32; b++, w += BYTES_MXFP4, out += 32) {
        const __m512 table = mxfp4_table(w);
        const __m512i q = load_nibble_bytes(w + 1);
        _mm512_storeu_ps(out, _mm512_permutexvar_ps(q, table));
        _mm512_storeu_ps(out + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
    }
}

TARGET static void dequant_q4_0(int64_t K, const uint8_t *w, float *out) {
    const __m512 centred = _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f));
    for (int64_t b = 0; b < K / QK4_0; b++, w += BYTES_Q4_0, out += QK4_0) {
        const __m512 table = _mm512_mul_ps(centred, bcast_fp16(w));
        const __m512i q = load_nibble_bytes(w + 2);
        _mm512_storeu_ps(out, _mm512_permutexvar_ps(q, table));
        _mm512_storeu_ps(out + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
    }
}

TARGET static void dequant_q5_0(int64_t K, const uint8_t *w, float *out) {
    const __m512 iota = iota16();
    for (int64_t b = 0; b < K / 32; b++, w += BYTES_Q5_0, out += 32) {
        __m512 lo, hi;
        q5_0_block(w, iota, &lo, &hi);
        _mm512_storeu_ps(out, lo);
        _mm512_storeu_ps(out + 16, hi);
    }
}

TARGET static void dequant_q8_0(int64_t K, const uint8_t *w, float *out) {
    for (int64_t b = 0; b < K / QK8_0; b++, w += BYTES_Q8_0, out += QK8_0) {
        const __m512 d = bcast_fp16(w);
        _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 2)))), d));
        _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 18)))), d));
    }
}

TARGET static void dequant_f16(int64_t K, const uint8_t *w, float *out) {
    int64_t i = 0;
    for (; i + 16 <= K; i += 16) _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 2 * i))));
    for (; i < K; i++) out[i] = fp16_load(w + 2 * i);
}

TARGET static void dequant_bf16(int64_t K, const uint8_t *w, float *out) {
    int64_t i = 0;
    for (; i + 16 <= K; i += 16) _mm512_storeu_ps(out + i, bf16_to_ps(_mm256_loadu_si256((const __m256i *)(w + 2 * i))));
    for (; i < K; i++) out[i] = kvref_bf16_to_fp32(kvref_load_u16(w + 2 * i));
}

TARGET static void dequant_f32(int64_t K, const uint8_t *w, float *out) { kvref_dequant_row(KVREF_TYPE_F32, K, w, out); }

TARGET static void dequant_q4_k(int64_t K, const uint8_t *w, float *out) {
    const __m512 iota = iota16();
    float dm[16];
    for (int64_t b = 0; b < K / QK_K; b++, w += BYTES_Q4_K, out += QK_K) {
        q4_k_scales(w, dm);
        for (int c = 0; c < 4; c++) {
            __m512 v[4];
            q4_k_values(w, dm, c, iota, v);
            for (int r = 0; r < 4; r++) _mm512_storeu_ps(out + 64 * c + 16 * r, v[r]);
        }
    }
}

TARGET static void dequant_q6_k(int64_t K, const uint8_t *w, float *out) {
    _Alignas(64) int8_t q[QK_K];
    float ds[16];
    for (int64_t b = 0; b < K / QK_K; b++, w += BYTES_Q6_K, out += QK_K) {
        q6_k_bytes(w, q);
        q6_k_scales(w, ds);
        for (int j = 0; j < 16; j++) _mm512_storeu_ps(out + 16 * j, q6_k_values(q, ds, j));
    }
}

/* ---- float32 GEMM on a dequantized tile: outer products ------------------------------------ */

_Static_assert(KVREF_TILE_N == 32, "a tile row is two AVX-512 vectors");
/* Rows of x per block: 16 accumulators. 12 (24 accumulators) is as fast for K = 640 but 10 %
 * slower for K = 1024 and 2048, whose x rows sit 4 or 8 KiB apart: the lines the broadcasts read
 * then fall in one L1 set, and 12 of them overflow its 8 ways (Zen 4). */
#define GEMM_ROWS 8

/* y[i, n] for the R rows of x at x (row stride K) and n below the masks' lanes: one x value
 * broadcast against a tile row per step, so each output is one fused multiply-add per k in k
 * order, the same operations for R = GEMM_ROWS as for the tails' 4 and 1. R is a constant once
 * inlined, so the accumulators live in registers. */
TARGET static inline __attribute__((always_inline)) void gemm_block(int64_t K, const float *x, const int R,
                                                                    const float *tile, __mmask16 m0, __mmask16 m1,
                                                                    float *y, int64_t ldy) {
    __m512 acc[GEMM_ROWS][2];
    for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m512 w0 = _mm512_load_ps(tile + k * KVREF_TILE_N), w1 = _mm512_load_ps(tile + k * KVREF_TILE_N + 16);
        for (int i = 0; i < R; i++) {
            const __m512 xv = _mm512_set1_ps(x[i * K + k]);
            acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
        }
    }
    for (int i = 0; i < R; i++) {
        _mm512_mask_storeu_ps(y + i * ldy, m0, acc[i][0]);
        _mm512_mask_storeu_ps(y + i * ldy + 16, m1, acc[i][1]);
    }
}

/* r[j] = column j of the 16 x 16 block whose rows are r[0..15]: pairs, quads, then 128-bit lanes
 * twice (the usual unpack / shuffle / shuffle_f32x4 network) */
TARGET static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

TARGET static void tile_columns(int64_t K, const float *rows, float *tile) {
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(rows + i * K + k);
        transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_store_ps(tile + (k + j) * KVREF_TILE_N, r[j]);
    }
    for (; k < K; k++)
        for (int64_t i = 0; i < 16; i++) tile[k * KVREF_TILE_N + i] = rows[i * K + k];
}

TARGET static void gemm_f32(int64_t K, const float *x, int64_t T, const float *tile, int64_t nw, float *y, int64_t ldy) {
    const __mmask16 m0 = tail_mask(nw < 16 ? nw : 16), m1 = tail_mask(nw > 16 ? nw - 16 : 0);
    int64_t t = 0;
    for (; t + GEMM_ROWS <= T; t += GEMM_ROWS) gemm_block(K, x + t * K, GEMM_ROWS, tile, m0, m1, y + t * ldy, ldy);
    for (; t + 4 <= T; t += 4) gemm_block(K, x + t * K, 4, tile, m0, m1, y + t * ldy, ldy);
    for (; t < T; t++) gemm_block(K, x + t * K, 1, tile, m0, m1, y + t * ldy, ldy);
}

/* ---- the read-bandwidth probe: four 64-byte loads in flight per step, as the kernels stream -- */

TARGET static uint64_t read_sum(const uint8_t *p, int64_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < n; i += 256) {
        a0 = _mm512_add_epi64(a0, _mm512_load_si512(p + i));
        a1 = _mm512_add_epi64(a1, _mm512_load_si512(p + i + 64));
        a2 = _mm512_add_epi64(a2, _mm512_load_si512(p + i + 128));
        a3 = _mm512_add_epi64(a3, _mm512_load_si512(p + i + 192));
    }
    return (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
}

/* ---- exp, for softmax, SiLU and GELU ---------------------------------------------------------------- */

/* Cephes expf: exp(x) = 2**n * e**r, |r| <= ln2/2, degree-7 polynomial; within 2 ulp of expf on
 * [-87, 88]; exp(-inf) and anything below -88.37 give 0, above 88.37 give +inf; NaN stays NaN. */
TARGET static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), _mm512_max_ps(_mm512_set1_ps(-88.3762626647949f), x));
    __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
    fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}

TARGET static void swiglu(int64_t n, const float *gate, const float *up, float *out) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mk = n - i >= 16 ? (__mmask16)0xffff : tail_mask(n - i);
        const __m512 g = _mm512_maskz_loadu_ps(mk, gate + i);
        const __m512 sig = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_mask_storeu_ps(out + i, mk, _mm512_mul_ps(sig, _mm512_maskz_loadu_ps(mk, up + i)));
    }
}

/* gpt-oss's clamped SwiGLU; min/max return their second operand when either is NaN, so the
 * clamps (the limit first) keep a NaN a NaN */
TARGET static void swiglu_oai(int64_t n, const float *gate, const float *up, float *out) {
    const __m512 one = _mm512_set1_ps(1.0f), L = _mm512_set1_ps(KVREF_SWIGLU_OAI_LIMIT);
    const __m512 minus_L = _mm512_set1_ps(-KVREF_SWIGLU_OAI_LIMIT), minus_alpha = _mm512_set1_ps(-KVREF_SWIGLU_OAI_ALPHA);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mk = n - i >= 16 ? (__mmask16)0xffff : tail_mask(n - i);
        const __m512 g = _mm512_min_ps(L, _mm512_maskz_loadu_ps(mk, gate + i));
        const __m512 u = _mm512_max_ps(minus_L, _mm512_min_ps(L, _mm512_maskz_loadu_ps(mk, up + i)));
        const __m512 sig = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_mul_ps(minus_alpha, g))));
        _mm512_mask_storeu_ps(out + i, mk, _mm512_mul_ps(sig, _mm512_add_ps(u, one)));
    }
}

/* gelu_tanh(g) * u with 0.5 g (1 + tanh(y)) written as g / (1 + exp(-2y)), the same function;
 * y = c (g + 0.044715 g^3) is rounded step by step exactly as kvref.spec.ops.gelu_tanh rounds it
 * (no FMA), so only the exponential differs from the spec's tanh */
TARGET static void geglu(int64_t n, const float *gate, const float *up, float *out) {
    const __m512 one = _mm512_set1_ps(1.0f), c = _mm512_set1_ps(KVREF_GELU_C), k = _mm512_set1_ps(KVREF_GELU_K);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mk = n - i >= 16 ? (__mmask16)0xffff : tail_mask(n - i);
        const __m512 g = _mm512_maskz_loadu_ps(mk, gate + i);
        const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(k, g), g), g);
        const __m512 y = _mm512_mul_ps(c, _mm512_add_ps(g, cube));
        const __m512 e = exp16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), y));
        const __m512 gelu = _mm512_div_ps(g, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(out + i, mk, _mm512_mul_ps(gelu, _mm512_maskz_loadu_ps(mk, up + i)));
    }
}

/* ---- attention chunk kernels (the skeleton that runs them: csrc/attention.c) -------------- */

/* 16 K/V values at element e of a chunk's K or V, as float32: F16 and BF16 widened, I8 times
 * `scale`, its group's scale (these kernels take I8 only when 16 | group_size, their i8_lanes, so a
 * vector never spans two groups). `full` (a compile-time constant where it matters): the mask is all ones, so a
 * plain load does (masked loads cost more on some cores). */
TARGET static inline __m512 load_kv_m(const uint8_t *base, int32_t type, int64_t e, __mmask16 mk, int full,
                                      float scale) {
    switch (type) {
    case KVREF_TYPE_F16:
        return _mm512_cvtph_ps(full ? _mm256_loadu_si256((const __m256i *)(const void *)(base + 2 * e))
                                    : _mm256_maskz_loadu_epi16(mk, base + 2 * e));
    case KVREF_TYPE_BF16: {
        const __m256i h = full ? _mm256_loadu_si256((const __m256i *)(const void *)(base + 2 * e))
                               : _mm256_maskz_loadu_epi16(mk, base + 2 * e);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case KVREF_TYPE_I8: {
        const __m128i b = full ? _mm_loadu_si128((const __m128i *)(const void *)(base + e)) : _mm_maskz_loadu_epi8(mk, base + e);
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(scale));
    }
    default: {
        const float *f = (const float *)(const void *)base + e;
        return full ? _mm512_loadu_ps(f) : _mm512_maskz_loadu_ps(mk, f);
    }
    }
}

/* [8 x 16 lanes] -> 8 floats: out[r] = sum of the lanes of v[r] (a fixed tree of adds) */
TARGET static inline __m256 reduce8(const __m512 *v) {
    __m512 r[4], s[2];
    for (int i = 0; i < 4; i++) /* per 128-bit lane: (v2i, v2i+1) partial sums interleaved */
        r[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) { /* per 128-bit lane: the 4 keys 4i..4i+3 */
        const __m512d a = _mm512_castps_pd(r[2 * i]), b = _mm512_castps_pd(r[2 * i + 1]);
        s[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* the four 128-bit lanes of s[0] and of s[1], added in pairs, then the pairs */
    const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x88), _mm512_shuffle_f32x4(s[0], s[1], 0xDD));
    const __m512 u = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, 0xB1));
    return _mm512_castps512_ps256(_mm512_shuffle_f32x4(u, u, 0x08));
}

/* Scores of nk keys (rows row[0..nk)) for the gb heads q[0..gb) of the group, nk * gb <= 24 (8 x 3
 * or 4 x 4), float K types: nk dot-product vectors per head, each K vector loaded (and widened)
 * once for all gb heads, then one transposing reduction per head (of 8 vectors: zeros past nk). */
TARGET __attribute__((always_inline)) static inline void score_keys(
    const kvref_attn_args *a, const float *q, const uint8_t *kb, const int64_t *row, float *p,
    const int32_t k_type, const int full, const int gb, const int nk) {
    const int64_t D = a->D, C = KVREF_ATTN_CHUNK, nvec = (D + 15) / 16;
    const __mmask16 last = D % 16 ? tail_mask(D % 16) : (__mmask16)0xffff;
    __m512 d[4][8];
    for (int g = 0; g < gb; g++)
        for (int r = 0; r < 8; r++) d[g][r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nvec; j++) {
        const __mmask16 mk = j == nvec - 1 ? last : (__mmask16)0xffff;
        __m512 qv[4];
        for (int g = 0; g < gb; g++) qv[g] = _mm512_maskz_loadu_ps(mk, q + g * D + 16 * j);
        for (int r = 0; r < nk; r++) {
            const __m512 kv = load_kv_m(kb, k_type, row[r] + 16 * j, mk, full, 0.0f);
            for (int g = 0; g < gb; g++) d[g][r] = _mm512_fmadd_ps(qv[g], kv, d[g][r]);
        }
    }
    for (int g = 0; g < gb; g++) {
        __m256 sg = _mm256_mul_ps(reduce8(d[g]), _mm256_set1_ps(a->scale));
        /* kvref_attn_score_value, 8 at a time: non-finite -> NaN */
        sg = _mm256_fmadd_ps(sg, _mm256_setzero_ps(), sg);
        if (nk == 8) _mm256_storeu_ps(p + g * C, sg);
        else _mm_storeu_ps(p + g * C, _mm256_castps256_ps128(sg));
    }
}

/* p[g * C + s] = (q_g . k_s) * scale for the chunk's n keys (float K types), 8 keys at a time, the
 * last n % 8 keys one by one; masked keys are scored like the rest (cheaper than testing each key;
 * the skeleton hides them), except the 8-key blocks after the last visible key (half the diagonal
 * chunk of a causal query): the cut is a multiple of 8, so a scored key keeps its block and its
 * score. Every 8 keys, asks for the K of the keys a chunk ahead (V: attn_values). */
TARGET __attribute__((always_inline)) static inline void score_typed(
    const kvref_attn_args *a, const kvref_attn_chunk *c, float *p, const int32_t k_type, const int full) {
    const float *q = c->q;
    const uint8_t *kb = c->k;
    const int64_t *row = c->row;
    const int64_t nrows = c->nrows;
    const int64_t G = a->G, D = a->D, C = KVREF_ATTN_CHUNK, nvec = (D + 15) / 16;
    const __mmask16 last = D % 16 ? tail_mask(D % 16) : (__mmask16)0xffff;
    int64_t n = c->n, end = c->n;
    while (!c->all && kvref_attn_hidden(c, end - 1)) end--; /* some key is visible */
    if ((end + 7) / 8 * 8 < n) n = (end + 7) / 8 * 8;
    int64_t s = 0;
    for (; s + 8 <= n; s += 8) {
        kvref_attn_prefetch(kb, a->k_type, a->D, row, s + KVREF_ATTN_PREFETCH_KEYS, nrows);
        if (G % 4 == 0) /* 4 heads x 4 keys: each K vector widened once per 4 heads, not 3 + 1 */
            for (int64_t g0 = 0; g0 < G; g0 += 4)
                for (int64_t s4 = s; s4 < s + 8; s4 += 4)
                    score_keys(a, q + g0 * D, kb, row + s4, p + g0 * C + s4, k_type, full, 4, 4);
        else
            for (int64_t g0 = 0; g0 < G; g0 += 3) {
                const float *qg = q + g0 * D;
                float *pg = p + g0 * C + s;
                switch (G - g0) {
                case 1: score_keys(a, qg, kb, row + s, pg, k_type, full, 1, 8); break;
                case 2: score_keys(a, qg, kb, row + s, pg, k_type, full, 2, 8); break;
                default: score_keys(a, qg, kb, row + s, pg, k_type, full, 3, 8);
                }
            }
    }
    for (; s < n; s++)
        for (int64_t g = 0; g < G; g++) {
            __m512 d = _mm512_setzero_ps();
            for (int64_t j = 0; j < nvec; j++) {
                const __mmask16 mk = j == nvec - 1 ? last : (__mmask16)0xffff;
                d = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, q + g * D + 16 * j),
                                    load_kv_m(kb, k_type, row[s] + 16 * j, mk, full, 0.0f), d);
            }
            p[g * C + s] = kvref_attn_score_value(_mm512_reduce_add_ps(d) * a->scale);
        }
}

/* acc[g] += sum_s p[g, s] V[s] for the gb <= 4 heads p[0..gb), acc[0..gb) of the group, over the
 * slice of the head dim from vector j0 on (at most 4 vectors: 64 floats) and a chunk with every key
 * visible: each V vector is loaded (and widened) once for all gb heads. One head takes two keys per
 * step, so 8 independent FMA chains are in flight, not 4 that wait on the FMA latency at every key.
 * plain: the slice is exactly 4 full vectors. ahead: this pass asks for the next chunk's V. */
TARGET __attribute__((always_inline)) static inline void pv_visible(
    const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc, int64_t j0, int ahead,
    const int32_t v_type, const int plain, __mmask16 last, const int gb) {
#define load_v(s, j) load_kv_m(vb, v_type, row[s] + 16 * (j0 + j), mk[j], plain, \
                               v_type == KVREF_TYPE_I8 ? vs[srow[s] + jg[j]] : 0.0f)
    const uint8_t *vb = c->v;
    const float *vs = c->v_scales;
    const int64_t *row = c->row, *srow = c->srow;
    const int64_t n = c->n, nrows = c->nrows;
    const int64_t D = a->Dv, C = KVREF_ATTN_CHUNK, nvec = (D + 15) / 16; /* D: the values' width here */
    const int keys = gb == 1 ? 2 : 1; /* keys per step */
    __mmask16 mk[4];
    int64_t jg[4]; /* the I8 scale group of each vector */
    for (int64_t j = 0; j < 4; j++) {
        mk[j] = j0 + j < nvec - 1 ? (__mmask16)0xffff : j0 + j == nvec - 1 ? last : 0;
        /* vectors past the head dim (mk 0) load nothing; their scale index stays in the row */
        jg[j] = v_type == KVREF_TYPE_I8 && mk[j] ? 16 * (j0 + j) / a->group_size : 0;
    }
    float *as = acc + 16 * j0;
    __m512 ac[2][4][4];
    for (int k = 0; k < keys; k++)
        for (int g = 0; g < gb; g++)
            for (int j = 0; j < 4; j++)
                ac[k][g][j] = k == 0 ? _mm512_maskz_loadu_ps(mk[j], as + g * D + 16 * j) : _mm512_setzero_ps();
    int64_t s = 0;
    for (; s + keys <= n; s += keys) {
        if (ahead && (s & 7) == 0) kvref_attn_prefetch(vb, v_type, D, row, s + KVREF_ATTN_PREFETCH_KEYS, nrows);
        for (int k = 0; k < keys; k++)
            for (int j = 0; j < 4; j++) {
                const __m512 v = load_v(s + k, j);
                for (int g = 0; g < gb; g++) ac[k][g][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * C + s + k]), v, ac[k][g][j]);
            }
    }
    for (; s < n; s++) /* one key left over (keys == 2) */
        for (int j = 0; j < 4; j++) {
            const __m512 v = load_v(s, j);
            for (int g = 0; g < gb; g++) ac[0][g][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * C + s]), v, ac[0][g][j]);
        }
    for (int g = 0; g < gb; g++)
        for (int j = 0; j < 4; j++) {
            const __m512 sum = keys == 2 ? _mm512_add_ps(ac[0][g][j], ac[1][g][j]) : ac[0][g][j];
            _mm512_mask_storeu_ps(as + g * D + 16 * j, mk[j], sum);
        }
#undef load_v
}

/* acc += p V over the chunk's n keys; masked keys never touch acc. A chunk with masked keys (the
 * diagonal chunk of every prefill query, a window's edge) is first narrowed to its visible keys:
 * their rows (then the rows ahead, for the prefetches) and each group's probabilities, in key
 * order, so it runs the all-visible kernel too; a key at a time per 16-lane slice, as a masked
 * chunk once ran, waits on the FMA latency at every key and made that one chunk cost as much as
 * four. For groups of 2 or 3 heads the sums are the same operations as that loop's. */
TARGET __attribute__((always_inline)) static inline void pv_typed(
    const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc, const int32_t v_type,
    const int full) {
    const int64_t D = a->Dv, C = KVREF_ATTN_CHUNK, nvec = (D + 15) / 16; /* acc [G, Dv] */
    const __mmask16 last = D % 16 ? tail_mask(D % 16) : (__mmask16)0xffff;
    kvref_attn_chunk vis = *c;
    int64_t keep[KVREF_ATTN_CHUNK], row[KVREF_ATTN_CHUNK + KVREF_ATTN_LOOKAHEAD], srow[KVREF_ATTN_CHUNK + KVREF_ATTN_LOOKAHEAD];
    float pv[4 * KVREF_ATTN_CHUNK]; /* [4, C]: one group's probabilities of the visible keys */
    /* heads per group: 4 when they divide G (Gemma 3), so each V vector is widened once per 4
     * heads, not per 3 + 1; else 3 (12 accumulators of 4 vectors) */
    const int64_t step = a->G % 4 == 0 ? 4 : 3;
    if (!c->all) {
        int64_t m = 0;
        for (int64_t s = 0; s < c->n; s++)
            if (!kvref_attn_hidden(c, s)) keep[m++] = s;
        for (int64_t i = 0; i < c->nrows - c->n + m; i++) {
            const int64_t s = i < m ? keep[i] : c->n + i - m;
            row[i] = c->row[s];
            srow[i] = v_type == KVREF_TYPE_I8 ? c->srow[s] : 0; /* srow is unwritten without I8 */
        }
        vis.row = row;
        vis.srow = srow;
        vis.nrows = c->nrows - c->n + m;
        vis.n = m;
        vis.all = 1;
    }
    for (int64_t g0 = 0; g0 < a->G; g0 += step) {
        const int64_t gb = a->G - g0 < step ? a->G - g0 : step;
        const float *pg = p + g0 * C;
        if (!c->all) {
            for (int64_t g = 0; g < gb; g++)
                for (int64_t i = 0; i < vis.n; i++) pv[g * C + i] = pg[g * C + keep[i]];
            pg = pv;
        }
        float *ag = acc + g0 * D;
        for (int64_t j0 = 0; j0 < nvec; j0 += 4) {
            const int ahead = g0 == 0 && j0 == 0;
            if (full && nvec % 4 == 0) {
                if (gb == 1) pv_visible(a, &vis, pg, ag, j0, ahead, v_type, 1, (__mmask16)0xffff, 1);
                else if (gb == 2) pv_visible(a, &vis, pg, ag, j0, ahead, v_type, 1, (__mmask16)0xffff, 2);
                else if (gb == 3) pv_visible(a, &vis, pg, ag, j0, ahead, v_type, 1, (__mmask16)0xffff, 3);
                else pv_visible(a, &vis, pg, ag, j0, ahead, v_type, 1, (__mmask16)0xffff, 4);
            } else {
                if (gb == 1) pv_visible(a, &vis, pg, ag, j0, ahead, v_type, 0, last, 1);
                else if (gb == 2) pv_visible(a, &vis, pg, ag, j0, ahead, v_type, 0, last, 2);
                else if (gb == 3) pv_visible(a, &vis, pg, ag, j0, ahead, v_type, 0, last, 3);
                else pv_visible(a, &vis, pg, ag, j0, ahead, v_type, 0, last, 4);
            }
        }
    }
}

/* ---- KIVI4 (kvref/cache/quant.py; the skeleton hands them over when 32 divides head_dim and the
 * group size, the table's kivi_lanes: 16 nibble bytes are 32 elements of one V group) ------------
 * They work in "split order": the 32 elements of 16 nibble bytes as two vectors, the even elements
 * (low nibbles) then the odd ones (high nibbles), one widening and a mask or a shift each; q' and the
 * V accumulators are permuted into that order once per run of keys instead. */

/* The levels of nibble bytes b[0..16) in split order: even = elements 0, 2, .., 30; odd = 1, 3, .., 31 */
TARGET static inline void kivi_levels(const uint8_t *b, __m512 *even, __m512 *odd) {
    const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)b));
    *even = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)));
    *odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
}

/* natural order (x0 = elements 0-15, x1 = 16-31) <-> split order (even, odd) */
TARGET static inline void kivi_split(__m512 x0, __m512 x1, __m512 *even, __m512 *odd) {
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    *even = _mm512_permutex2var_ps(x0, ie, x1);
    *odd = _mm512_permutex2var_ps(x0, _mm512_add_epi32(ie, _mm512_set1_epi32(1)), x1);
}

TARGET static inline void kivi_merge(__m512 even, __m512 odd, __m512 *x0, __m512 *x1) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    *x0 = _mm512_permutex2var_ps(even, lo, odd);
    *x1 = _mm512_permutex2var_ps(even, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), odd);
}

#define KIVI_MAX_VECTORS 16 /* D <= 256: 16 vectors of q' per head */

/* Scores of nk keys (rows row[0..nk)) of one quantized group for gb heads: q' [gb][nv] in split order,
 * zero[gb] = q . zero; each key's levels widened once for the gb heads, one transposing reduction per
 * head (of 8 vectors: zeros past nk). */
TARGET __attribute__((always_inline)) static inline void kivi_score_keys(
    const kvref_attn_args *a, const __m512 qs[3][KIVI_MAX_VECTORS], const float *zero, const uint8_t *kb,
    const int64_t *row, float *p, const int gb, const int nk, const int64_t nv) {
    const int64_t C = KVREF_ATTN_CHUNK;
    __m512 d[3][8];
    for (int g = 0; g < gb; g++)
        for (int r = 0; r < 8; r++) d[g][r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nv; j += 2)
        for (int r = 0; r < nk; r++) {
            __m512 even, odd;
            kivi_levels(kb + row[r] / 2 + 8 * j, &even, &odd);
            for (int g = 0; g < gb; g++)
                d[g][r] = _mm512_fmadd_ps(qs[g][j + 1], odd, _mm512_fmadd_ps(qs[g][j], even, d[g][r]));
        }
    for (int g = 0; g < gb; g++) {
        __m256 sg = _mm256_mul_ps(_mm256_add_ps(reduce8(d[g]), _mm256_set1_ps(zero[g])), _mm256_set1_ps(a->scale));
        sg = _mm256_fmadd_ps(sg, _mm256_setzero_ps(), sg); /* kvref_attn_score_value: non-finite -> NaN */
        float out[8];
        _mm256_storeu_ps(out, sg);
        for (int r = 0; r < nk; r++) p[g * C + r] = out[r];
    }
}

/* Scores of the keys s .. end-1 of a chunk, one quantized group (params [2, D]: its channels' scales,
 * then zeros), for the G heads: per block of up to 3 heads, q' = q * scale (split order) and q . zero
 * once, then 8 keys at a time. nv = D / 16, a constant where it matters (the vectors stay in registers). */
TARGET __attribute__((always_inline)) static inline void kivi_score_run(
    const kvref_attn_args *a, const kvref_attn_chunk *c, const float *params, int64_t s, int64_t end, float *p,
    const int64_t nv) {
    const int64_t G = a->G, D = a->D, C = KVREF_ATTN_CHUNK;
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
        const int gb = G - g0 < 3 ? (int)(G - g0) : 3;
        __m512 qs[3][KIVI_MAX_VECTORS];
        float zero[3];
        for (int g = 0; g < gb; g++) {
            const float *q = c->q + (g0 + g) * D;
            __m512 z = _mm512_setzero_ps();
            for (int64_t j = 0; j < nv; j += 2) {
                const __m512 q0 = _mm512_loadu_ps(q + 16 * j), q1 = _mm512_loadu_ps(q + 16 * j + 16);
                z = _mm512_fmadd_ps(q0, _mm512_loadu_ps(params + D + 16 * j), z);
                z = _mm512_fmadd_ps(q1, _mm512_loadu_ps(params + D + 16 * j + 16), z);
                kivi_split(_mm512_mul_ps(q0, _mm512_loadu_ps(params + 16 * j)),
                           _mm512_mul_ps(q1, _mm512_loadu_ps(params + 16 * j + 16)), &qs[g][j], &qs[g][j + 1]);
            }
            zero[g] = _mm512_reduce_add_ps(z);
        }
        float *pg = p + g0 * C;
        int64_t t = s;
        for (; t + 8 <= end; t += 8) {
            if (g0 == 0) /* the keys a chunk ahead */
                for (int64_t r = t + KVREF_ATTN_PREFETCH_KEYS; r < t + KVREF_ATTN_PREFETCH_KEYS + 8 && r < c->nrows; r++)
                    __builtin_prefetch(c->k + c->row[r] / 2, 0, 2);
            switch (gb) {
            case 1: kivi_score_keys(a, qs, zero, c->k, c->row + t, pg + t, 1, 8, nv); break;
            case 2: kivi_score_keys(a, qs, zero, c->k, c->row + t, pg + t, 2, 8, nv); break;
            default: kivi_score_keys(a, qs, zero, c->k, c->row + t, pg + t, 3, 8, nv);
            }
        }
        for (; t < end; t++) switch (gb) {
            case 1: kivi_score_keys(a, qs, zero, c->k, c->row + t, pg + t, 1, 1, nv); break;
            case 2: kivi_score_keys(a, qs, zero, c->k, c->row + t, pg + t, 2, 1, nv); break;
            default: kivi_score_keys(a, qs, zero, c->k, c->row + t, pg + t, 3, 1, nv);
            }
    }
}

/* Scores of a chunk's KIVI4 keys: runs of keys of one quantized group (kivi_score_run), and keys past
 * the last full group, float16 residual rows. Every key is scored (the skeleton hides the masked ones). */
TARGET static void score_kivi(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p) {
    const int64_t G = a->G, D = a->D, C = KVREF_ATTN_CHUNK, gs = a->group_size, HD = a->Hkv * D, nv = D / 16;
    const int64_t c0 = c->kp - a->k_positions, nq = a->S - a->S % gs, n = c->n;
    if (nv > KIVI_MAX_VECTORS) {
        kvref_attn_score_kivi_ref(a, c, p);
        return;
    }
    for (int64_t s = 0; s < n;) {
        const int64_t key = c0 + s;
        if (key >= nq) { /* a residual row */
            const uint16_t *r = c->k_residual + (key % gs) * HD;
            for (int64_t g = 0; g < G; g++) {
                __m512 d = _mm512_setzero_ps();
                for (int64_t j = 0; j < nv; j++)
                    d = _mm512_fmadd_ps(_mm512_loadu_ps(c->q + g * D + 16 * j),
                                        _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(r + 16 * j))), d);
                p[g * C + s] = kvref_attn_score_value(_mm512_reduce_add_ps(d) * a->scale);
            }
            s++;
            continue;
        }
        const int64_t group_end = (key / gs + 1) * gs < nq ? (key / gs + 1) * gs : nq;
        const int64_t end = group_end - c0 < n ? group_end - c0 : n;
        const float *params = c->k_scales + (c->row[s] / HD / gs) * a->Hkv * 2 * D;
        switch (nv) {
        case 2: kivi_score_run(a, c, params, s, end, p, 2); break;
        case 4: kivi_score_run(a, c, params, s, end, p, 4); break;
        case 8: kivi_score_run(a, c, params, s, end, p, 8); break;
        default: kivi_score_run(a, c, params, s, end, p, nv);
        }
        s = end;
    }
}

/* acc += p V over a chunk's KIVI4 values for heads g0 .. g0+gb-1: their accumulators held in
 * registers in split order over the chunk's keys, each key's V widened once (its group's scale and zero
 * applied), added to acc at the end. gb and nv = D / 16 are constants where it matters. */
TARGET __attribute__((always_inline)) static inline void kivi_values_heads(
    const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc, int64_t g0, const int gb,
    const int64_t nv) {
    const int64_t D = a->D, C = KVREF_ATTN_CHUNK, gs = a->group_size;
    __m512 sum[3][KIVI_MAX_VECTORS];
    for (int g = 0; g < gb; g++)
        for (int64_t j = 0; j < nv; j++) sum[g][j] = _mm512_setzero_ps();
    for (int64_t s = 0; s < c->n; s++) {
        if (!c->all && kvref_attn_hidden(c, s)) continue;
        const uint8_t *vb = c->v + c->row[s] / 2;
        const float *pairs = c->v_scales + 2 * c->srow[s]; /* [D / gs, 2] */
        if (g0 == 0 && s + KVREF_ATTN_PREFETCH_KEYS < c->nrows)
            __builtin_prefetch(c->v + c->row[s + KVREF_ATTN_PREFETCH_KEYS] / 2, 0, 2);
        __m512 pg[3];
        for (int g = 0; g < gb; g++) pg[g] = _mm512_set1_ps(p[(g0 + g) * C + s]);
        for (int64_t j = 0; j < nv; j += 2) {
            const int64_t grp = 16 * j / gs;
            const __m512 sc = _mm512_set1_ps(pairs[2 * grp]), zr = _mm512_set1_ps(pairs[2 * grp + 1]);
            __m512 even, odd;
            kivi_levels(vb + 8 * j, &even, &odd);
            even = _mm512_fmadd_ps(even, sc, zr);
            odd = _mm512_fmadd_ps(odd, sc, zr);
            for (int g = 0; g < gb; g++) {
                sum[g][j] = _mm512_fmadd_ps(pg[g], even, sum[g][j]);
                sum[g][j + 1] = _mm512_fmadd_ps(pg[g], odd, sum[g][j + 1]);
            }
        }
    }
    for (int g = 0; g < gb; g++)
        for (int64_t j = 0; j < nv; j += 2) {
            float *ag = acc + (g0 + g) * D + 16 * j;
            __m512 x0, x1;
            kivi_merge(sum[g][j], sum[g][j + 1], &x0, &x1);
            _mm512_storeu_ps(ag, _mm512_add_ps(_mm512_loadu_ps(ag), x0));
            _mm512_storeu_ps(ag + 16, _mm512_add_ps(_mm512_loadu_ps(ag + 16), x1));
        }
}

TARGET __attribute__((always_inline)) static inline void kivi_values_nv(
    const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc, const int64_t nv) {
    for (int64_t g0 = 0; g0 < a->G; g0 += 3) switch (a->G - g0) {
        case 1: kivi_values_heads(a, c, p, acc, g0, 1, nv); break;
        case 2: kivi_values_heads(a, c, p, acc, g0, 2, nv); break;
        default: kivi_values_heads(a, c, p, acc, g0, 3, nv);
        }
}

/* acc += p V for a chunk's KIVI4 values, per block of up to 3 heads */
TARGET static void values_kivi(const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc) {
    switch (a->D / 16) {
    case 2: kivi_values_nv(a, c, p, acc, 2); break;
    case 4: kivi_values_nv(a, c, p, acc, 4); break;
    case 8: kivi_values_nv(a, c, p, acc, 8); break;
    default:
        if (a->D / 16 > KIVI_MAX_VECTORS) kvref_attn_values_kivi_ref(a, c, p, acc);
        else kivi_values_nv(a, c, p, acc, a->D / 16);
    }
}

/* One instantiation per element type (and, for the float types, per `full`): the type must be a
 * compile-time constant, or every K/V load would test it. I8 always has 16 | D here; an I8 K is
 * scored with integers (the AVX2 kernel here; attn_score_vnni where the CPU has VNNI). */
TARGET static void attn_score(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p) {
    const int full = a->D % 16 == 0;
    switch (a->k_type) {
    case KVREF_TYPE_KIVI4: score_kivi(a, c, p); break;
    case KVREF_TYPE_I8: kvref_avx2_attn_score_i8(a, c, p); break;
    case KVREF_TYPE_F16:
        if (full) score_typed(a, c, p, KVREF_TYPE_F16, 1);
        else score_typed(a, c, p, KVREF_TYPE_F16, 0);
        break;
    case KVREF_TYPE_BF16:
        if (full) score_typed(a, c, p, KVREF_TYPE_BF16, 1);
        else score_typed(a, c, p, KVREF_TYPE_BF16, 0);
        break;
    default:
        if (full) score_typed(a, c, p, KVREF_TYPE_F32, 1);
        else score_typed(a, c, p, KVREF_TYPE_F32, 0);
    }
}

TARGET static void attn_values(const kvref_attn_args *a, const kvref_attn_chunk *c, const float *p, float *acc) {
    const int full = a->Dv % 16 == 0;
    switch (a->v_type) {
    case KVREF_TYPE_KIVI4: values_kivi(a, c, p, acc); break;
    case KVREF_TYPE_I8: pv_typed(a, c, p, acc, KVREF_TYPE_I8, 1); break;
    case KVREF_TYPE_F16:
        if (full) pv_typed(a, c, p, acc, KVREF_TYPE_F16, 1);
        else pv_typed(a, c, p, acc, KVREF_TYPE_F16, 0);
        break;
    case KVREF_TYPE_BF16:
        if (full) pv_typed(a, c, p, acc, KVREF_TYPE_BF16, 1);
        else pv_typed(a, c, p, acc, KVREF_TYPE_BF16, 0);
        break;
    default:
        if (full) pv_typed(a, c, p, acc, KVREF_TYPE_F32, 1);
        else pv_typed(a, c, p, acc, KVREF_TYPE_F32, 0);
    }
}

/* each head's max and exponentials 16 keys at a time, the last vector masked (its masked-off lanes
 * add 0 to the sum) */
TARGET static void attn_exp(int64_t G, int64_t n, const float *m, float *p, float *mnew, float *sum) {
    for (int64_t g = 0; g < G; g++) {
        float *pg = p + g * KVREF_ATTN_CHUNK;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int64_t s = 0; s < n; s += 16) {
            const __mmask16 mk = n - s >= 16 ? (__mmask16)0xffff : tail_mask(n - s);
            vmax = _mm512_mask_max_ps(vmax, mk, vmax, _mm512_maskz_loadu_ps(mk, pg + s));
        }
        const float cmax = _mm512_reduce_max_ps(vmax);
        const float mx = cmax > m[g] ? cmax : m[g];
        const __m512 vm = _mm512_set1_ps(mx);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t s = 0; s < n; s += 16) {
            const __mmask16 mk = n - s >= 16 ? (__mmask16)0xffff : tail_mask(n - s);
            const __m512 e = _mm512_maskz_mov_ps(mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, pg + s), vm)));
            _mm512_mask_storeu_ps(pg + s, mk, e);
            vsum = _mm512_add_ps(vsum, e);
        }
        mnew[g] = mx;
        sum[g] = _mm512_reduce_add_ps(vsum);
    }
}

/* ---- 8-bit activations ------------------------------------------------------------------- */

/* the scalar kernel's blocks: the same d, 1/d and rint (cvtps rounds to nearest even) */
TARGET static void quantize_q8(int64_t K, const float *x, int8_t *qs, float *ds) {
    for (int64_t b = 0; b < K / 32; b++, x += 32, qs += 32, ds += 2) {
        const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
        float d, id;
        /* fpclass: quiet NaN, +inf, -inf, signalling NaN; an integer constant expression (a const int
         * is not one, and Clang refuses it as the immediate) */
        enum { bad = 0x01 | 0x08 | 0x10 | 0x80 };
        const int finite = (_mm512_fpclass_ps_mask(v0, bad) | _mm512_fpclass_ps_mask(v1, bad)) == 0;
        kvref_q8_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))), finite, &d, &id);
        const __m512 vid = _mm512_set1_ps(id), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
        /* min(v, hi) returns hi for NaN, as the scalar kernel maps NaN to 127 */
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(v0, vid), hi), lo));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(v1, vid), hi), lo));
        _mm_storeu_si128((__m128i *)qs, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(qs + 16), _mm512_cvtepi32_epi8(q1));
        ds[0] = d;
        ds[1] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

TARGET static void to_fp16(int64_t n, const float *x, uint16_t *out) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) out[i] = kvref_fp32_to_fp16(x[i]);
}

/* VNNI: vpdpbusd sums four unsigned x signed byte products per int32 lane in one instruction. */
#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

/* ---- packed weights (internal.h): 16 rows per vector, one lane each -------------------------- */

/* What the high-nibble vectors hold, times their values: the 4-bit types (no high bits to add) leave
 * them in place, 16 u, one operation a vector fewer; the sums of values 16-31 are then 16 times
 * theirs, which an exact shift takes back (|16 u x| sums stay below 2**20). */
static inline int32_t high_nibble_scale(int32_t type) {
    return type == KVREF_TYPE_Q4_0 || type == KVREF_TYPE_Q4_1 || type == KVREF_TYPE_Q4_K ? 16 : 1;
}

/* the 8 value vectors of a packed record: u[v] holds values 4v .. 4v+3 of row r in lane r (times
 * high_nibble_scale for v >= 4) */
TARGET_VNNI static ALWAYS_INLINE void packed_values(int32_t type, const uint8_t *rec, __m512i u[8]) {
    const uint8_t *vals = rec + kvref_pack_values_at(type);
    if (type == KVREF_TYPE_Q8_0) {
        for (int v = 0; v < 8; v++) u[v] = _mm512_loadu_si512(vals + 64 * v);
        return;
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m512i b = _mm512_loadu_si512(vals + 64 * j);
        u[j] = _mm512_and_si512(b, low4);
        u[j + 4] = high_nibble_scale(type) == 16 ? _mm512_andnot_si512(low4, b) : _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
    }
    const uint8_t *high = rec + kvref_pack_planes_at(type);
    if (type == KVREF_TYPE_Q5_0) /* bit 4 from its masks */
        for (int v = 0; v < 8; v++) {
            uint64_t mask;
            memcpy(&mask, high + 8 * v, 8);
            u[v] = _mm512_mask_add_epi8(u[v], (__mmask64)mask, u[v], _mm512_set1_epi8(16));
        }
    if (type == KVREF_TYPE_Q6_K) /* bits 4-5: field v % 4 of vector v / 4 moved to bits 4-5, or-ed in */
        for (int g = 0; g < 2; g++) {
            const __m512i h = _mm512_loadu_si512(high + 64 * g), bits45 = _mm512_set1_epi8(0x30);
            const __m512i at45[4] = {_mm512_slli_epi16(h, 4), _mm512_slli_epi16(h, 2), h, _mm512_srli_epi16(h, 2)};
            for (int k = 0; k < 4; k++) u[4 * g + k] = _mm512_ternarylogic_epi32(u[4 * g + k], at45[k], bits45, 0xF8);
        }
}

/* 16 bytes of a K-quant header as float32: unsigned (Q4_K's scales and mins) or signed (Q6_K's scales) */
TARGET_VNNI static ALWAYS_INLINE __m512 header_bytes(const uint8_t *p, const int is_signed) {
    const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)p);
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

TARGET_VNNI static ALWAYS_INLINE __m512 fp16x16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)p));
}

/* a Q4_K header's 12 planes (internal.h) -> sm: the 16 rows' sc [8][16], then m [8][16], a byte
 * each; planes 0-3, 4-7 and 8-11 are one vector each */
TARGET_VNNI static ALWAYS_INLINE void q4k_header_scales_mins(const uint8_t *h, uint8_t sm[256]) {
    const __m512i p0 = _mm512_loadu_si512(h + 64), p4 = _mm512_loadu_si512(h + 128), p8 = _mm512_loadu_si512(h + 192);
    const __m512i six = _mm512_set1_epi8(63), low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    _mm512_store_si512(sm, _mm512_and_si512(p0, six));
    _mm512_store_si512(sm + 64, _mm512_or_si512(_mm512_and_si512(p8, low), _mm512_and_si512(_mm512_srli_epi16(p0, 2), top)));
    _mm512_store_si512(sm + 128, _mm512_and_si512(p4, six));
    _mm512_store_si512(sm + 192, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(p8, 4), low),
                                                 _mm512_and_si512(_mm512_srli_epi16(p4, 2), top)));
}

/* the 16 rows' scales of record j of a span (header h, record rec, Q4_K's sm unpacked from h):
 * s[0] d (Q6_K: of values 0-15), s[1] m (Q6_K: d of 16-31); the K-quants' from the header's d (and
 * -dmin, nd), each product exact */
TARGET_VNNI static ALWAYS_INLINE void packed_scales(int32_t type, const uint8_t *h, const uint8_t *sm, const uint8_t *rec,
                                                    int64_t j, __m512 d, __m512 nd, __m512 s[2]) {
    if (type == KVREF_TYPE_Q4_K) {
        s[0] = _mm512_mul_ps(d, header_bytes(sm + 16 * j, 0));
        s[1] = _mm512_mul_ps(nd, header_bytes(sm + 128 + 16 * j, 0));
    } else if (type == KVREF_TYPE_Q6_K) {
        s[0] = _mm512_mul_ps(d, header_bytes(h + 32 + 32 * j, 1));
        s[1] = _mm512_mul_ps(d, header_bytes(h + 48 + 32 * j, 1));
    } else {
        s[0] = fp16x16(rec);
        if (type == KVREF_TYPE_Q4_1) s[1] = fp16x16(rec + 32);
    }
}

/* R rows of x against one packed group: per block, the record's values decoded once, then per row
 * of x eight four-byte dot products (x's four bytes broadcast; values 0-15 and 16-31 in two
 * chains), the bias off, and the scalar kernel's fused multiply-adds, lane r for weight row r. */
TARGET_VNNI static ALWAYS_INLINE void packed_dot_rows(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs,
                                                      const float *ds, const int32_t *xsum, const int R, float *out) {
    const int64_t nb = K / 32, rec_bytes = kvref_pack_record_bytes(type), span = kvref_pack_span(type);
    const int64_t header = kvref_pack_header_bytes(type);
    const int32_t bias = kvref_pack_bias(type);
    __m512 acc[8];
    _Alignas(64) uint8_t sm[256];
    UNROLL_ROWS
    for (int t = 0; t < R; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += span) {
        const uint8_t *h = kvref_pack_header(type, group, b0);
        __m512 d = _mm512_setzero_ps(), nd = _mm512_setzero_ps();
        if (kvref_pack_kquant(type)) d = fp16x16(h);
        if (type == KVREF_TYPE_Q4_K) {
            nd = _mm512_xor_ps(fp16x16(h + 32), _mm512_set1_ps(-0.0f));
            q4k_header_scales_mins(h, sm);
        }
        for (int64_t j = 0; j < span; j++) {
            const int64_t b = b0 + j;
            const uint8_t *rec = h + header + j * rec_bytes;
            if (R >= 4) kvref_pack_prefetch(rec + KVREF_PACK_PREFETCH_RECORDS * rec_bytes, rec_bytes);
            __m512i u[8];
            packed_values(type, rec, u);
            __m512 sc[2];
            packed_scales(type, h, sm, rec, j, d, nd, sc);
            UNROLL_ROWS
            for (int t = 0; t < R; t++) {
                const int8_t *x = qs + t * K + 32 * b;
                const int32_t *xs = xsum + t * (K / 16) + 2 * b;
                const int32_t hs = high_nibble_scale(type);
                __m512i half[2] = {_mm512_set1_epi32(-bias * xs[0]), _mm512_set1_epi32(-bias * hs * xs[1])};
                for (int v = 0; v < 8; v++) {
                    int32_t x4;
                    memcpy(&x4, x + 4 * v, 4);
                    half[v / 4] = _mm512_dpbusd_epi32(half[v / 4], u[v], _mm512_set1_epi32(x4));
                }
                if (hs == 16) half[1] = _mm512_srai_epi32(half[1], 4);
                const __m512 dx = _mm512_set1_ps(ds[(t * nb + b) * 2]);
                if (type == KVREF_TYPE_Q6_K) { /* a scale per 16 values */
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(half[0]), _mm512_mul_ps(dx, sc[0]), acc[t]);
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(half[1]), _mm512_mul_ps(dx, sc[1]), acc[t]);
                    continue;
                }
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(half[0], half[1])), _mm512_mul_ps(dx, sc[0]), acc[t]);
                if (type == KVREF_TYPE_Q4_1 || type == KVREF_TYPE_Q4_K)
                    acc[t] = _mm512_fmadd_ps(sc[1], _mm512_set1_ps(ds[(t * nb + b) * 2 + 1]), acc[t]);
            }
        }
    }
    UNROLL_ROWS
    for (int t = 0; t < R; t++) _mm512_storeu_ps(out + KVREF_PACK_ROWS * t, acc[t]);
}

/* T <= 8 rows of x in blocks of 8, 4, 2, 1 (each row's operations are the same in any) */
TARGET_VNNI static ALWAYS_INLINE void packed_dot_type(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs,
                                                      const float *ds, const int32_t *xsum, int64_t T, float *out) {
    const int64_t nd = K / 16; /* ds and xsum per row of x */
    int64_t t = 0;
    for (; t + 8 <= T; t += 8) packed_dot_rows(type, K, group, qs + t * K, ds + t * nd, xsum + t * nd, 8, out + 16 * t);
    for (; t + 4 <= T; t += 4) packed_dot_rows(type, K, group, qs + t * K, ds + t * nd, xsum + t * nd, 4, out + 16 * t);
    for (; t + 2 <= T; t += 2) packed_dot_rows(type, K, group, qs + t * K, ds + t * nd, xsum + t * nd, 2, out + 16 * t);
    for (; t < T; t++) packed_dot_rows(type, K, group, qs + t * K, ds + t * nd, xsum + t * nd, 1, out + 16 * t);
}

TARGET_VNNI static void packed_dot_vnni(int32_t type, int64_t K, const uint8_t *group, const int8_t *qs,
                                        const float *ds, const int32_t *xsum, int64_t T, float *out) {
    switch (type) { /* the type a constant in each copy */
    case KVREF_TYPE_Q4_0: packed_dot_type(KVREF_TYPE_Q4_0, K, group, qs, ds, xsum, T, out); break;
    case KVREF_TYPE_Q4_1: packed_dot_type(KVREF_TYPE_Q4_1, K, group, qs, ds, xsum, T, out); break;
    case KVREF_TYPE_Q5_0: packed_dot_type(KVREF_TYPE_Q5_0, K, group, qs, ds, xsum, T, out); break;
    case KVREF_TYPE_Q8_0: packed_dot_type(KVREF_TYPE_Q8_0, K, group, qs, ds, xsum, T, out); break;
    case KVREF_TYPE_Q4_K: packed_dot_type(KVREF_TYPE_Q4_K, K, group, qs, ds, xsum, T, out); break;
    default: packed_dot_type(KVREF_TYPE_Q6_K, K, group, qs, ds, xsum, T, out);
    }
}

/* ---- 8-bit GEMM on 8-bit tiles (internal.h) ---------------------------------------------- */

_Static_assert(KVREF_Q8_TILE_RECORD(16) % 64 == 0 && KVREF_Q8_TILE_RECORD(32) % 64 == 0,
               "tile records keep 64-byte alignment");
/* Rows of x per block: 12 integer and 12 float accumulators, two weight vectors and a broadcast */
#define GEMM_Q8_ROWS 6

/* y[i, n] for the R rows of x at xu (row stride K bytes) and n below the masks' lanes: per block,
 * integer sums start from the tile's zero correction and take eight four-byte dot products (one
 * x lane broadcast against a vector of weight lanes), then one fused multiply-add by d_x d_w (and
 * one by m_w s_x) into the float sums, in block order: the scalar kernel's operations. */
TARGET_VNNI static inline __attribute__((always_inline)) void gemm_q8_block(
    int64_t K, const uint8_t *xu, const float *xds, const int R, const uint8_t *tile, const int bv, int affine,
    __mmask16 m0, __mmask16 m1, float *y, int64_t ldy) {
    const int64_t nb = K / 32;
    __m512 acc[GEMM_Q8_ROWS][2];
    for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t r = 0; r < K / bv; r++) {
        const uint8_t *rec = tile + r * KVREF_Q8_TILE_RECORD(bv);
        const int64_t b = r * bv / 32, x0 = r * bv; /* x's block, and the record's first value */
        const __m512i z0 = _mm512_load_si512(rec + KVREF_Q8_TILE_ZERO(bv));
        const __m512i z1 = _mm512_load_si512(rec + KVREF_Q8_TILE_ZERO(bv) + 64);
        __m512i isum[GEMM_Q8_ROWS][2];
        for (int i = 0; i < R; i++) isum[i][0] = z0, isum[i][1] = z1;
        for (int s = 0; s < bv / 4; s++) {
            const __m512i w0 = _mm512_load_si512(rec + s * 4 * KVREF_TILE_N);
            const __m512i w1 = _mm512_load_si512(rec + s * 4 * KVREF_TILE_N + 64);
            for (int i = 0; i < R; i++) {
                int32_t x4;
                memcpy(&x4, xu + i * K + x0 + 4 * s, 4);
                const __m512i xv = _mm512_set1_epi32(x4);
                isum[i][0] = _mm512_dpbusd_epi32(isum[i][0], xv, w0);
                isum[i][1] = _mm512_dpbusd_epi32(isum[i][1], xv, w1);
            }
        }
        const __m512 d0 = _mm512_load_ps(rec + KVREF_Q8_TILE_D(bv)), d1 = _mm512_load_ps(rec + KVREF_Q8_TILE_D(bv) + 64);
        for (int i = 0; i < R; i++) {
            const __m512 dx = _mm512_set1_ps(xds[(i * nb + b) * 2]);
            acc[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i][0]), _mm512_mul_ps(dx, d0), acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i][1]), _mm512_mul_ps(dx, d1), acc[i][1]);
        }
        if (affine) {
            const __m512 mw0 = _mm512_load_ps(rec + KVREF_Q8_TILE_M(bv)), mw1 = _mm512_load_ps(rec + KVREF_Q8_TILE_M(bv) + 64);
            for (int i = 0; i < R; i++) {
                const __m512 sx = _mm512_set1_ps(xds[(i * nb + b) * 2 + 1]);
                acc[i][0] = _mm512_fmadd_ps(mw0, sx, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(mw1, sx, acc[i][1]);
            }
        }
    }
    for (int i = 0; i < R; i++) {
        _mm512_mask_storeu_ps(y + i * ldy, m0, acc[i][0]);
        _mm512_mask_storeu_ps(y + i * ldy + 16, m1, acc[i][1]);
    }
}

/* The 32 integers of block b of a weight row (kvref_q8_weight_block's values) in one vector. */
TARGET_VNNI static inline __m256i q8_block_values(int32_t type, const uint8_t *row, int64_t b) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    if (type == KVREF_TYPE_Q4_K) {
        const uint8_t *qs = row + b / 8 * BYTES_Q4_K + 16 + 32 * (b % 8 / 2);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)qs);
        return _mm256_and_si256(_mm256_srli_epi16(v, 4 * (int)(b % 2)), _mm256_set1_epi8(0x0F));
    }
    const uint8_t *w = row + b * kvref_q8_block_bytes(type);
    if (type == KVREF_TYPE_Q8_0) return _mm256_loadu_si256((const __m256i *)(const void *)(w + 2));
    const int at = type == KVREF_TYPE_Q4_0 ? 2 : type == KVREF_TYPE_Q4_1 ? 4 : 6; /* the nibble bytes */
    const __m128i q = _mm_loadu_si128((const __m128i *)(const void *)(w + at));
    __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(q, low4)),
                                        _mm_and_si128(_mm_srli_epi16(q, 4), low4), 1);
    switch (type) {
    case KVREF_TYPE_Q4_0: return _mm256_sub_epi8(v, _mm256_set1_epi8(8));
    case KVREF_TYPE_Q5_0: /* value j's fifth bit is bit j of qh */
        v = _mm256_mask_add_epi8(v, (__mmask32)kvref_q5_high_bits(w), v, _mm256_set1_epi8(16));
        return _mm256_sub_epi8(v, _mm256_set1_epi8(16));
    default: return v; /* Q4_1 */
    }
}

/* 16 weight rows' blocks (the values of row i in lanes 0-7 of r[i], four per dword) -> out[s]: dword
 * s of each row, row i in lane i: pairs of rows share a vector, then an 8 x 8 dword transpose in
 * each 256-bit half (unpacks of dwords and qwords, then 128-bit lanes paired across vectors) */
TARGET_VNNI static inline void q8_transpose16x8(const __m256i *r, __m512i *out) {
    __m512i a[8], t[8], u[8];
    for (int j = 0; j < 8; j++) a[j] = _mm512_inserti64x4(_mm512_castsi256_si512(r[j]), r[j + 8], 1);
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm512_unpacklo_epi32(a[j], a[j + 1]);
        t[j + 1] = _mm512_unpackhi_epi32(a[j], a[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
        u[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);     /* dwords 0 | 4 of rows j .. j+3 */
        u[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]); /* 1 | 5 */
        u[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]); /* 2 | 6 */
        u[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]); /* 3 | 7 */
    }
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int s = 0; s < 4; s++) {
        out[s] = _mm512_permutex2var_epi64(u[s], first, u[s + 4]);
        out[s + 4] = _mm512_permutex2var_epi64(u[s], second, u[s + 4]);
    }
}

/* matmul.c's portable q8_tile for the 32-value types: the same bytes. Each row is decoded whole,
 * in memory order (the tile's rows are one run of bytes the prefetchers follow), into `stage`;
 * then sixteen rows' blocks at a time are transposed into the tile. */
TARGET_VNNI static void q8_tile_vnni(int32_t type, int64_t K, const uint8_t *w, int64_t rb, int64_t nw, uint8_t *tile) {
    const int64_t nb = K / 32;
    int8_t *stage = (int8_t *)(tile + nb * KVREF_Q8_TILE_RECORD(32)); /* [KVREF_TILE_N, K]: past the records */
    float *dm = (float *)(void *)(stage + KVREF_TILE_N * K);           /* [KVREF_TILE_N, nb, 2] */
    for (int64_t n = 0; n < KVREF_TILE_N; n++)
        for (int64_t b = 0; b < nb; b++) {
            float *d = dm + (n * nb + b) * 2;
            __m256i v = _mm256_setzero_si256();
            d[0] = d[1] = 0.0f;
            if (n < nw) {
                kvref_q8_block_scales(type, w + n * rb, b, &d[0], &d[1]);
                v = q8_block_values(type, w + n * rb, b);
            }
            _mm256_storeu_si256((__m256i *)(void *)(stage + n * K + 32 * b), v);
        }
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *rec = tile + b * KVREF_Q8_TILE_RECORD(32);
        for (int h = 0; h < KVREF_TILE_N; h += 16) {
            __m256i r[16];
            float d[16], m[16];
            for (int i = 0; i < 16; i++) {
                r[i] = _mm256_loadu_si256((const __m256i *)(const void *)(stage + (h + i) * K + 32 * b));
                d[i] = dm[((h + i) * nb + b) * 2];
                m[i] = dm[((h + i) * nb + b) * 2 + 1];
            }
            __m512i out[8], sum = _mm512_setzero_si512();
            q8_transpose16x8(r, out);
            for (int s = 0; s < 8; s++) {
                _mm512_store_si512(rec + s * 4 * KVREF_TILE_N + 4 * h, out[s]);
                sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), out[s]); /* each row's sum of values */
            }
            _mm512_store_si512(rec + KVREF_Q8_TILE_ZERO(32) + 4 * h, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7)));
            _mm512_store_ps(rec + KVREF_Q8_TILE_D(32) + 4 * h, _mm512_loadu_ps(d));
            _mm512_store_ps(rec + KVREF_Q8_TILE_M(32) + 4 * h, _mm512_loadu_ps(m));
        }
    }
}

/* the rows of x in blocks of GEMM_Q8_ROWS, then 2, then 1, for blocks of BV values */
#define GEMM_Q8_ROWS_OF(BV)                                                                              \
    do {                                                                                                 \
        for (; t + GEMM_Q8_ROWS <= T; t += GEMM_Q8_ROWS)                                                 \
            gemm_q8_block(K, xu + t * K, xds + t * nd, GEMM_Q8_ROWS, tile, BV, affine, m0, m1, y + t * ldy, ldy); \
        for (; t + 2 <= T; t += 2) gemm_q8_block(K, xu + t * K, xds + t * nd, 2, tile, BV, affine, m0, m1, y + t * ldy, ldy); \
        for (; t < T; t++) gemm_q8_block(K, xu + t * K, xds + t * nd, 1, tile, BV, affine, m0, m1, y + t * ldy, ldy); \
    } while (0)

TARGET_VNNI static void gemm_q8_vnni(int64_t K, const uint8_t *xu, const float *xds, int64_t T, const uint8_t *tile,
                                     int64_t bv, int64_t nw, int affine, float *y, int64_t ldy) {
    const __mmask16 m0 = tail_mask(nw < 16 ? nw : 16), m1 = tail_mask(nw > 16 ? nw - 16 : 0);
    const int64_t nd = K / 32 * 2; /* floats of xds per row */
    int64_t t = 0;
    if (bv == 32) GEMM_Q8_ROWS_OF(32);
    else GEMM_Q8_ROWS_OF(16);
}

/* ---- an I8 K's integer scoring with VNNI (internal.h, kvref_attn_score_fn) ------------------ */

/* Four keys' 64 K bytes r[0..4) -> u[m], m < 4, whose 128-bit lane L holds the four keys' dwords
 * 4L + m (key k in dword k of the lane): two rounds of unpacks. */
TARGET_VNNI static inline void transpose4x4(const __m512i *r, __m512i *u) {
    const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
    u[0] = _mm512_unpacklo_epi64(t0, t2);
    u[1] = _mm512_unpackhi_epi64(t0, t2);
    u[2] = _mm512_unpacklo_epi64(t1, t3);
    u[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* a[Q], Q < 4, 128-bit lanes L -> out[L] = (a[0] lane L, a[1] lane L, a[2] lane L, a[3] lane L) */
TARGET_VNNI static inline void transpose_lanes(const __m512i *a, __m512i *out) {
    const __m512i x0 = _mm512_shuffle_i32x4(a[0], a[1], 0x44), x1 = _mm512_shuffle_i32x4(a[0], a[1], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(a[2], a[3], 0x44), y1 = _mm512_shuffle_i32x4(a[2], a[3], 0xEE);
    out[0] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    out[1] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    out[2] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    out[3] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
}

/* Scores of the nk <= 16 keys s .. s + nk - 1 for heads g0 .. g0 + gb - 1 (gb <= 4), key 4Q + k in
 * lane 4Q + k. K is read 64 bytes of four keys at a time, transposed so that lane L of vector m
 * holds each key's dword 4L + m; vpdpbusd against the head's q8 laid out alike (dword 4L + m
 * repeated in lane L) sums, per key and 16-element chunk L, its 16 products in one lane; a lane
 * transpose then gives each chunk's sums of the 16 keys in one vector, and the chunks of a scale
 * group are added up. vpdpbusd multiplies unsigned by signed bytes: K is read as k + 128 (the sign
 * bit flipped) and 128 times the group's q8 sum is taken back out, exactly. At the end of each
 * group, the float32 operations of kvref_attn_score_i8_ref, in its order, on 16 keys at once. */
TARGET_VNNI __attribute__((always_inline)) static inline void score16_i8_vnni(
    const kvref_attn_args *a, const kvref_attn_chunk *c, int64_t s, int64_t nk, int64_t g0, const int gb, float *p) {
    const int64_t D = a->D, C = KVREF_ATTN_CHUNK, ng = D / a->group_size, per_group = a->group_size / 16;
    const int8_t *kb = (const int8_t *)c->k;
    int64_t rows[16], srows[16]; /* keys past nk read key s's K and scales (their lanes are not stored) */
    const int64_t *row = c->row + s, *srow = c->srow + s;
    if (nk < 16) {
        for (int i = 0; i < 16; i++) {
            rows[i] = row[i < nk ? i : 0];
            srows[i] = srow[i < nk ? i : 0];
        }
        row = rows;
        srow = srows;
    }
    const __m512i slo = _mm512_loadu_si512(srow), shi = _mm512_loadu_si512(srow + 8);
    __m512i gsum[4];
    __m512 score[4];
    for (int g = 0; g < gb; g++) {
        gsum[g] = _mm512_set1_epi32(-128 * c->qsum[(g0 + g) * ng]);
        score[g] = _mm512_setzero_ps();
    }
    int64_t b = 0, left = per_group; /* the scale group of the next 16 elements, and its chunks left */
    for (int64_t e0 = 0; e0 < D; e0 += 64) {
        const __mmask64 mk = D - e0 >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (D - e0)) - 1;
        __m512i qv[4][4], acc[4][4];
        for (int g = 0; g < gb; g++) {
            const __m512i q = _mm512_maskz_loadu_epi8(mk, c->q8 + (g0 + g) * D + e0);
            qv[g][0] = _mm512_shuffle_epi32(q, _MM_PERM_AAAA); /* dword 4L + m of lane L, in all of it */
            qv[g][1] = _mm512_shuffle_epi32(q, _MM_PERM_BBBB);
            qv[g][2] = _mm512_shuffle_epi32(q, _MM_PERM_CCCC);
            qv[g][3] = _mm512_shuffle_epi32(q, _MM_PERM_DDDD);
            for (int Q = 0; Q < 4; Q++) acc[g][Q] = _mm512_setzero_si512();
        }
        for (int Q = 0; Q < 4; Q++) {
            __m512i r[4], u[4];
            for (int k = 0; k < 4; k++)
                r[k] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mk, kb + row[4 * Q + k] + e0), _mm512_set1_epi8(-128));
            transpose4x4(r, u);
            for (int g = 0; g < gb; g++)
                for (int m = 0; m < 4; m++) acc[g][Q] = _mm512_dpbusd_epi32(acc[g][Q], u[m], qv[g][m]);
        }
        __m512i chunk[4][4];
        for (int g = 0; g < gb; g++) transpose_lanes(acc[g], chunk[g]);
        for (int64_t L = 0; L < 4 && e0 + 16 * L < D; L++) {
            for (int g = 0; g < gb; g++) gsum[g] = _mm512_add_epi32(gsum[g], chunk[g][L]);
            if (--left > 0) continue;
            left = per_group;
            const float *kd = c->k_scales + b;
            const __m512 ks = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_i64gather_ps(slo, kd, 4)),
                                                 _mm512_i64gather_ps(shi, kd, 4), 1);
            for (int g = 0; g < gb; g++) {
                const int64_t qg = (g0 + g) * ng + b;
                const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(c->qe[qg]), ks);
                score[g] = _mm512_add_ps(score[g], _mm512_mul_ps(_mm512_cvtepi32_ps(gsum[g]), scale));
                gsum[g] = _mm512_set1_epi32(b + 1 < ng ? -128 * c->qsum[qg + 1] : 0);
            }
            b++;
        }
    }
    const __mmask16 keep = tail_mask(nk);
    for (int g = 0; g < gb; g++) /* kvref_attn_score_value: non-finite -> NaN */
        _mm512_mask_storeu_ps(p + (g0 + g) * C + s, keep, _mm512_fmadd_ps(score[g], _mm512_setzero_ps(), score[g]));
}

/* An I8 K: the chunk's keys 16 at a time, up to the last visible one (every key's score is its own
 * lane's, so where the cut falls changes none), heads 4 at a time; every 8 keys, asks for the K of
 * the keys a chunk ahead. Float K types: attn_score. */
TARGET_VNNI static void attn_score_vnni(const kvref_attn_args *a, const kvref_attn_chunk *c, float *p) {
    if (a->k_type != KVREF_TYPE_I8) {
        attn_score(a, c, p);
        return;
    }
    int64_t n = c->n;
    while (!c->all && kvref_attn_hidden(c, n - 1)) n--; /* some key is visible */
    for (int64_t s = 0; s < n; s += 16) {
        kvref_attn_prefetch(c->k, a->k_type, a->D, c->row, s + KVREF_ATTN_PREFETCH_KEYS, c->nrows);
        kvref_attn_prefetch(c->k, a->k_type, a->D, c->row, s + 8 + KVREF_ATTN_PREFETCH_KEYS, c->nrows);
        kvref_attn_prefetch_scales(c, s + KVREF_ATTN_PREFETCH_KEYS);
        const int64_t nk = n - s < 16 ? n - s : 16;
        for (int64_t g0 = 0; g0 < a->G; g0 += 4)
            switch (a->G - g0) {
            case 1: score16_i8_vnni(a, c, s, nk, g0, 1, p); break;
            case 2: score16_i8_vnni(a, c, s, nk, g0, 2, p); break;
            case 3: score16_i8_vnni(a, c, s, nk, g0, 3, p); break;
            default: score16_i8_vnni(a, c, s, nk, g0, 4, p);
            }
    }
}

/* AVX-512 without VNNI: the packed 8-bit kernel is AVX2's (kernels_avx2.c) */
const kvref_kernels kvref_kernels_avx512 = {
    .isa = KVREF_ISA_AVX512,
    KVREF_SIMD_TABLE_COMMON,
    .attn = {.score = attn_score, .exp = attn_exp, .values = attn_values, .i8_lanes = 16,
             .kivi_lanes = 32},
    .packed_dot = kvref_avx2_packed_dot,
};

const kvref_kernels kvref_kernels_avx512_vnni = {
    .isa = KVREF_ISA_AVX512,
    KVREF_SIMD_TABLE_COMMON,
    .attn = {.score = attn_score_vnni, .exp = attn_exp, .values = attn_values, .i8_lanes = 16,
             .kivi_lanes = 32},
    .packed_dot = packed_dot_vnni,
    .gemm_q8 = gemm_q8_vnni,
    .q8_tile = q8_tile_vnni,
};

#endif /* KVREF_X86 */
