/* A bfloat16 linear layer on weights packed into panels of pairs (`cpu_ops.linear_panels`).
 *
 * out[b, c] = sum_h x[b, h] * w[c, h] (+ bias[c]), x [m, k] and out [m, n] bfloat16 rows,
 * the sums in fp32, each output rounded once. The weight is packed once, at load
 * (`cpu_ops.pack_panels`): [n / 16, k / 2, 16, 2], so the 16 output columns of a panel and
 * two consecutive inputs fill one AVX-512 register (32 bfloat16, 64 bytes). One vdpbf16ps
 * multiplies that register by a pair of x's values broadcast to every lane and adds the two
 * products into the 16 columns' fp32 sums (exact products: a bfloat16 has 8 significant bits).
 *
 * A tile is up to MR rows of x against two panels (32 columns): 2 * MR sums stay in
 * registers for the whole of k, each step loads two panel registers and broadcasts MR pairs
 * of x; nothing is summed across lanes, and each sum is rounded and stored 16 at a time. Every
 * weight byte is read once per MR rows, so one to a few rows stream the weight at the
 * memory's speed, and with more rows the multiply-adds come closer to the cores' peak
 * (measured against oneDNN's packed kernel in `benchmarks/bf16_panels.md`). The threads
 * take panel pairs in turn; the pair after this one is fetched into L2 while the first MR
 * rows are multiplied. `quant_rows.c` calls `panel_rows` on panels it has just widened from
 * GGUF blocks. Needs AVX512-BF16 (`bf16_panels_native`).
 */

#include <stdint.h>
#include <string.h>

#include "bf16_panels.h"
#include "vec16.h"

enum { MR = 8 }; /* rows of x per tile */

/* 1 where this library was compiled with AVX512-BF16 (the only case that packs panels). */
int bf16_panels_native(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
/* mr <= MR rows of x against the panels p0 and p1 ([k / 2][16][2] each): out's columns col ..
 * col + 31 of those rows (n apart), bias added (fp32) before the one rounding. Where `ahead`
 * is set, the next pair of panels (2 * k * 16 values from it) is fetched into L2 on the way. */
ALWAYS_INLINE void tile(uint16_t *restrict out, const uint16_t *restrict x, const uint16_t *p0,
                        const uint16_t *p1, int mr, int64_t n, int64_t k, int64_t col,
                        const uint16_t *bias, const uint16_t *ahead) {
    __m512 sums[MR][2];
    for (int r = 0; r < mr; r++) sums[r][0] = sums[r][1] = _mm512_setzero_ps();
    const int64_t pairs = k / 2;
    for (int64_t t = 0; t < pairs; t++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p0 + t * 2 * PANEL);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(p1 + t * 2 * PANEL);
        if (ahead) {
            __builtin_prefetch(ahead + t * 2 * PANEL, 0, 2);
            __builtin_prefetch(ahead + (pairs + t) * 2 * PANEL, 0, 2);
        }
        for (int r = 0; r < mr; r++) {
            int32_t pair; /* x[r, 2t] and x[r, 2t + 1], side by side */
            memcpy(&pair, x + r * k + 2 * t, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            sums[r][0] = _mm512_dpbf16_ps(sums[r][0], xb, w0);
            sums[r][1] = _mm512_dpbf16_ps(sums[r][1], xb, w1);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int half = 0; half < 2; half++) {
            f32x16 s = (f32x16)sums[r][half];
            if (bias) s += widen16(bias + col + half * PANEL);
            const u16x16 rounded = narrow16(s);
            memcpy(out + r * n + col + half * PANEL, &rounded, sizeof rounded);
        }
}

/* Every row of x against the panels p0 and p1 (columns col .. col + 31), MR rows at a time;
 * `ahead`: the next pair's panels, fetched while the first rows are multiplied (or NULL). */
void panel_rows(uint16_t *out, const uint16_t *x, const uint16_t *p0, const uint16_t *p1,
                const uint16_t *bias, int64_t m, int64_t n, int64_t k, int64_t col,
                const uint16_t *ahead) {
    int64_t b = 0;
    for (; b + MR <= m; b += MR)
        tile(out + b * n, x + b * k, p0, p1, MR, n, k, col, bias, b == 0 ? ahead : NULL);
    ahead = b == 0 ? ahead : NULL;
    out += b * n, x += b * k;
    switch (m - b) { /* the rows left, each count its own loop (sums in registers) */
    case 7: tile(out, x, p0, p1, 7, n, k, col, bias, ahead); break;
    case 6: tile(out, x, p0, p1, 6, n, k, col, bias, ahead); break;
    case 5: tile(out, x, p0, p1, 5, n, k, col, bias, ahead); break;
    case 4: tile(out, x, p0, p1, 4, n, k, col, bias, ahead); break;
    case 3: tile(out, x, p0, p1, 3, n, k, col, bias, ahead); break;
    case 2: tile(out, x, p0, p1, 2, n, k, col, bias, ahead); break;
    case 1: tile(out, x, p0, p1, 1, n, k, col, bias, ahead); break;
    }
}
#endif

/* x [m, k] . w^T (+ bias) -> out [m, n], all bfloat16; w packed by `cpu_ops.pack_panels`
 * (n a multiple of 32, k even). Returns 0, or -1 where the library has no AVX512-BF16. */
int linear_panels_bf16(uint16_t *out, const uint16_t *x, const uint16_t *packed,
                       const uint16_t *bias, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX512BF16__)
    const int64_t panel_values = k * PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < n / (2 * PANEL); q++) {
        const uint16_t *p0 = packed + 2 * q * panel_values, *p1 = p0 + panel_values;
        const int64_t col = 2 * PANEL * q;
        const uint16_t *ahead = col + 2 * PANEL < n ? p1 + panel_values : NULL; /* next pair */
        panel_rows(out, x, p0, p1, bias, m, n, k, col, ahead);
    }
    return 0;
#else
    (void)out, (void)x, (void)packed, (void)bias, (void)m, (void)n, (void)k;
    return -1;
#endif
}
