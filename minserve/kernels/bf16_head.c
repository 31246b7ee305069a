/* The output head's screening pass for exact greedy decoding (`platforms/cpu/greedy_head.py`).
 *
 * out[b, r] = sum_h float(w[r, h]) * x[b, h], where w is the head's weight rounded to
 * bfloat16 [rows, hidden] and x is fp32 [batch, hidden]. A decode step is memory-bound and
 * the head is a fifth of SmolLM2's weights: reading it in bfloat16 halves those bytes. The
 * products are summed in fp32; greedy_head.py bounds how far these logits can be from the
 * fp32 ones and re-checks the few tokens that could still be the argmax.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"

/* Multiply-adds as single FMA instructions (-std=c11 turns that off): greedy_head.py's bound
 * holds for any fp32 summation, fused or not, and the screen is arithmetic-bound from
 * three rows of x up. Only this file's functions are affected. */
#if defined(__clang__)
#pragma clang fp contract(fast)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=fast")
#endif

/* Four rows of x against one weight row: the weight is widened once for all four. */
static void dot4(const uint16_t *restrict w, const float *x0, const float *x1,
                 const float *x2, const float *x3, int64_t hidden, float *restrict sums) {
    f32x16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t h = 0;
    for (; h + LANES <= hidden; h += LANES) {
        const f32x16 wh = widen16(w + h);
        a0 += wh * load16(x0 + h);
        a1 += wh * load16(x1 + h);
        a2 += wh * load16(x2 + h);
        a3 += wh * load16(x3 + h);
    }
    float s0 = lane_sum(a0), s1 = lane_sum(a1), s2 = lane_sum(a2), s3 = lane_sum(a3);
    for (; h < hidden; h++) {
        const float wh = widen(w[h]);
        s0 += wh * x0[h], s1 += wh * x1[h], s2 += wh * x2[h], s3 += wh * x3[h];
    }
    sums[0] = s0, sums[1] = s1, sums[2] = s2, sums[3] = s3;
}

/* Two rows of x against one weight row. */
static void dot2(const uint16_t *restrict w, const float *restrict x, int64_t hidden,
                 float *restrict sums) {
    const float *x0 = x, *x1 = x + hidden;
    f32x16 a0 = {0}, a1 = {0};
    int64_t h = 0;
    for (; h + LANES <= hidden; h += LANES) {
        const f32x16 wh = widen16(w + h);
        a0 += wh * load16(x0 + h);
        a1 += wh * load16(x1 + h);
    }
    float s0 = lane_sum(a0), s1 = lane_sum(a1);
    for (; h < hidden; h++) {
        const float wh = widen(w[h]);
        s0 += wh * x0[h], s1 += wh * x1[h];
    }
    sums[0] = s0, sums[1] = s1;
}

/* One row of x: two sums in turn, so that each add need not wait for the previous one. */
static float dot1(const uint16_t *restrict w, const float *restrict x, int64_t hidden) {
    f32x16 a = {0}, b = {0};
    int64_t h = 0;
    for (; h + 2 * LANES <= hidden; h += 2 * LANES) {
        a += widen16(w + h) * load16(x + h);
        b += widen16(w + h + LANES) * load16(x + h + LANES);
    }
    for (; h + LANES <= hidden; h += LANES) a += widen16(w + h) * load16(x + h);
    float s = lane_sum(a + b);
    for (; h < hidden; h++) s += widen(w[h]) * x[h];
    return s;
}

/* The head is read once a step, from DRAM: asking for the row AHEAD rows on while this one
 * is summed (into L1, hint 3) took the cold read from 5.0 to 3.3 ms for SmolLM2's head on
 * 2 cores; the hardware prefetcher alone left half the bandwidth unused. */
enum { AHEAD = 4, LINE = 64 };

static inline void prefetch_row(const uint16_t *row, int64_t hidden) {
    const char *p = (const char *)row;
    for (int64_t off = 0; off < hidden * (int64_t)sizeof *row; off += LINE)
        __builtin_prefetch(p + off, 0, 3);
}

void bf16_logits_f32(float *out, const uint16_t *w, const float *x, int64_t rows,
                     int64_t hidden, int64_t batch) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *wr = w + r * hidden;
        if (r + AHEAD < rows) prefetch_row(w + (r + AHEAD) * hidden, hidden);
        int64_t b = 0;
        float sums[4];
        for (; b + 4 <= batch; b += 4) {
            const float *xb = x + b * hidden;
            dot4(wr, xb, xb + hidden, xb + 2 * hidden, xb + 3 * hidden, hidden, sums);
            for (int j = 0; j < 4; j++) out[(b + j) * rows + r] = sums[j];
        }
        if (batch - b == 3) {  /* cheaper as four rows (the last one twice) than as 2 + 1 */
            const float *xb = x + b * hidden;
            dot4(wr, xb, xb + hidden, xb + 2 * hidden, xb + 2 * hidden, hidden, sums);
            for (int j = 0; j < 3; j++) out[(b + j) * rows + r] = sums[j];
            b += 3;
        }
        if (b + 2 <= batch) {
            dot2(wr, x + b * hidden, hidden, sums);
            out[b * rows + r] = sums[0], out[(b + 1) * rows + r] = sums[1];
            b += 2;
        }
        for (; b < batch; b++) out[b * rows + r] = dot1(wr, x + b * hidden, hidden);
    }
}

/* Which tokens could still be row b's fp32 argmax, from the screened logits [batch, rows]:
 * margin_r = slack[r] * x_norm[b] + 2^-20 (|logit_r| + 1) (the second term covers this
 * function's own fp32 rounding), floor = max_r (logit_r - margin_r), and a candidate is any
 * r with logit_r + margin_r >= floor (is_candidate[b, r] = 1). Writes each row's number of
 * candidates and the first r with the largest logit_r + margin_r, which is the answer
 * wherever it is the only one. */
static inline float margin(float logit, float slack, float scale) {
    return slack * scale + 0x1p-20f * (fabsf(logit) + 1.0f);
}

void screen_candidates_f32(int64_t *best, int64_t *count, uint8_t *is_candidate,
                           const float *logits, const float *slack, const float *x_norm,
                           int64_t rows, int64_t batch) {
    for (int64_t b = 0; b < batch; b++) {
        const float *a = logits + b * rows;
        uint8_t *mark = is_candidate + b * rows;
        const float scale = x_norm[b];
        float floor = -INFINITY;
        for (int64_t r = 0; r < rows; r++) floor = fmaxf(floor, a[r] - margin(a[r], slack[r], scale));
        int64_t n = 0, top = 0;
        float top_upper = -INFINITY;
        for (int64_t r = 0; r < rows; r++) {
            const float upper = a[r] + margin(a[r], slack[r], scale);
            mark[r] = upper >= floor;
            n += mark[r];
            if (upper > top_upper) top_upper = upper, top = r;
        }
        best[b] = top, count[b] = n;
    }
}
