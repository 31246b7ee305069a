/* The decoder layer's small ops in C: RMSNorm, RoPE, SiLU-and-multiply, on fp32 tensors
 * (`*_f32`) or bfloat16 ones (`*_bf16`: read widened, computed in fp32, rounded once).
 *
 * In a decode step each of these touches a few kilobytes, so in torch their cost is the
 * ops' fixed overhead, not arithmetic: F.rms_norm alone is about ten small ops (upcast,
 * square, mean, add, rsqrt, two multiplies, copies), 60 times a step for SmolLM2. One C
 * call each does the same arithmetic in one pass. `ops.py` calls them and keeps the torch
 * versions as the reference and fallback.
 *
 * Every tensor is rows of contiguous elements; `stride` is the distance between rows, in
 * elements. Each op's rows are split over threads in a function of its own per format, so
 * that the format is a constant in each loop (OpenMP outlines a parallel loop before
 * anything is inlined into it).
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"
#include "vec16.h"

/* out = x / sqrt(mean(x^2) + eps) * weight, Hugging Face's RMSNorm: the normed row is
 * rounded to the format before the weight scales it, as HF rounds it to the input dtype. */
ALWAYS_INLINE void rms_norm_row(void *out, const void *x, const void *weight, int64_t dim,
                                float eps, Format f) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < dim; i++) squares += load_as(x, i, f) * load_as(x, i, f);
    const float inv_rms = 1.0f / sqrtf(squares / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) {
        float normed = load_as(x, i, f) * inv_rms;
        if (f == BF16) normed = widen(narrow(normed));
        store_as(out, i, load_as(weight, i, f) * normed, f);
    }
}

#define RMS_NORM(NAME, T, FORMAT)                                                              \
    void NAME(T *out, const T *x, const T *weight, int64_t rows, int64_t dim, int64_t x_stride, \
              int64_t out_stride, float eps) {                                                 \
        _Pragma("omp parallel for if (rows > 16)") for (int64_t r = 0; r < rows; r++)          \
            rms_norm_row(out + r * out_stride, x + r * x_stride, weight, dim, eps, FORMAT);    \
    }
RMS_NORM(rms_norm_f32, float, F32)
RMS_NORM(rms_norm_bf16, uint16_t, BF16)

/* Rotate `heads` heads of head_dim elements of one row of x by its cos/sin [head_dim],
 * "rotate half" (pair i with i + head_dim/2):
 *   out = x * cos + rotate_half(x) * sin,  rotate_half(x) = (-x2, x1);  out contiguous. */
ALWAYS_INLINE void rope_row(void *out, const void *x, const void *cos, const void *sin,
                            int64_t heads, int64_t head_dim, Format f) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        const void *x1 = element_at(x, h * head_dim, f), *x2 = element_at(x1, half, f);
        void *o1 = (char *)out + h * head_dim * format_bytes(f);
        void *o2 = (char *)o1 + half * format_bytes(f);
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float a = load_as(x1, i, f), b = load_as(x2, i, f);
            store_as(o1, i, a * load_as(cos, i, f) + (-b) * load_as(sin, i, f), f);
            store_as(o2, i, b * load_as(cos, half + i, f) + a * load_as(sin, half + i, f), f);
        }
    }
}

/* Every row r of x (row stride x_stride) by row r of cos/sin [rows, head_dim]. */
#define ROPE(NAME, T, FORMAT)                                                                  \
    void NAME(T *out, const T *x, const T *cos, const T *sin, int64_t rows, int64_t heads,     \
              int64_t head_dim, int64_t x_stride) {                                            \
        _Pragma("omp parallel for if (rows > 16)") for (int64_t r = 0; r < rows; r++)          \
            rope_row(out + r * heads * head_dim, x + r * x_stride, cos + r * head_dim,         \
                     sin + r * head_dim, heads, head_dim, FORMAT);                             \
    }
ROPE(rope_f32, float, F32)
ROPE(rope_bf16, uint16_t, BF16)

/* out = silu(gate) * up over one row's `n` elements. */
ALWAYS_INLINE void silu_mul_row(void *restrict out, const void *restrict gate,
                                const void *restrict up, int64_t n, Format f) {
    for (int64_t i = 0; i < n; i++) {
        const float g = load_as(gate, i, f);
        store_as(out, i, g / (1.0f + fast_exp(-g)) * load_as(up, i, f), f);
    }
}

/* out[r] = silu(gate) * up, where row r of gate_up is [gate (inner), up (inner)]. */
#define SILU_MUL(NAME, T, FORMAT)                                                              \
    void NAME(T *out, const T *gate_up, int64_t rows, int64_t inner, int64_t in_stride,        \
              int64_t out_stride) {                                                            \
        _Pragma("omp parallel for if (rows > 16)") for (int64_t r = 0; r < rows; r++) {        \
            const T *gate = gate_up + r * in_stride;                                           \
            silu_mul_row(out + r * out_stride, gate, gate + inner, inner, FORMAT);             \
        }                                                                                      \
    }
SILU_MUL(silu_mul_f32, float, F32)
SILU_MUL(silu_mul_bf16, uint16_t, BF16)
