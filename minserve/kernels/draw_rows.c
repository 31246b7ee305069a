/* Sampling with temperature in C: the sampler's draw for rows without filters
 * (`cpu_ops.draw_rows`, called by `sampler.py`).
 *
 * In torch, a temperature draw over a 49152-token vocabulary is eight passes over each row
 * (max, shift, divide, softmax's three, cumsum, the search), each writing a new
 * [rows, vocab] tensor: about 13 ms a step for 48 rows on two cores, a sixth of a busy
 * step. Here each row is two passes, nothing written:
 *   1. m, the row's largest logit;
 *   2. S = the sum of e_i = exp((l_i - m) / T), taken sixteen tokens at a time;
 *   3. (the inverse CDF) the same sums again, from the start, until they pass u * S: the
 *      first token at which they do is drawn. Pass 3 repeats pass 2's arithmetic in its
 *      order, so it always stops inside the row.
 * These are `draw_from_logits(filtered(...))`'s steps (shift, divide, softmax, cumsum,
 * searchsorted) without the normalisation, which only scales both sides of the comparison:
 * the same token but where rounding puts the target within ~1e-6 of a boundary.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"
#include "vec16.h"

/* The e_i of tokens i .. i + 15 (i + 16 <= vocab), summed. */
static inline float chunk_sum(const float *row, int64_t i, float m, float t) {
    float e[LANES];
#pragma omp simd
    for (int k = 0; k < LANES; k++) e[k] = fast_exp((row[i + k] - m) / t);
    f32x16 v;
    memcpy(&v, e, sizeof v);
    return lane_sum(v);
}

/* One row's draw: logits row [vocab], temperature t > 0, uniform u in [0, 1). */
static int64_t draw_row(const float *row, int64_t vocab, float t, float u) {
    float m = row[0];
    for (int64_t i = 1; i < vocab; i++) m = row[i] > m ? row[i] : m;
    const int64_t whole = vocab / LANES * LANES;
    float total = 0.0f;
    for (int64_t i = 0; i < whole; i += LANES) total += chunk_sum(row, i, m, t);
    for (int64_t i = whole; i < vocab; i++) total += fast_exp((row[i] - m) / t);
    /* u * total may round up to total itself: stay below it, as the torch draw does */
    const float target = fminf(u * total, nextafterf(total, 0.0f));
    float sum = 0.0f;
    int64_t i = 0;
    for (; i < whole; i += LANES) {
        const float chunk = chunk_sum(row, i, m, t);
        if (sum + chunk > target) break;
        sum += chunk;
    }
    int64_t last = i; /* the last token with any probability, in case rounding runs out */
    for (; i < vocab; i++) {
        const float e = fast_exp((row[i] - m) / t);
        if (e > 0.0f) last = i;
        sum += e;
        if (sum > target) return i;
    }
    return last < vocab ? last : vocab - 1;
}

/* out[r] = the token drawn for row rows[r] of logits [*, vocab] (row stride `stride`), at
 * temperature temperatures[r] with uniform uniforms[r]. Rows with any NaN or +inf, or all
 * -inf, are the caller's to leave out (`unsampleable_rows`). */
void draw_rows(int64_t *out, const float *logits, const int64_t *rows, int64_t num_rows,
               int64_t vocab, int64_t stride, const float *temperatures, const float *uniforms) {
#pragma omp parallel for schedule(static) if (num_rows > 1)
    for (int64_t r = 0; r < num_rows; r++)
        out[r] = draw_row(logits + rows[r] * stride, vocab, temperatures[r], uniforms[r]);
}
