/* Structured output's mask in C: each token a row's bitmask forbids gets a logit of -inf,
 * in place (`cpu_ops.mask_rows`, called by `sampler.py` on a CPU).
 *
 * The bitmask has one bit per token, 32 to an int32 word: bit j of word w is token
 * 32 w + j. In torch the mask is unpacked into a [rows, vocab] tensor of booleans, then
 * applied by a second pass; here each word is read once and its forbidden tokens written
 * directly. A word with every bit set (all 32 allowed) is skipped, and one with none set
 * (the common case in a grammar: most of the vocabulary is forbidden) is filled in one go.
 */

#include <math.h>
#include <stdint.h>

/* logits [rows, logits_stride] (vocab used), bitmask [rows, words] with words >= vocab / 32 */
void mask_rows(float *logits, const int32_t *bitmask, int64_t rows, int64_t vocab,
               int64_t logits_stride, int64_t words) {
#pragma omp parallel for if (rows * vocab > 1 << 18)
    for (int64_t r = 0; r < rows; r++) {
        float *row = logits + r * logits_stride;
        const uint32_t *bits = (const uint32_t *)(bitmask + r * words);
        for (int64_t w = 0; w < words && 32 * w < vocab; w++) {
            const uint32_t word = bits[w];
            if (word == 0xFFFFFFFFu) continue;
            const int64_t first = 32 * w;
            const int64_t end = first + 32 < vocab ? first + 32 : vocab;
            if (word == 0) {
                for (int64_t t = first; t < end; t++) row[t] = -INFINITY;
                continue;
            }
            for (int64_t t = first; t < end; t++)
                if (!((word >> (t - first)) & 1u)) row[t] = -INFINITY;
        }
    }
}
