/* A linear layer for a decode step's few rows: out = x . w^T (+ bias) (`cpu_ops.linear_rows`).
 *
 * out[b, r] = sum_h w[r, h] * x[b, h] (+ bias[r]), w row-major [n, k], x [m, k], out [m, n],
 * all fp32 (`linear_rows_f32`), or all bfloat16 (`linear_rows_bf16`: a bfloat16 model's own
 * tensors as they are; x widened once, the weight's raw bits as they are read, the sums in
 * fp32, each output rounded once).
 * With a handful of rows the product is memory-bound: every weight byte is read once a step
 * and used m times, so a bfloat16 weight halves the step's main cost. GEMM libraries are
 * built for the other case; on the Xeon we measured,
 * oneDNN's packed kernel and MKL's both left part of the memory bandwidth unused for m <= 12
 * (`benchmarks/linear_rows.md`). Here the weight streams in blocks of four rows, each block
 * used for four rows of x at a time while the next block is fetched into L2.
 *
 * The sums are the same products taken in another order than F.linear's (rounding only).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

/* Multiply-adds as single FMA instructions (-std=c11 turns that off): the sums only change
 * by rounding, as any GEMM's do. Only this file's functions are affected. */
#if defined(__clang__)
#pragma clang fp contract(fast)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=fast")
#endif

enum { ROWS = 4, XS = 4 };

/* ROWS weight rows (w, row-major, k apart) against nx <= XS rows of x; out[j * ldo + i] is
 * row j of x against weight row i, plus bias[i] where there is a bias (out and bias in the
 * weight's format). Where `ahead` is set, the block it points to is fetched
 * into L2 (prefetch hint 2) as this one is read: one line per row and step, spread over the
 * loop. Prefetching a whole block at once, or into L1, measured slower. Inlined with nx a
 * constant, so the sums stay in registers (16 + 4 + 1 of AVX-512's 32); their lanes are
 * summed together at the end (lane_sums16), not one dot product at a time. */
ALWAYS_INLINE void block(const void *restrict w,
                                                        const float *restrict x, int nx,
                                                        int64_t k, const void *ahead,
                                                        void *restrict out, int64_t ldo,
                                                        const void *bias, Format f) {
    f32x16 sums[ROWS][XS];
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < nx; j++) sums[i][j] = (f32x16){0};
    int64_t h = 0;
    for (; h + LANES <= k; h += LANES) {
        f32x16 wv[ROWS];
        for (int i = 0; i < ROWS; i++) wv[i] = load16_as(w, i * k + h, f);
        if (ahead)
            for (int i = 0; i < ROWS; i++) __builtin_prefetch(element_at(ahead, i * k + h, f), 0, 2);
        for (int j = 0; j < nx; j++) {
            const f32x16 xv = load16(x + j * k + h);
            for (int i = 0; i < ROWS; i++) sums[i][j] += wv[i] * xv;
        }
    }
    /* the ROWS * nx dot products' lanes summed all at once: lane i * XS + j of `total` */
    f32x16 parts[LANES] = {0};
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < nx; j++) parts[REVERSED[i * XS + j]] = sums[i][j];
    const f32x16 total = lane_sums16(parts);
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < nx; j++) {
            float s = total[i * XS + j];
            for (int64_t t = h; t < k; t++) s += load_as(w, i * k + t, f) * x[j * k + t];
            store_as(out, j * ldo + i, bias ? s + load_as(bias, i, f) : s, f);
        }
}

/* One weight row (the last n % ROWS) against one row of x. */
ALWAYS_INLINE float dot(const void *restrict w,
                                                      const float *restrict x, int64_t k,
                                                      Format f) {
    f32x16 s = {0};
    int64_t h = 0;
    for (; h + LANES <= k; h += LANES) s += load16_as(w, h, f) * load16(x + h);
    float total = lane_sum(s);
    for (; h < k; h++) total += load_as(w, h, f) * x[h];
    return total;
}

/* Weight rows r .. r + ROWS - 1 against every row of x; `next`, the block after (or NULL),
 * is fetched while the first group of x is multiplied. */
ALWAYS_INLINE void weight_block(void *out, const float *x, const void *wr, const void *next,
                                const void *bias, int64_t m, int64_t n, int64_t k, int64_t r,
                                Format f) {
    const void *b_r = bias ? element_at(bias, r, f) : NULL;
    int64_t b = 0;
    for (; b + XS <= m; b += XS)
        block(wr, x + b * k, XS, k, b == 0 ? next : NULL, (void *)element_at(out, b * n + r, f), n,
              b_r, f);
    const void *ahead = b == 0 ? next : NULL, *at = element_at(out, b * n + r, f);
    switch (m - b) {
    case 3: block(wr, x + b * k, 3, k, ahead, (void *)at, n, b_r, f); break;
    case 2: block(wr, x + b * k, 2, k, ahead, (void *)at, n, b_r, f); break;
    case 1: block(wr, x + b * k, 1, k, ahead, (void *)at, n, b_r, f); break;
    }
}

/* One function per format, so that each is compiled with its format a constant (the
 * parallel loop below is outlined by OpenMP before anything is inlined into it). */
typedef void (*BlockFn)(void *, const float *, const void *, const void *, const void *,
                        int64_t, int64_t, int64_t, int64_t);
static void weight_block_f32(void *out, const float *x, const void *wr, const void *next,
                             const void *bias, int64_t m, int64_t n, int64_t k, int64_t r) {
    weight_block(out, x, wr, next, bias, m, n, k, r, F32);
}
static void weight_block_bf16(void *out, const float *x, const void *wr, const void *next,
                              const void *bias, int64_t m, int64_t n, int64_t k, int64_t r) {
    weight_block(out, x, wr, next, bias, m, n, k, r, BF16);
}

/* out (+ bias), both in the weight's format f; x fp32. */
static void linear_rows(void *out, const float *x, const void *w, const void *bias, int64_t m,
                        int64_t n, int64_t k, Format f) {
    const int64_t blocks = n / ROWS;
    const BlockFn run = f == BF16 ? weight_block_bf16 : weight_block_f32;
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < blocks; q++) {
        const void *wr = element_at(w, q * ROWS * k, f);
        run(out, x, wr, q + 1 < blocks ? element_at(wr, ROWS * k, f) : NULL, bias, m, n, k,
            q * ROWS);
    }
    for (int64_t r = blocks * ROWS; r < n; r++)
        for (int64_t b = 0; b < m; b++) {
            const float s = dot(element_at(w, r * k, f), x + b * k, k, f);
            store_as(out, b * n + r, bias ? s + load_as(bias, r, f) : s, f);
        }
}

void linear_rows_f32(float *out, const float *x, const float *w, const float *bias, int64_t m,
                     int64_t n, int64_t k) {
    linear_rows(out, x, w, bias, m, n, k, F32);
}

/* Returns 0, or -1 when there was no memory for x widened (m * k floats). */
int linear_rows_bf16(uint16_t *out, const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                     int64_t m, int64_t n, int64_t k) {
    float *x32 = widened_copy(x, m * k);
    if (x32 == NULL) return -1;
    linear_rows(out, x32, w, bias, m, n, k, BF16);
    free(x32);
    return 0;
}
