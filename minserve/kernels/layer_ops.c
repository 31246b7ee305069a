/* The decoder layer's small ops in C (fp32): RMSNorm, RoPE, SiLU-and-multiply.
 *
 * In a decode step each of these touches a few kilobytes, so in torch their cost is the
 * ops' fixed overhead, not arithmetic: F.rms_norm alone is about ten small ops (upcast,
 * square, mean, add, rsqrt, two multiplies, copies), 60 times a step for SmolLM2. One C
 * call each does the same arithmetic in one pass. `ops.py` calls them and keeps the torch
 * versions as the reference and fallback.
 *
 * Every tensor is rows of contiguous floats; `stride` is the distance between rows.
 */

#include <math.h>
#include <stdint.h>

#include "fast_exp.h"

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, Hugging Face's RMSNorm in fp32. */
void rms_norm_f32(float *out, const float *x, const float *weight, int64_t rows, int64_t dim,
                  int64_t x_stride, int64_t out_stride, float eps) {
#pragma omp parallel for if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * out_stride;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < dim; i++) squares += xr[i] * xr[i];
        const float inv_rms = 1.0f / sqrtf(squares / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (xr[i] * inv_rms);
    }
}

/* Rotate `heads` heads of head_dim floats in each of `rows` rows of x (row stride x_stride)
 * by that row's cos/sin [rows, head_dim], "rotate half" (pair i with i + head_dim/2):
 *   out = x * cos + rotate_half(x) * sin,  rotate_half(x) = (-x2, x1);  out contiguous. */
void rope_f32(float *out, const float *x, const float *cos, const float *sin, int64_t rows,
              int64_t heads, int64_t head_dim, int64_t x_stride) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *x1 = x + r * x_stride + h * head_dim, *x2 = x1 + half;
            float *o1 = out + (r * heads + h) * head_dim, *o2 = o1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                o1[i] = x1[i] * c[i] + (-x2[i]) * s[i];
                o2[i] = x2[i] * c[half + i] + x1[i] * s[half + i];
            }
        }
    }
}

static void silu_mul_row(float *restrict out, const float *restrict gate,
                         const float *restrict up, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = gate[i] / (1.0f + fast_exp(-gate[i])) * up[i];
}

/* out[r] = silu(gate) * up, where row r of gate_up is [gate (inner), up (inner)]. */
void silu_mul_f32(float *out, const float *gate_up, int64_t rows, int64_t inner,
                  int64_t in_stride, int64_t out_stride) {
#pragma omp parallel for if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * in_stride;
        silu_mul_row(out + r * out_stride, gate, gate + inner, inner);
    }
}
