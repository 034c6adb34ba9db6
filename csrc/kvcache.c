/* kvcache.c: a KV cache's storage as the native kernels read and write it (kvref_kv in kvref.h).
 *
 * The stored forms are kvref/cache/quant.py's, byte for byte: a float16 is NumPy's astype rounding,
 * a bfloat16 the upper half of the float32 rounded to nearest even (NaN kept quiet), an int8 group
 * scale = max|x| / 127 with q = rint(x / scale) clipped to [-127, 127], a KIVI4 group zero = min,
 * scale = (max - min) / 15 with q = rint((x - zero) / scale) clipped to [0, 15]. So a cache filled by
 * the C forward and one filled by the Python cache layouts hold the same bytes.
 */
#include "internal.h"

static int mul_overflows(int64_t a, int64_t b) { return a > 0 && b > 0 && a > INT64_MAX / b; }

int kvref_kv_check(const kvref_kv *kv, int64_t n_layers, int64_t Hkv, int64_t D, int64_t positions) {
    if (kv == NULL || kv->k == NULL || kv->v == NULL) return KVREF_ERR_NULL;
    if (kvref_kv_element_bytes(kv->k_type) < 0 || kvref_kv_element_bytes(kv->v_type) < 0) return KVREF_ERR_TYPE;
    if (kv->n_layers < 0 || kv->n_slots < 0 || kv->n_kv_heads < 1 || kv->head_dim < 1 || positions < 0)
        return KVREF_ERR_DIM;
    if (kv->n_layers != n_layers || kv->n_kv_heads != Hkv || kv->head_dim != D) return KVREF_ERR_SHAPE;
    if (kv->v_dim < 0 || kv->v_dim > D) return KVREF_ERR_SHAPE;
    if (kv->v_dim != 0 && kv->v_dim != D && kv->v_type == KVREF_TYPE_KIVI4) return KVREF_ERR_SHAPE; /* whole vectors */
    int64_t slots = 0, plain = kv->n_layers; /* slots in all layers; layers without a ring */
    if (kv->layer_ring != NULL) {
        if (kv->block_table != NULL) return KVREF_ERR_SHAPE; /* a ring layout has no blocks */
        for (int64_t l = 0; l < kv->n_layers; l++) {
            const int64_t ring = kv->layer_ring[l], extent = ring > 0 ? ring : kv->n_slots;
            if (ring < 0) return KVREF_ERR_VALUE;
            if (extent > INT64_MAX - slots) return KVREF_ERR_DIM;
            slots += extent;
            plain -= ring > 0;
        }
    } else {
        if (mul_overflows(kv->n_layers, kv->n_slots)) return KVREF_ERR_DIM;
        slots = kv->n_layers * kv->n_slots;
    }
    if (mul_overflows(slots, Hkv) || mul_overflows(slots * Hkv, D * 4)) return KVREF_ERR_DIM;
    const int int8 = kv->k_type == KVREF_TYPE_I8 || kv->v_type == KVREF_TYPE_I8;
    const int kivi_k = kv->k_type == KVREF_TYPE_KIVI4, kivi = kivi_k || kv->v_type == KVREF_TYPE_KIVI4;
    if ((int8 || kivi) && (kv->group_size < 1 || D % kv->group_size != 0)) return KVREF_ERR_SHAPE;
    if (kivi && (D % 2 != 0 || kv->group_size > KVREF_KIVI_MAX_GROUP)) return KVREF_ERR_SHAPE; /* two nibbles a byte */
    if ((kivi_k && (kv->k_scales == NULL || kv->k_residual == NULL)) ||
        (kv->v_type == KVREF_TYPE_KIVI4 && kv->v_scales == NULL))
        return KVREF_ERR_NULL;
    if (kivi_k && (kv->layer_ring != NULL || (kv->block_table != NULL && kv->block_size % kv->group_size != 0)))
        return KVREF_ERR_SHAPE; /* a K group of positions lies in one block, and never in a ring */
    if ((kv->k_type == KVREF_TYPE_I8 && kv->k_scales == NULL) || (kv->v_type == KVREF_TYPE_I8 && kv->v_scales == NULL))
        return KVREF_ERR_NULL;
    if (kv->block_table == NULL) return positions <= kv->n_slots || plain == 0 ? KVREF_OK : KVREF_ERR_DIM;
    const int64_t bs = kv->block_size;
    if (bs < 1 || kv->n_blocks < 0 || kv->n_slots % bs != 0) return KVREF_ERR_SHAPE;
    const int64_t used = positions / bs + (positions % bs != 0);
    if (used > kv->n_blocks) return KVREF_ERR_DIM;
    for (int64_t b = 0; b < used; b++)
        if (kv->block_table[b] < 0 || kv->block_table[b] >= kv->n_slots / bs) return KVREF_ERR_VALUE;
    return KVREF_OK;
}

int64_t kvref_kv_ring(const kvref_kv *kv, int64_t layer) { return kv->layer_ring != NULL ? kv->layer_ring[layer] : 0; }

void kvref_kv_layer(const kvref_kv *kv, int64_t layer, kvref_attn_args *a) {
    int64_t first = 0; /* the layer's first slot: the extents of the layers before it */
    for (int64_t l = 0; l < layer; l++) first += kvref_kv_ring(kv, l) > 0 ? kvref_kv_ring(kv, l) : kv->n_slots;
    const int64_t vectors = first * kv->n_kv_heads; /* before the layer's */
    const int64_t ng = kv->group_size > 0 ? kv->head_dim / kv->group_size : 0;
    a->k = (const uint8_t *)kv->k + vectors * kvref_kv_vector_bytes(kv->k_type, kv->head_dim);
    a->v = (const uint8_t *)kv->v + vectors * kvref_kv_vector_bytes(kv->v_type, kv->head_dim);
    a->k_scales = kv->k_type == KVREF_TYPE_I8 ? kv->k_scales + vectors * ng : NULL;
    a->v_scales = kv->v_type == KVREF_TYPE_I8 ? kv->v_scales + vectors * ng
                  : kv->v_type == KVREF_TYPE_KIVI4 ? kv->v_scales + vectors * ng * 2 : NULL;
    a->k_residual = NULL;
    if (kv->k_type == KVREF_TYPE_KIVI4) { /* no rings: the layer's groups follow layer - 1's */
        const int64_t g = kv->group_size, groups = (kv->n_slots + g - 1) / g;
        a->k_scales = kv->k_scales + layer * groups * kv->n_kv_heads * 2 * kv->head_dim;
        a->k_residual = kv->k_residual + layer * g * kv->n_kv_heads * kv->head_dim;
    }
    a->k_type = kv->k_type;
    a->v_type = kv->v_type;
    a->group_size = kv->group_size;
    a->block_table = kv->block_table;
    a->block_size = kv->block_size;
    a->D = kv->head_dim;
    a->Dv = kv->v_dim > 0 ? kv->v_dim : kv->head_dim;
    a->Hkv = kv->n_kv_heads;
}

/* NumPy's to_bfloat16: round to nearest even on the upper 16 bits; a NaN stays a quiet NaN */
static uint16_t bf16_from_fp32(float f) {
    const uint32_t bits = kvref_bits_from_fp32(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x0040u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* NumPy's quantize_int8 for one group of g values: scale = max|x| / 127, q = rint(x / scale). As
 * np.max, the largest magnitude of a group holding a NaN is NaN: the scale is NaN and every value
 * the group decodes to is NaN, never a finite stand-in. */
static void int8_group(const float *x, int64_t g, int8_t *q, float *scale) {
    float amax = 0.0f;
    for (int64_t i = 0; i < g; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax || a != a ? a : amax; /* a NaN, once seen, stays: NaN > a is false */
    }
    *scale = amax / 127.0f;
    const float safe = *scale > 0.0f ? *scale : 1.0f; /* an all-zero group stores zeros */
    for (int64_t i = 0; i < g; i++) {
        const float r = rintf(x[i] / safe);
        q[i] = (int8_t)(r >= 127.0f ? 127 : r <= -127.0f ? -127 : r == r ? (int)r : 0);
    }
}

/* NumPy's quantize_uint4_levels for one group of n values x[i * stride]: zero = min, scale =
 * (max - min) / 15, level i = rint((x - zero) / scale) clipped to [0, 15], as element e0 + i of the
 * nibbles at out (element e in the low nibble of byte e / 2 when e is even, else the high one). As np.min
 * and np.max, a NaN makes the scale NaN. */
static void uint4_group(const float *x, int64_t n, int64_t stride, uint8_t *out, int64_t e0, int64_t estride,
                        float *scale, float *zero) {
    float lo = x[0], hi = x[0];
    for (int64_t i = 1; i < n; i++) {
        const float xi = x[i * stride];
        lo = xi < lo || xi != xi ? xi : lo;
        hi = xi > hi || xi != xi ? xi : hi;
    }
    if (lo != lo || hi != hi) lo = hi = NAN;
    *scale = (hi - lo) / 15.0f;
    *zero = lo;
    const float safe = *scale > 0.0f ? *scale : 1.0f; /* a constant group stores zeros */
    for (int64_t i = 0; i < n; i++) {
        const float r = rintf((x[i * stride] - lo) / safe);
        const uint8_t q = (uint8_t)(r >= 15.0f ? 15 : r >= 0.0f ? (int)r : 0); /* NaN -> 0, as NumPy's cast */
        const int64_t e = e0 + i * estride;
        uint8_t *byte = out + e / 2;
        *byte = e % 2 ? (uint8_t)((*byte & 0x0f) | (q << 4)) : (uint8_t)((*byte & 0xf0) | q);
    }
}

static void encode(int32_t type, int64_t n, int64_t group, const float *x, const kvref_kernels *kk, uint8_t *out,
                   float *scales) {
    switch (type) {
    case KVREF_TYPE_KIVI4: /* V per token: (scale, zero) per group along head_dim */
        for (int64_t i = 0; i < n; i += group) uint4_group(x + i, group, 1, out, i, 1, scales + 2 * (i / group),
                                                           scales + 2 * (i / group) + 1);
        break;
    case KVREF_TYPE_F16: kk->to_fp16(n, x, (uint16_t *)(void *)out); break;
    case KVREF_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) {
            const uint16_t h = bf16_from_fp32(x[i]);
            memcpy(out + 2 * i, &h, 2);
        }
        break;
    case KVREF_TYPE_I8:
        for (int64_t i = 0; i < n; i += group) int8_group(x + i, group, (int8_t *)out + i, scales + i / group);
        break;
    default: memcpy(out, x, (size_t)n * sizeof(float));
    }
}

void kvref_kv_store(const kvref_kv *kv, const kvref_kernels *kk, int64_t layer, int64_t position,
                    const float *k, const float *v) {
    kvref_attn_args a;
    kvref_kv_layer(kv, layer, &a);
    int64_t row, srow;
    const int64_t ring = kvref_kv_ring(kv, layer);
    kvref_attn_rows(&a, ring > 0 ? position % ring : position, 1, &row, &srow); /* a ring's slot p % R */
    const int64_t n = kv->n_kv_heads * kv->head_dim;
    if (kv->k_type != KVREF_TYPE_KIVI4) /* KIVI4 K goes in position order: kvref_kv_store_kivi_k */
        encode(kv->k_type, n, kv->group_size, k, kk, (uint8_t *)a.k + row * kvref_kv_element_bytes(kv->k_type),
               a.k_scales != NULL ? (float *)a.k_scales + srow : NULL);
    if (kv->v == kv->k) return; /* a latent (MLA) cache: V is K's first v_dim values, just written */
    const int64_t vrow = kv->v_type == KVREF_TYPE_KIVI4 ? row / 2 : row * kvref_kv_element_bytes(kv->v_type);
    encode(kv->v_type, n, kv->group_size, v, kk, (uint8_t *)a.v + vrow,
           a.v_scales != NULL ? (float *)a.v_scales + srow * (kv->v_type == KVREF_TYPE_KIVI4 ? 2 : 1) : NULL);
}

/* The group of g positions ending at residual row g - 1 of `layer`: each channel of each kv head
 * quantized over its g float16 rows into the group's nibbles (its g slots) and its (scale, zero). */
static void kivi_quantize_group(const kvref_kv *kv, const kvref_attn_args *a, int64_t first) {
    const int64_t g = kv->group_size, Hkv = kv->n_kv_heads, D = kv->head_dim, HD = Hkv * D;
    int64_t row, srow;
    kvref_attn_rows(a, first, 1, &row, &srow); /* the group's slots are consecutive: one block */
    const int64_t slot = row / HD;
    uint8_t *nibbles = (uint8_t *)a->k + row / 2;
    float *params = (float *)a->k_scales + (slot / g) * Hkv * 2 * D;
    float x[KVREF_KIVI_MAX_GROUP];
    for (int64_t c = 0; c < HD; c++) { /* channel c of kv head c / D: its g rows */
        for (int64_t i = 0; i < g; i++) x[i] = kvref_fp16_to_fp32(a->k_residual[i * HD + c]);
        const int64_t h = c / D, d = c % D;
        uint4_group(x, g, 1, nibbles, c, HD, params + h * 2 * D + d, params + h * 2 * D + D + d);
    }
}

void kvref_kv_store_kivi_k(const kvref_kv *kv, const kvref_kernels *kk, int64_t layer, int64_t p0, const float *k,
                           int64_t n) {
    kvref_attn_args a;
    kvref_kv_layer(kv, layer, &a);
    const int64_t g = kv->group_size, HD = kv->n_kv_heads * kv->head_dim;
    for (int64_t t = 0; t < n; t++) {
        const int64_t p = p0 + t;
        kk->to_fp16(HD, k + t * HD, (uint16_t *)a.k_residual + (p % g) * HD);
        if (p % g == g - 1) kivi_quantize_group(kv, &a, p - (g - 1));
    }
}
