/* A decode step's few rows through a GGUF-quantized linear layer, read as it is stored
 * (`cpu_ops.quant_rows`): out = x . dequantize(w)^T, x [m, k] and out [m, n] fp32.
 *
 * GGUF cuts each weight row into blocks of 32 values; a block holds one fp16 scale d (and,
 * for Q4_1, an fp16 offset mn) and 32 small integers q:
 *   Q8_0  34 bytes: d, then 32 int8             w = d * q
 *   Q4_0  18 bytes: d, then 16 bytes of nibbles  w = d * (q - 8)
 *   Q4_1  20 bytes: d, mn, then 16 nibbles       w = d * q + mn
 * Byte j of the nibbles holds q_j in its low half and q_{j+16} in its high half. A 4-bit
 * row is a fifth of its fp32 bytes and a decode step is memory-bound, so reading the blocks
 * and widening them in registers is where the speed comes from (llama.cpp's approach).
 *
 * Each block is widened to 32 fp32 weights, exactly the values the `gguf` package's
 * dequantize gives (the same fp32 products and sums, no fused multiply-add), then multiplied
 * with up to four rows of x at once. The sums are the dequantized layer's, in another order.
 */

#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec16.h"

enum { BLOCK = 32, XS = 4 };
/* I8_ROW: a row of plain int8 weights, one fp32 scale per row applied after the sums
 * (weight-only int8 with a scale per output channel, `int8_linear.py`). */
typedef enum { Q8_0, Q4_0, Q4_1, I8_ROW } Quant;
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

/* Bytes of one block of 32 weights. */
ALWAYS_INLINE int64_t block_bytes(Quant t) {
    return t == Q8_0 ? 34 : t == Q4_0 ? 18 : t == Q4_1 ? 20 : BLOCK;
}

/* An IEEE half (its bits) as a float, subnormals included. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf or NaN */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign; /* zero */
    } else { /* subnormal: normalize it */
        exponent = 113;
        while ((mantissa & 0x400u) == 0) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h); /* one instruction where the CPU has it */
#else
    return half_to_float(h);
#endif
}

/* One block's 32 weights as two vectors: w[0] holds weights 0-15, w[1] weights 16-31. */
ALWAYS_INLINE void widen_block(f32x16 w[2], const uint8_t *block, Quant t) {
    if (t == I8_ROW || t == Q8_0) {
        const int64_t at = t == I8_ROW ? 0 : 2;
        const float d = t == I8_ROW ? 1.0f : half_at(block); /* its scale: after the sums */
        i8x16 lo, hi;
        memcpy(&lo, block + at, sizeof lo);
        memcpy(&hi, block + at + 16, sizeof hi);
        w[0] = __builtin_convertvector(__builtin_convertvector(lo, i32x16), f32x16) * d;
        w[1] = __builtin_convertvector(__builtin_convertvector(hi, i32x16), f32x16) * d;
        return;
    }
    const float d = half_at(block);
    u8x16 nibbles;
    memcpy(&nibbles, block + (t == Q4_1 ? 4 : 2), sizeof nibbles);
    const u8x16 low_bits = nibbles & 0x0f, high_bits = nibbles >> 4;
    const f32x16 low = __builtin_convertvector(__builtin_convertvector(low_bits, i32x16), f32x16);
    const f32x16 high = __builtin_convertvector(__builtin_convertvector(high_bits, i32x16), f32x16);
    if (t == Q4_0) {
        w[0] = (low - 8.0f) * d;
        w[1] = (high - 8.0f) * d;
    } else {
        const float mn = half_at(block + 2);
        w[0] = low * d + mn;
        w[1] = high * d + mn;
    }
}

/* nx <= XS rows of x (k apart) against weight row `row` (k / 32 blocks): out[j * n]. */
ALWAYS_INLINE void row_dot(const uint8_t *restrict row, const float *restrict x, int nx,
                           int64_t k, float *restrict out, int64_t n, Quant t) {
    f32x16 sums[XS];
    for (int j = 0; j < nx; j++) sums[j] = (f32x16){0};
    const int64_t bytes = block_bytes(t);
    for (int64_t b = 0; b < k / BLOCK; b++) {
        f32x16 w[2];
        widen_block(w, row + b * bytes, t);
        for (int j = 0; j < nx; j++) {
            const float *xb = x + j * k + b * BLOCK;
            sums[j] += w[0] * load16(xb) + w[1] * load16(xb + LANES);
        }
    }
    for (int j = 0; j < nx; j++) out[j * n] = lane_sum(sums[j]);
}

/* Every row of x against weight row r. */
ALWAYS_INLINE void weight_row(float *out, const float *x, const uint8_t *w, int64_t m,
                              int64_t n, int64_t k, int64_t r, Quant t) {
    const uint8_t *row = w + r * (k / BLOCK) * block_bytes(t);
    int64_t b = 0;
    for (; b + XS <= m; b += XS) row_dot(row, x + b * k, XS, k, out + b * n + r, n, t);
    switch (m - b) {
    case 3: row_dot(row, x + b * k, 3, k, out + b * n + r, n, t); break;
    case 2: row_dot(row, x + b * k, 2, k, out + b * n + r, n, t); break;
    case 1: row_dot(row, x + b * k, 1, k, out + b * n + r, n, t); break;
    }
}

/* Rows of blocks widened to fp32 weights: out [n, k] (a prefill's many rows then run one
 * fp32 matrix product on them). */
ALWAYS_INLINE void widen_row(float *out, const uint8_t *row, int64_t k, Quant t) {
    for (int64_t b = 0; b < k / BLOCK; b++) {
        f32x16 w[2];
        widen_block(w, row + b * block_bytes(t), t);
        memcpy(out + b * BLOCK, w, sizeof w);
    }
}

#define DEQUANTIZE(NAME, QUANT)                                                                \
    void NAME(float *out, const uint8_t *w, int64_t n, int64_t k) {                            \
        _Pragma("omp parallel for schedule(static)") for (int64_t r = 0; r < n; r++)           \
            widen_row(out + r * k, w + r * (k / BLOCK) * block_bytes(QUANT), k, QUANT);         \
    }
DEQUANTIZE(dequantize_q8_0, Q8_0)
DEQUANTIZE(dequantize_q4_0, Q4_0)
DEQUANTIZE(dequantize_q4_1, Q4_1)

/* One function per block format, each compiled with its format a constant. */
#define QUANT_ROWS(NAME, QUANT)                                                                \
    void NAME(float *out, const float *x, const uint8_t *w, int64_t m, int64_t n, int64_t k) { \
        _Pragma("omp parallel for schedule(static)") for (int64_t r = 0; r < n; r++)           \
            weight_row(out, x, w, m, n, k, r, QUANT);                                          \
    }
QUANT_ROWS(quant_rows_q8_0, Q8_0)
QUANT_ROWS(quant_rows_q4_0, Q4_0)
QUANT_ROWS(quant_rows_q4_1, Q4_1)

/* Rows of x against int8 weights w [n, k] with one scale per output channel:
 * out[i, r] = scales[r] * sum_j x[i, j] * w[r, j]. */
void int8_rows(float *out, const float *x, const int8_t *w, const float *scales, int64_t m,
               int64_t n, int64_t k) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        weight_row(out, x, (const uint8_t *)w, m, n, k, r, I8_ROW);
        for (int64_t i = 0; i < m; i++) out[i * n + r] *= scales[r];
    }
}
