/* A decode step's few rows through a GGUF-quantized linear layer, read as it is stored
 * (`cpu_ops.quant_rows`): out = x . dequantize(w)^T (+ bias), x [m, k] and out [m, n] both
 * fp32 or both bfloat16 (a bfloat16 model's own rows: x widened once, each output rounded
 * once, no conversion around the call).
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
 * The products take each block's codes as they are and apply its scale and offset once
 * (`tile`; for a bfloat16 model's rows against 4-bit blocks on a CPU with AVX512-BF16,
 * `tile_pairs`: codes and x multiplied as bfloat16 pairs); the sums are the dequantized
 * layer's but for rounding. A prefill's many rows
 * instead widen the blocks to fp32 weights, exactly the values the `gguf` package's
 * dequantize gives, and run one fp32 matrix product on them; a bfloat16 model's many rows on
 * a CPU with AVX512-BF16 widen them a pair of panels at a time, in cache, for the panel
 * kernel (`quant_panels`, `bf16_panels.c`).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec16.h"

enum { BLOCK = 32, ROWS = 4, XS = 4, AHEAD = 2 }; /* AHEAD: tiles fetched ahead */
/* I8_ROW: a row of plain int8 weights, one fp32 scale per row applied after the sums
 * (weight-only int8 with a scale per output channel, `int8_linear.py`). */
typedef enum { Q8_0, Q4_0, Q4_1, I8_ROW } Quant;

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

/* A block's 32 codes as floats (c[0]: 0-15, c[1]: 16-31), before its scale and offset. */
ALWAYS_INLINE void block_codes(f32x16 c[2], const uint8_t *block, Quant t) {
    if (t == I8_ROW || t == Q8_0) {
        const uint8_t *q = block + (t == Q8_0 ? 2 : 0);
        c[0] = int8x16_as_float(q);
        c[1] = int8x16_as_float(q + 16);
        return;
    }
    const u32x16 nibbles = bytes16(block + (t == Q4_1 ? 4 : 2)); /* a byte in each lane */
    c[0] = __builtin_convertvector((i32x16)(nibbles & 0x0fu), f32x16);
    c[1] = __builtin_convertvector((i32x16)(nibbles >> 4), f32x16);
}

/* One block's 32 weights as two vectors, exactly as the `gguf` package widens them:
 * Q8_0 d * q, Q4_0 (q - 8) * d, Q4_1 q * d + m (fp32, no fused multiply-add). */
ALWAYS_INLINE void widen_block(f32x16 w[2], const uint8_t *block, Quant t) {
    f32x16 c[2];
    block_codes(c, block, t);
    const float d = t == I8_ROW ? 1.0f : half_at(block);
    for (int h = 0; h < 2; h++) {
        if (t == Q4_0)
            w[h] = (c[h] - 8.0f) * d;
        else if (t == Q4_1)
            w[h] = c[h] * d + half_at(block + 2);
        else
            w[h] = c[h] * d;
    }
}

/* Where the sums go: out [m, n], fp32 or (`bf16`) bfloat16, each sum first times its
 * weight row's scale where there are `scales` (int8), then plus its `bias` where there is
 * one, rounded once. */
typedef struct {
    void *out;
    const float *scales, *bias;
    int64_t n;
    int bf16;
} Sink;

static inline void emit(const Sink *s, int64_t x_row, int64_t w_row, float v) {
    if (s->scales) v *= s->scales[w_row];
    if (s->bias) v += s->bias[w_row];
    if (s->bf16)
        ((uint16_t *)s->out)[x_row * s->n + w_row] = narrow(v);
    else
        ((float *)s->out)[x_row * s->n + w_row] = v;
}

/* ROWS weight rows from row r (`row`, `row_bytes` apart) against nx <= XS rows of x from
 * row b (k apart), into the sink: row b + j of x against weight row r + i.
 *
 * A block's weights are d * q + m (Q4_0: m = -8 d; Q8_0 and int8: m = 0), so its share of
 * a sum is d * (q . x) + m * (the block's x summed): the codes q meet x as they are, the
 * scale once per block, and the block sums of x (as 16 partial sums) once per row of x for
 * every weight row. That is fewer operations than widening each weight first; the sums are
 * the dequantized layer's but for rounding. The ROWS x nx sums are independent chains of
 * fused multiply-adds, so one's latency hides behind the others'. Inlined with nr and nx
 * constants, so the sums stay in registers. */
ALWAYS_INLINE void tile(const uint8_t *restrict row, int64_t row_bytes, int nr,
                        const float *restrict x, int nx, int64_t k, const Sink *sink,
                        int64_t b0, int64_t r, Quant t) {
    f32x16 sums[ROWS][XS];
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < nx; j++) sums[i][j] = (f32x16){0};
    const int64_t bytes = block_bytes(t);
    const int offset = t == Q4_0 || t == Q4_1;
    for (int64_t b = 0; b < k / BLOCK; b++) {
        f32x16 xs[XS]; /* the block's x, its 32 values added in pairs */
        for (int j = 0; j < nx && offset; j++)
            xs[j] = load16(x + j * k + b * BLOCK) + load16(x + j * k + b * BLOCK + LANES);
        for (int i = 0; i < nr; i++) {
            const uint8_t *block = row + i * row_bytes + b * bytes;
            /* the same block AHEAD tiles on, into L2: one line per row and block */
            __builtin_prefetch(block + AHEAD * ROWS * row_bytes, 0, 2);
            f32x16 c[2];
            block_codes(c, block, t);
            for (int j = 0; j < nx; j++) {
                const float *xb = x + j * k + b * BLOCK;
                if (t == I8_ROW) { /* one scale per row, applied by emit */
                    sums[i][j] = fma16(c[0], load16(xb), sums[i][j]);
                    sums[i][j] = fma16(c[1], load16(xb + LANES), sums[i][j]);
                    continue;
                }
                const f32x16 dot = fma16(c[1], load16(xb + LANES), c[0] * load16(xb));
                const float d = half_at(block);
                sums[i][j] = fma16(dot, (f32x16){0} + d, sums[i][j]);
                if (offset) {
                    const float m = t == Q4_1 ? half_at(block + 2) : -8.0f * d;
                    sums[i][j] = fma16(xs[j], (f32x16){0} + m, sums[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < nx; j++) emit(sink, b0 + j, r + i, lane_sum(sums[i][j]));
}

/* nr weight rows from row r on against every row of x, XS rows of x at a time. */
ALWAYS_INLINE void weight_rows(const Sink *sink, const float *x, const uint8_t *w, int64_t m,
                               int64_t k, int64_t r, int nr, Quant t) {
    const int64_t row_bytes = (k / BLOCK) * block_bytes(t);
    const uint8_t *row = w + r * row_bytes;
    int64_t b = 0;
    for (; b + XS <= m; b += XS) tile(row, row_bytes, nr, x + b * k, XS, k, sink, b, r, t);
    switch (m - b) {
    case 3: tile(row, row_bytes, nr, x + b * k, 3, k, sink, b, r, t); break;
    case 2: tile(row, row_bytes, nr, x + b * k, 2, k, sink, b, r, t); break;
    case 1: tile(row, row_bytes, nr, x + b * k, 1, k, sink, b, r, t); break;
    }
}

/* The weight rows ROWS at a time, over the threads; the last n % ROWS one at a time. One
 * static function per format, so each is compiled with its format a constant (OpenMP
 * outlines the parallel loop before anything is inlined into it), and the ROWS rows' tiles
 * in a function of their own (`_rows`): inlined into the outlined loop, their sums were
 * kept on the stack, a store and a reload per block (GCC 12; 1.45x slower). */
#define QUANT_TILES(NAME, QUANT)                                                               \
    static void NAME##_rows(const Sink *sink, const float *x, const uint8_t *w, int64_t m,     \
                            int64_t k, int64_t r) {                                            \
        weight_rows(sink, x, w, m, k, r, ROWS, QUANT);                                         \
    }                                                                                          \
    static void NAME(const Sink *sink, const float *x, const uint8_t *w, int64_t m, int64_t n, \
                     int64_t k) {                                                              \
        _Pragma("omp parallel for schedule(static)") for (int64_t q = 0; q < n / ROWS; q++)    \
            NAME##_rows(sink, x, w, m, k, q * ROWS);                                           \
        for (int64_t r = n / ROWS * ROWS; r < n; r++) weight_rows(sink, x, w, m, k, r, 1, QUANT); \
    }
typedef void (*TilesFn)(const Sink *, const float *, const uint8_t *, int64_t, int64_t, int64_t);
QUANT_TILES(tiles_q8_0, Q8_0)
QUANT_TILES(tiles_q4_0, Q4_0)
QUANT_TILES(tiles_q4_1, Q4_1)
QUANT_TILES(tiles_i8_row, I8_ROW)

#if defined(__AVX512BF16__)
/* A bfloat16 model's rows against 4-bit blocks, without widening either (AVX512-BF16): a
 * block's 32 codes are looked up as bfloat16 (small integers, exact: q for Q4_1, q - 8 for
 * Q4_0) and meet 32 bfloat16 x values in one vdpbf16ps (exact products, fp32 sums); the
 * scale d multiplies that, once per block. Q4_1's offsets meet the blocks' sums of x as
 * scalar products beside it, one per block. About half the vector operations of `tile`, which
 * matters where 512-bit operations run as two halves (AMD Zen 4). */
static inline __m512i code_table(Quant t) {
    uint16_t bits[32];
    for (int n = 0; n < 32; n++) bits[n] = narrow((float)((n & 15) - (t == Q4_0 ? 8 : 0)));
    __m512i table;
    memcpy(&table, bits, sizeof table);
    return table;
}

/* A block's codes q_0 .. q_31 (byte j holds q_j low, q_{j+16} high) as bfloat16, in order. */
static inline __m512bh codes_bf16(const uint8_t *nibbles, __m512i table) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)nibbles));
    const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
    const __m256i high = _mm256_srli_epi16(bytes, 4);
    const __m512i index = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
    return (__m512bh)_mm512_permutexvar_epi16(index, table);
}

/* `tile` for bfloat16 x (k apart) and Q4_0 or Q4_1 blocks; xsums [nx, k / 32]: each block's
 * x summed, for Q4_1's offsets. */
ALWAYS_INLINE void tile_pairs(const uint8_t *restrict row, int64_t row_bytes, int nr,
                              const uint16_t *restrict x, const float *xsums, int nx, int64_t k,
                              const Sink *sink, int64_t b0, int64_t r, Quant t) {
    const __m512i table = code_table(t);
    const int64_t bytes = block_bytes(t), blocks = k / BLOCK;
    f32x16 sums[ROWS][XS] = {{{0}}};
    float offsets[ROWS][XS] = {{0}}; /* Q4_1: each block's offset times its x summed */
    for (int64_t b = 0; b < blocks; b++) {
        __m512bh xb[XS];
        for (int j = 0; j < nx; j++)
            xb[j] = (__m512bh)_mm512_loadu_si512(x + j * k + b * BLOCK);
        for (int i = 0; i < nr; i++) {
            const uint8_t *block = row + i * row_bytes + b * bytes;
            __builtin_prefetch(block + AHEAD * ROWS * row_bytes, 0, 2);
            const __m512bh codes = codes_bf16(block + (t == Q4_1 ? 4 : 2), table);
            const f32x16 d = (f32x16)_mm512_set1_ps(half_at(block));
            const float m = t == Q4_1 ? half_at(block + 2) : 0.0f;
            for (int j = 0; j < nx; j++) {
                const f32x16 dot = (f32x16)_mm512_dpbf16_ps(_mm512_setzero_ps(), codes, xb[j]);
                sums[i][j] = fma16(dot, d, sums[i][j]);
                if (t == Q4_1) offsets[i][j] = fmaf(m, xsums[j * blocks + b], offsets[i][j]);
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < nx; j++) emit(sink, b0 + j, r + i, lane_sum(sums[i][j]) + offsets[i][j]);
}

ALWAYS_INLINE void pair_rows(const Sink *sink, const uint16_t *x, const float *xsums, const uint8_t *w,
                             int64_t m, int64_t k, int64_t r, int nr, Quant t) {
    const int64_t row_bytes = (k / BLOCK) * block_bytes(t), blocks = k / BLOCK;
    const uint8_t *row = w + r * row_bytes;
    int64_t b = 0;
    for (; b + XS <= m; b += XS)
        tile_pairs(row, row_bytes, nr, x + b * k, xsums + b * blocks, XS, k, sink, b, r, t);
    const uint16_t *xr = x + b * k;
    const float *sr = xsums + b * blocks;
    switch (m - b) {
    case 3: tile_pairs(row, row_bytes, nr, xr, sr, 3, k, sink, b, r, t); break;
    case 2: tile_pairs(row, row_bytes, nr, xr, sr, 2, k, sink, b, r, t); break;
    case 1: tile_pairs(row, row_bytes, nr, xr, sr, 1, k, sink, b, r, t); break;
    }
}

#define PAIR_TILES(NAME, QUANT)                                                                \
    static void NAME##_rows(const Sink *sink, const uint16_t *x, const float *xsums,           \
                            const uint8_t *w, int64_t m, int64_t k, int64_t r) {               \
        pair_rows(sink, x, xsums, w, m, k, r, ROWS, QUANT);                                    \
    }                                                                                          \
    static void NAME(const Sink *sink, const uint16_t *x, const float *xsums, const uint8_t *w, \
                     int64_t m, int64_t n, int64_t k) {                                        \
        _Pragma("omp parallel for schedule(static)") for (int64_t q = 0; q < n / ROWS; q++)    \
            NAME##_rows(sink, x, xsums, w, m, k, q * ROWS);                                    \
        for (int64_t r = n / ROWS * ROWS; r < n; r++)                                          \
            pair_rows(sink, x, xsums, w, m, k, r, 1, QUANT);                                   \
    }
PAIR_TILES(pairs_q4_0, Q4_0)
PAIR_TILES(pairs_q4_1, Q4_1)
#define PAIRS_Q4_0 pairs_q4_0
#define PAIRS_Q4_1 pairs_q4_1
#else
#define PAIRS_Q4_0 NULL
#define PAIRS_Q4_1 NULL
#endif
typedef void (*PairsFn)(const Sink *, const uint16_t *, const float *, const uint8_t *, int64_t,
                        int64_t, int64_t);

/* Rows of blocks widened to fp32 weights: out [n, k] (a prefill's many rows then run one
 * fp32 matrix product on them). */
ALWAYS_INLINE void widen_row(float *out, const uint8_t *row, int64_t k, Quant t) {
    for (int64_t b = 0; b < k / BLOCK; b++) {
        f32x16 w[2];
        widen_block(w, row + b * block_bytes(t), t);
        memcpy(out + b * BLOCK, w, sizeof w);
    }
}

/* The same rounded to bfloat16 (out [n, k] as raw bits): a bfloat16 prefill's weights, half
 * the bytes to write and read again. */
ALWAYS_INLINE void widen_row_bf16(uint16_t *out, const uint8_t *row, int64_t k, Quant t) {
    for (int64_t b = 0; b < k / BLOCK; b++) {
        f32x16 w[2];
        widen_block(w, row + b * block_bytes(t), t);
        const u16x16 halves[2] = {narrow16(w[0]), narrow16(w[1])};
        memcpy(out + b * BLOCK, halves, sizeof halves);
    }
}

#define DEQUANTIZE(NAME, QUANT, OUT, WIDEN)                                                    \
    void NAME(OUT *out, const uint8_t *w, int64_t n, int64_t k) {                              \
        _Pragma("omp parallel for schedule(static)") for (int64_t r = 0; r < n; r++)           \
            WIDEN(out + r * k, w + r * (k / BLOCK) * block_bytes(QUANT), k, QUANT);             \
    }
DEQUANTIZE(dequantize_q8_0, Q8_0, float, widen_row)
DEQUANTIZE(dequantize_q4_0, Q4_0, float, widen_row)
DEQUANTIZE(dequantize_q4_1, Q4_1, float, widen_row)
DEQUANTIZE(dequantize_q8_0_bf16, Q8_0, uint16_t, widen_row_bf16)
DEQUANTIZE(dequantize_q4_0_bf16, Q4_0, uint16_t, widen_row_bf16)
DEQUANTIZE(dequantize_q4_1_bf16, Q4_1, uint16_t, widen_row_bf16)

/* The entry points' common part: x fp32, or (`io_bf16`) bfloat16, taken as it is where
 * `pairs` can (4-bit blocks, AVX512-BF16), else widened once (`widened_copy`). Returns 0,
 * or -1 without memory. */
static int run_tiles(TilesFn tiles, PairsFn pairs, void *out, const void *x, const uint8_t *w,
                     const float *scales, const float *bias, int64_t m, int64_t n, int64_t k,
                     int64_t io_bf16) {
    const Sink sink = {.out = out, .scales = scales, .bias = bias, .n = n, .bf16 = io_bf16 != 0};
    if (!io_bf16) {
        tiles(&sink, x, w, m, n, k);
        return 0;
    }
    float *x32 = widened_copy(x, m * k);
    if (x32 == NULL) return -1;
    if (pairs) { /* x as it is; each block's 32 values summed (in place), for the offsets */
        for (int64_t i = 0; i < m * k / BLOCK; i++) {
            float total = 0.0f;
            for (int64_t h = 0; h < BLOCK; h++) total += x32[i * BLOCK + h];
            x32[i] = total;
        }
        pairs(&sink, x, x32, w, m, n, k);
    } else {
        tiles(&sink, x32, w, m, n, k);
    }
    free(x32);
    return 0;
}

#define QUANT_ROWS(NAME, TILES, PAIRS)                                                         \
    int NAME(void *out, const void *x, const uint8_t *w, const float *bias, int64_t m,         \
             int64_t n, int64_t k, int64_t io_bf16) {                                          \
        return run_tiles(TILES, PAIRS, out, x, w, NULL, bias, m, n, k, io_bf16);               \
    }
QUANT_ROWS(quant_rows_q8_0, tiles_q8_0, NULL)
QUANT_ROWS(quant_rows_q4_0, tiles_q4_0, PAIRS_Q4_0)
QUANT_ROWS(quant_rows_q4_1, tiles_q4_1, PAIRS_Q4_1)

#if defined(__AVX512BF16__)
#include <omp.h>

#include "bf16_panels.h"

/* Sixteen rows of sixteen 32-bit words transposed in registers: r[j] word l <- r[l] word j
 * (pairs of 32-bit words, then of 64-bit ones, then 128-bit lanes twice: 64 shuffles). */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* One block's 32 weights rounded to bfloat16, in order, as one register: what widen_block
 * and narrow16 give. A 4-bit block has 16 possible weights: those are computed (the same
 * fp32 arithmetic) and rounded once, and each code looks its weight up (vpermw), half the
 * operations of widening all 32. Rounding is to nearest even in one instruction, as
 * narrow16, which it differs from only on subnormal floats (no weight here is one). */
ALWAYS_INLINE __m512i block_bf16(const uint8_t *block, Quant t) {
    if (t == Q4_0 || t == Q4_1) {
        const f32x16 codes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        const float d = half_at(block);
        const f32x16 values = t == Q4_0 ? (codes - 8.0f) * d : codes * d + half_at(block + 2);
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh((__m512)values); /* 16 bf16 */
        const __m512i table = _mm512_castsi256_si512(rounded);
        const uint8_t *nibbles = block + (t == Q4_1 ? 4 : 2);
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)nibbles));
        const __m512i index = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_and_si256(bytes, _mm256_set1_epi16(0x0f))),
            _mm256_srli_epi16(bytes, 4), 1); /* codes 0-15: low nibbles, 16-31: high */
        return _mm512_permutexvar_epi16(index, table);
    }
    f32x16 v[2];
    widen_block(v, block, t);
    return (__m512i)_mm512_cvtne2ps_pbh((__m512)v[1], (__m512)v[0]);
}

/* Weight rows 16p .. 16p + 15 widened, rounded to bfloat16 (the weights
 * `dequantize_*_bf16` gives) and laid out as one panel of `bf16_panels.c`: [k / 2][16][2].
 * Per block of 32 weights, each row's 16 pairs (a pair: two consecutive weights, one 32-bit
 * word) fill a register; transposed, register j holds pair j of the 16 rows, one 64-byte
 * line of the panel.
 *
 * A block column touches 16 rows' lines at once, which the hardware prefetcher does not
 * foresee: the loads waited on memory. So the next panel's blocks (16 rows, contiguous) are
 * fetched into L2 while this one widens, a line per block and row (over SmolLM2's Q4_1
 * layers at one row of x: 16.3 -> 10.4 ms a step; its Q8_0 head: 5.1 -> 2.7 ms). `has_next`:
 * whether panel p + 1 exists. */
ALWAYS_INLINE void widen_panel(uint16_t *restrict panel, const uint8_t *w, int64_t p, int64_t k,
                               int has_next, Quant t) {
    const int64_t bytes = block_bytes(t), row_bytes = k / BLOCK * bytes;
    const uint8_t *next = w + (p + 1) * PANEL * row_bytes;
    const int64_t lines = has_next ? PANEL * row_bytes / 64 : 0;
    for (int64_t b = 0; b < k / BLOCK; b++) {
        __m512i rows[PANEL];
        for (int l = 0; l < PANEL; l++) {
            if (b * PANEL + l < lines) __builtin_prefetch(next + (b * PANEL + l) * 64, 0, 2);
            rows[l] = block_bf16(w + (p * PANEL + l) * row_bytes + b * bytes, t);
        }
        transpose16(rows);
        for (int j = 0; j < BLOCK / 2; j++)
            memcpy(panel + (b * BLOCK / 2 + j) * 2 * PANEL, &rows[j], sizeof rows[j]);
    }
}

/* A bfloat16 model's many rows (a prefill, a large decode batch) against blocks: each pair
 * of panels is widened into its thread's scratch (64 k bytes, in L2) and multiplied there by
 * the panel kernel, so the widened weight never goes out to memory and back (widening the
 * whole matrix first writes and reads twice the bfloat16 bytes a step). Returns 0, or -1
 * without memory. */
static int quant_panels(uint16_t *out, const uint16_t *x, const uint8_t *w, const uint16_t *bias,
                        int64_t m, int64_t n, int64_t k, Quant t) {
    const int64_t scratch_values = 2 * k * PANEL; /* two panels */
    uint16_t *scratch = malloc(omp_get_max_threads() * scratch_values * sizeof(uint16_t));
    if (scratch == NULL) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < n / (2 * PANEL); q++) {
        uint16_t *mine = scratch + omp_get_thread_num() * scratch_values;
        widen_panel(mine, w, 2 * q, k, 1, t);
        widen_panel(mine + k * PANEL, w, 2 * q + 1, k, 2 * q + 2 < n / PANEL, t);
        panel_rows(out, x, mine, mine + k * PANEL, bias, m, n, k, 2 * PANEL * q, NULL);
    }
    free(scratch);
    return 0;
}
#define QUANT_PANELS(NAME, QUANT)                                                              \
    int NAME(uint16_t *out, const uint16_t *x, const uint8_t *w, const uint16_t *bias,         \
             int64_t m, int64_t n, int64_t k) {                                                \
        return quant_panels(out, x, w, bias, m, n, k, QUANT);                                  \
    }
#else
#define QUANT_PANELS(NAME, QUANT)                                                              \
    int NAME(uint16_t *out, const uint16_t *x, const uint8_t *w, const uint16_t *bias,         \
             int64_t m, int64_t n, int64_t k) {                                                \
        (void)out, (void)x, (void)w, (void)bias, (void)m, (void)n, (void)k;                    \
        return -2; /* no AVX512-BF16: `cpu_ops.quant_panels` is not called */                 \
    }
#endif
QUANT_PANELS(quant_panels_q8_0, Q8_0)
QUANT_PANELS(quant_panels_q4_0, Q4_0)
QUANT_PANELS(quant_panels_q4_1, Q4_1)

/* Rows of x against int8 weights w [n, k] with one scale per output channel:
 * out[i, r] = scales[r] * sum_j x[i, j] * w[r, j] (+ bias[r]). */
int int8_rows(void *out, const void *x, const int8_t *w, const float *scales, const float *bias,
              int64_t m, int64_t n, int64_t k, int64_t io_bf16) {
    return run_tiles(tiles_i8_row, NULL, out, x, (const uint8_t *)w, scales, bias, m, n, k,
                     io_bf16);
}
