/* A linear layer for a decode step's few rows: out = x . w^T (+ bias), fp32 (`cpu_ops.linear_rows`).
 *
 * out[b, r] = sum_h w[r, h] * x[b, h] (+ bias[r]), w row-major [n, k], x [m, k], out [m, n].
 * With a handful of rows the product is memory-bound: every weight byte is read once a step
 * and used m times. GEMM libraries are built for the other case; on the Xeon we measured,
 * oneDNN's packed kernel and MKL's both left part of the memory bandwidth unused for m <= 12
 * (`benchmarks/linear_rows.md`). Here the weight streams in blocks of four rows, each block
 * used for four rows of x at a time while the next block is fetched into L2.
 *
 * The sums are the same products taken in another order than F.linear's (rounding only).
 */

#include <stdint.h>
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
 * row j of x against weight row i. Where `ahead` is set, the block it points to is fetched
 * into L2 (prefetch hint 2) as this one is read: one line per row and step, spread over the
 * loop. Prefetching a whole block at once, or into L1, measured slower. Inlined with nx a
 * constant, so the sums stay in registers (16 + 4 + 1 of AVX-512's 32). */
static inline __attribute__((always_inline)) void block(const float *restrict w,
                                                        const float *restrict x, int nx,
                                                        int64_t k, const float *ahead,
                                                        float *restrict out, int64_t ldo) {
    f32x16 sums[ROWS][XS];
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < nx; j++) sums[i][j] = (f32x16){0};
    int64_t h = 0;
    for (; h + LANES <= k; h += LANES) {
        f32x16 wv[ROWS];
        for (int i = 0; i < ROWS; i++) wv[i] = load16(w + i * k + h);
        if (ahead)
            for (int i = 0; i < ROWS; i++) __builtin_prefetch(ahead + i * k + h, 0, 2);
        for (int j = 0; j < nx; j++) {
            const f32x16 xv = load16(x + j * k + h);
            for (int i = 0; i < ROWS; i++) sums[i][j] += wv[i] * xv;
        }
    }
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < nx; j++) {
            float s = lane_sum(sums[i][j]);
            for (int64_t t = h; t < k; t++) s += w[i * k + t] * x[j * k + t];
            out[j * ldo + i] = s;
        }
}

/* One weight row (the last n % ROWS) against one row of x. */
static float dot(const float *restrict w, const float *restrict x, int64_t k) {
    f32x16 s = {0};
    int64_t h = 0;
    for (; h + LANES <= k; h += LANES) s += load16(w + h) * load16(x + h);
    float total = lane_sum(s);
    for (; h < k; h++) total += w[h] * x[h];
    return total;
}

void linear_rows_f32(float *out, const float *x, const float *w, const float *bias, int64_t m,
                     int64_t n, int64_t k) {
    const int64_t blocks = n / ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < blocks; q++) {
        const int64_t r = q * ROWS;
        const float *wr = w + r * k;
        const float *next = q + 1 < blocks ? wr + ROWS * k : NULL;
        int64_t b = 0;
        for (; b + XS <= m; b += XS)  /* the first group of x fetches the next block */
            block(wr, x + b * k, XS, k, b == 0 ? next : NULL, out + b * n + r, n);
        const float *ahead = b == 0 ? next : NULL;
        switch (m - b) {
        case 3: block(wr, x + b * k, 3, k, ahead, out + b * n + r, n); break;
        case 2: block(wr, x + b * k, 2, k, ahead, out + b * n + r, n); break;
        case 1: block(wr, x + b * k, 1, k, ahead, out + b * n + r, n); break;
        }
    }
    for (int64_t r = blocks * ROWS; r < n; r++)
        for (int64_t b = 0; b < m; b++) out[b * n + r] = dot(w + r * k, x + b * k, k);
    if (bias)
        for (int64_t b = 0; b < m; b++)
            for (int64_t r = 0; r < n; r++) out[b * n + r] += bias[r];
}
