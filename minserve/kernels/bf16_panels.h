/* The panel kernel's layout and its loop over one pair of panels (`bf16_panels.c`), for the
 * kernels that widen their weights into panels as they go (`quant_rows.c`). */
#pragma once
#include <stdint.h>

enum { PANEL = 16 }; /* output columns per panel: [n / 16, k / 2, 16, 2] bfloat16 */

/* Every row of x [m, k] against the panels p0 and p1 ([k / 2][16][2] each): out's columns
 * col .. col + 31 (rows n apart), bias (bfloat16, or NULL) added before the one rounding;
 * `ahead` (or NULL): memory fetched into L2 on the way (2 * k * 16 values from it). Needs
 * AVX512-BF16 (`bf16_panels_native`). */
void panel_rows(uint16_t *out, const uint16_t *x, const uint16_t *p0, const uint16_t *p1,
                const uint16_t *bias, int64_t m, int64_t n, int64_t k, int64_t col,
                const uint16_t *ahead);
