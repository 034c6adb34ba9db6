/* packed_kernel.c: the int8 mode's packed kernel alone, one thread, AVX-512 VNNI (benchmarks/packed_kernel.py
 * builds and runs it; the numbers go to docs/benchmarks.md, "The packed kernel with many rows of x").
 *
 *   packed_kernel TYPE K T GROUPS REPEAT
 *
 * Random weights of TYPE (a kvref type number; K values a row) packed into GROUPS groups of 16 rows,
 * and T rows of random x rounded to 8-bit blocks; then, REPEAT times, every group against every row
 * of x, up to 8 rows a kernel call, group after group as a prefill pass or a decode step runs them
 * (matmul.c, mv_rows). With T = 128 and a few groups the weights and x stay in cache: the kernel's
 * arithmetic. With T = 8 or 1 and tens of MiB of groups every record comes from memory once: a batched
 * or a single-sequence decode step. Prints one JSON object: ns per (row of x, record of 16 weight rows and 32 values), the
 * fastest of the REPEAT passes and their median, and the multiply-adds per second of the fastest.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdio.h>
#include <stdlib.h>

#include "internal.h"
#include "platform.h"

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* bytes of a uniform random stream (a 64-bit LCG's high bits: reproducible, not a test oracle) */
static void fill_random(uint8_t *p, int64_t n, uint64_t *state) {
    for (int64_t i = 0; i < n; i++) {
        *state = *state * 6364136223846793005u + 1442695040888963407u;
        p[i] = (uint8_t)(*state >> 56);
    }
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: packed_kernel TYPE K T GROUPS REPEAT\n");
        return 2;
    }
    const int32_t type = atoi(argv[1]);
    const int64_t K = atoll(argv[2]), T = atoll(argv[3]), G = atoll(argv[4]), repeat = atoll(argv[5]);
    if (!kvref_packable(type) || kvref_row_nbytes(type, K) <= 0 || T < 1 || (T > 8 && T % 8 != 0) || G < 1 ||
        repeat < 1) {
        fprintf(stderr, "packed_kernel: TYPE must be packable, K whole blocks, T at most 8 or a multiple of 8, "
                        "GROUPS and REPEAT >= 1\n");
        return 2;
    }
    const kvref_kernels *kk = &kvref_kernels_avx512_vnni;
    const int64_t rb = kvref_row_nbytes(type, K), gb = kvref_pack_group_bytes(type, K);
    uint8_t *w = malloc((size_t)(16 * rb)), *groups = aligned_alloc(64, (size_t)((G * gb + 63) / 64 * 64));
    float *x = malloc(sizeof(float) * (size_t)(T * K)), *ds = malloc(sizeof(float) * (size_t)(T * K / 16));
    int8_t *qs = malloc((size_t)(T * K));
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)(T * K / 16));
    double *ns = malloc(sizeof(double) * (size_t)repeat);
    if (!w || !groups || !x || !ds || !qs || !xsum || !ns) return 1;
    uint64_t state = 1;
    for (int64_t g = 0; g < G; g++) {
        fill_random(w, 16 * rb, &state);
        for (int64_t o = 1; o < 16 * rb; o += 2) w[o] &= 0x3B; /* every float16 field finite and small */
        kvref_pack_group(type, K, w, rb, 16, groups + g * gb);
    }
    for (int64_t i = 0; i < T * K; i++) {
        uint8_t b;
        fill_random(&b, 1, &state);
        x[i] = (float)b / 128.0f - 1.0f;
    }
    for (int64_t t = 0; t < T; t++) {
        kk->quantize_q8(K, x + t * K, qs + t * K, ds + t * (K / 16));
        kvref_block_sums(K, qs + t * K, xsum + t * (K / 16));
    }
    float out[8 * KVREF_PACK_ROWS];
    double checksum = 0.0;
    for (int64_t r = 0; r < repeat; r++) {
        const int64_t t0 = kvref_now_ns();
        for (int64_t g = 0; g < G; g++)
            for (int64_t t = 0; t < T; t += 8) {
                kk->packed_dot(type, K, groups + g * gb, qs + t * K, ds + t * (K / 16), xsum + t * (K / 16),
                               T - t < 8 ? T - t : 8, out);
                checksum += out[0]; /* the calls cannot be dropped */
            }
        ns[r] = (double)(kvref_now_ns() - t0);
    }
    qsort(ns, (size_t)repeat, sizeof(double), cmp_double);
    const double row_records = (double)G * (double)T * (double)(K / 32);
    printf("{\"type\": %d, \"K\": %lld, \"T\": %lld, \"groups\": %lld, \"group_bytes\": %lld, \"prefetch_records\": %d, "
           "\"ns_fastest\": %.4f, \"ns_median\": %.4f, \"gmac_s\": %.2f, \"gb_s\": %.2f, \"checksum\": %.6g}\n",
           type, (long long)K, (long long)T, (long long)G, (long long)gb, KVREF_PACK_PREFETCH_RECORDS,
           ns[0] / row_records, ns[repeat / 2] / row_records, row_records * 512.0 / ns[0], (double)(G * gb) / ns[0],
           checksum);
    return 0;
}
