/* Sixteen floats as one value: one AVX-512 register (GCC and clang split it where vectors
 * are narrower). The kernels that stream weights (linear_rows.c, bf16_head.c) keep their
 * sums in these, not in arrays: a sum carried through memory costs a store and a reload
 * per step, which made an earlier version three times slower. */
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
enum { LANES = 16 };

/* a * b + c with one rounding: a single instruction where the CPU has FMA (-std=c11 keeps
 * the compiler from fusing `a * b + c` on its own, which is what the exact widening of
 * quantized weights relies on, so kernels ask for a fused sum where they want one). */
static inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
    return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    f32x8 ah, bh, ch, rh[2];
    for (int half = 0; half < 2; half++) {
        memcpy(&ah, (const char *)&a + half * sizeof ah, sizeof ah);
        memcpy(&bh, (const char *)&b + half * sizeof bh, sizeof bh);
        memcpy(&ch, (const char *)&c + half * sizeof ch, sizeof ch);
        rh[half] = (f32x8)_mm256_fmadd_ps((__m256)ah, (__m256)bh, (__m256)ch);
    }
    f32x16 r;
    memcpy(&r, rh, sizeof r);
    return r;
#else
    return a * b + c;
#endif
}

static inline f32x16 load16(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* A bfloat16 is the top half of a float32, so widening one is a 16-bit shift. */
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

static inline float widen(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline f32x16 widen16(const uint16_t *p) {
    u16x16 half;
    memcpy(&half, p, sizeof half);
    const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
    f32x16 f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* n bfloat16 values widened into a new fp32 array (the caller frees it; NULL without
 * memory), 64-byte aligned as torch's tensors are, so that an AVX-512 load from it never
 * spans two cache lines: a bfloat16 model's few rows, widened once per call. */
static inline float *widened_copy(const uint16_t *p, int64_t n) {
    float *out = aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
    if (out == NULL) return NULL;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const f32x16 v = widen16(p + i);
        memcpy(out + i, &v, sizeof v);
    }
    for (; i < n; i++) out[i] = widen(p[i]);
    return out;
}

/* An 8-bit float's magnitude bits `em` (exponent, then `mant_bits` of mantissa, exponent
 * bias `bias`) as a float32: the fields moved into float32's places and the exponent
 * rebiased. A subnormal (exponent field 0) is read as the normal number with exponent field
 * 1 less that number's implicit one, exactly. Finite values only (the KV cache saturates). */
static inline float minifloat(uint8_t byte, int mant_bits, int bias) {
    const uint32_t em = byte & 0x7fu, sub = em < (1u << mant_bits);
    const uint32_t bits =
        ((em + (sub << mant_bits)) << (23 - mant_bits)) + ((uint32_t)(127 - bias) << 23);
    const uint32_t one_bits = (uint32_t)(128 - bias) << 23; /* 2^(1 - bias): that implicit one */
    float f = 0.0f, one = 0.0f;
    memcpy(&f, &bits, sizeof f);
    memcpy(&one, &one_bits, sizeof one);
    if (sub) f -= one;
    return byte & 0x80u ? -f : f;
}
static inline float e4m3(uint8_t b) { return minifloat(b, 3, 7); }  /* torch.float8_e4m3fn */
static inline float e5m2(uint8_t b) { return minifloat(b, 2, 15); } /* torch.float8_e5m2 */

/* How a tensor the kernels read is stored: fp32, bfloat16 bits, an 8-bit float (e4m3, e5m2)
 * or an int8 (its scale kept by the caller). The functions that take a Format are inlined
 * with it a constant, so one text compiles into one loop per format. */
typedef enum { F32, BF16, E4M3, E5M2, I8 } Format;
#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE int64_t format_bytes(Format f) { return f == F32 ? 4 : f == BF16 ? 2 : 1; }

/* Element i of p, as a float; sixteen of them from i on; the address of element i. */
ALWAYS_INLINE float load_as(const void *p, int64_t i, Format f) {
    const uint8_t *bytes = p;
    switch (f) {
    case BF16: return widen(((const uint16_t *)p)[i]);
    case E4M3: return e4m3(bytes[i]);
    case E5M2: return e5m2(bytes[i]);
    case I8: return (float)(int8_t)bytes[i];
    default: return ((const float *)p)[i];
    }
}

/* Sixteen bytes, each zero-extended to 32 bits: one instruction (vpmovzxbd) with AVX-512,
 * two with AVX2. Written portably (__builtin_convertvector), GCC 12 widens them a byte at a
 * time through general registers, several times slower. */
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
static inline u32x16 bytes16(const uint8_t *p) {
#if defined(__AVX512F__)
    return (u32x16)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    const __m256i halves[2] = {_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                               _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
    u32x16 v;
    memcpy(&v, halves, sizeof v);
    return v;
#else
    u8x16 raw;
    memcpy(&raw, p, sizeof raw);
    return __builtin_convertvector(raw, u32x16);
#endif
}

/* Sixteen int8 as floats: sign-extended in one instruction with AVX-512; elsewhere the
 * bytes with their sign bit flipped are the values plus 128, zero-extended, converted, less
 * 128 (exact: small integers). */
static inline f32x16 int8x16_as_float(const uint8_t *p) {
#if defined(__AVX512F__)
    return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    const i32x16 biased = (i32x16)bytes16(p) ^ 0x80;
    return __builtin_convertvector(biased - 128, f32x16);
#endif
}

/* Sixteen 8-bit floats as float32: `minifloat` lane by lane, in vector operations. */
static inline f32x16 minifloat16(const uint8_t *p, int mant_bits, int bias) {
    const u32x16 byte = bytes16(p), em = byte & 0x7fu;
    const u32x16 sub = (u32x16)(em < (1u << mant_bits)) & 1u;
    const u32x16 bits =
        ((em + (sub << mant_bits)) << (23 - mant_bits)) + ((uint32_t)(127 - bias) << 23);
    const uint32_t one_bits = (uint32_t)(128 - bias) << 23;
    float one = 0.0f;
    memcpy(&one, &one_bits, sizeof one);
    f32x16 f;
    memcpy(&f, &bits, sizeof f);
    f -= __builtin_convertvector(sub, f32x16) * one;
    u32x16 signed_bits;
    memcpy(&signed_bits, &f, sizeof f);
    signed_bits |= (byte & 0x80u) << 24;
    memcpy(&f, &signed_bits, sizeof f);
    return f;
}

ALWAYS_INLINE f32x16 load16_as(const void *p, int64_t i, Format f) {
    const uint8_t *bytes = (const uint8_t *)p + i;
    switch (f) {
    case BF16: return widen16((const uint16_t *)p + i);
    case E4M3: return minifloat16(bytes, 3, 7);
    case E5M2: return minifloat16(bytes, 2, 15);
    case I8: return int8x16_as_float(bytes);
    default: return load16((const float *)p + i);
    }
}
ALWAYS_INLINE const void *element_at(const void *p, int64_t i, Format f) {
    return (const char *)p + i * format_bytes(f);
}

/* A float rounded to the nearest bfloat16, ties to even (torch's rounding); NaN stays NaN. */
static inline uint16_t narrow(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Sixteen finite floats rounded to the nearest bfloat16, ties to even (`narrow`, lane by
 * lane, without its NaN case). */
static inline u16x16 narrow16(f32x16 v) {
    u32x16 bits;
    memcpy(&bits, &v, sizeof bits);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return __builtin_convertvector(bits >> 16, u16x16);
}

/* Element i of p set to v, rounded to p's format. */
ALWAYS_INLINE void store_as(void *p, int64_t i, float v, Format f) {
    if (f == BF16)
        ((uint16_t *)p)[i] = narrow(v);
    else
        ((float *)p)[i] = v;
}

/* The 16 lanes added by halves: 16 -> 8 -> 4, then the last four. */
static inline float lane_sum(f32x16 v) {
    f32x8 lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    const f32x8 s8 = lo + hi;
    f32x4 a, b;
    memcpy(&a, &s8, sizeof a);
    memcpy(&b, (const char *)&s8 + sizeof a, sizeof b);
    const f32x4 s4 = a + b;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* Sixteen vectors' lane sums at once, as one vector: four rounds, each adding the halves of
 * two vectors side by side (two shuffles and an add per pair), 45 operations where sixteen
 * lane_sums take about 130. Lane L of the result is the sum of v[REVERSED[L]] (L's four
 * bits reversed: the order the rounds leave), so callers store into v[REVERSED[L]]. */
static const int REVERSED[LANES] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#define HALVES(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
static inline f32x16 lane_sums16(const f32x16 v[LANES]) {
    f32x16 h8[8], h4[4], h2[2];
    for (int p = 0; p < 8; p++) {
        const f32x16 a = v[2 * p], b = v[2 * p + 1];
        h8[p] = HALVES(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                HALVES(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int p = 0; p < 4; p++) {
        const f32x16 a = h8[2 * p], b = h8[2 * p + 1];
        h4[p] = HALVES(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
                HALVES(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
    for (int p = 0; p < 2; p++) {
        const f32x16 a = h4[2 * p], b = h4[2 * p + 1];
        h2[p] = HALVES(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
                HALVES(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
    return HALVES(h2[0], h2[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           HALVES(h2[0], h2[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
