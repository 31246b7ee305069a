/* exp(x) for fp32 in plain arithmetic, so that loops calling it vectorize (libm's expf is
 * one call per element). Cephes' expf: x = k ln2 + r with |r| <= ln2 / 2, exp(r) by a
 * degree-6 polynomial, times 2^k built in the exponent bits; about 1 ulp from expf on
 * [-87, 88]; 0 below and infinity above (where expf gives under 1e-38, or over 1.6e38). */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float fast_exp(float x) {
    const float in = x;
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x); /* not fminf: it would not vectorize */
    const float k = rintf(x * 1.44269504088896341f); /* round(x / ln2) */
    const float r = x - k * 0.693359375f - k * -2.12194440e-4f; /* ln2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)k + 127) << 23; /* 2^k: k + 127 in the exponent field */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return in < -87.0f ? 0.0f : (in > 88.0f ? INFINITY : y * scale);
}
