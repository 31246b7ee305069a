/* PagedAttention's two CPU kernels in C (fp32): store a step's k/v, attend for decodes.
 *
 * Plain torch runs a decode's attention as a chain of ops per layer: copy the sequence's
 * blocks out of the pool (index_select, twice), then torch's attention over the copy. For
 * one query token per sequence the arithmetic is tiny, so the copies and the ops' fixed
 * costs are most of the time. These kernels read the blocks where they lie, through the
 * block table, in one call per layer (vLLM's CPU backend does the same in C++).
 *
 * Layouts (what `paged_cpu.py` passes; strides in elements):
 *   k_cache, v_cache  [num_blocks, block_size, Hkv, D], contiguous (one layer of the pool)
 *   q, out            [T, Hq, D] with token stride q_tok, out_tok; heads and D contiguous
 *   block_tables      [num_seqs, max_blocks] int32, row stride bt_stride
 * Query head h reads KV head h / (Hq / Hkv) (grouped-query attention). Each (sequence, KV
 * head) pair is one task for OpenMP: the pair's query heads share every K/V row it reads.
 * Softmax is exact (two passes over the scores), accumulated in fp32.
 *
 * Built and loaded by `build.py`; `paged_torch.py` is the reference it is tested on.
 */

#include <math.h>
#include <stdint.h>

#include "fast_exp.h"
#include <stdlib.h>
#include <string.h>

/* Write token t's k and v (Hkv * D floats each, at row strides k_tok, v_tok) to its slot. */
void store_kv_f32(float *k_cache, float *v_cache, const float *k, const float *v,
                  const int64_t *slots, int64_t num_tokens, int64_t k_tok, int64_t v_tok,
                  int64_t row) {
    for (int64_t t = 0; t < num_tokens; t++) {
        memcpy(k_cache + slots[t] * row, k + t * k_tok, row * sizeof(float));
        memcpy(v_cache + slots[t] * row, v + t * v_tok, row * sizeof(float));
    }
}

static float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One sequence, one KV head: its `group` query heads over the sequence's `context` keys.
 * scores: scratch of group * context floats. */
static void attend_one(float *out, const float *q, const float *k_cache, const float *v_cache,
                       const int32_t *table, int64_t context, int64_t kv_head, int64_t group,
                       int64_t block_size, int64_t num_kv_heads, int64_t head_dim, float scale,
                       float *scores) {
    const int64_t token_row = num_kv_heads * head_dim; /* one slot: every KV head */
    const int64_t block_row = block_size * token_row;  /* one block */
    for (int64_t j0 = 0; j0 < context; j0 += block_size) { /* block by block, in order */
        const float *keys = k_cache + table[j0 / block_size] * block_row + kv_head * head_dim;
        const int64_t n = context - j0 < block_size ? context - j0 : block_size;
        for (int64_t j = 0; j < n; j++)
            for (int64_t g = 0; g < group; g++)
                scores[g * context + j0 + j] =
                    dot(q + g * head_dim, keys + j * token_row, head_dim) * scale;
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * context;
        float m = s[0], total = 0.0f;
        for (int64_t j = 1; j < context; j++) m = s[j] > m ? s[j] : m;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < context; j++) {
            s[j] = fast_exp(s[j] - m);
            total += s[j];
        }
        const float inv = 1.0f / total;
        for (int64_t j = 0; j < context; j++) s[j] *= inv;
    }
    for (int64_t g = 0; g < group; g++) memset(out + g * head_dim, 0, head_dim * sizeof(float));
    for (int64_t j0 = 0; j0 < context; j0 += block_size) {
        const float *values = v_cache + table[j0 / block_size] * block_row + kv_head * head_dim;
        const int64_t n = context - j0 < block_size ? context - j0 : block_size;
        for (int64_t j = 0; j < n; j++)
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * context + j0 + j];
                const float *value = values + j * token_row;
                float *o = out + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) o[d] += p * value[d];
            }
    }
}

/* Decode attention for `num_decodes` sequences: sequence seqs[i] has its query token at row
 * rows[i], its blocks in block_tables[seqs[i]] and context_lens[seqs[i]] keys (its own new
 * key included, already stored). Returns 0, or -1 when scratch memory ran out. */
int paged_decode_f32(float *out, const float *q, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, const int32_t *context_lens,
                     const int64_t *seqs, const int64_t *rows, int64_t num_decodes,
                     int64_t q_tok, int64_t out_tok, int64_t bt_stride, int64_t block_size,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    int failed = 0;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) reduction(| : failed) if (num_decodes * num_kv_heads > 1)
    for (int64_t i = 0; i < num_decodes; i++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t seq = seqs[i], context = context_lens[seq];
            float *scores = malloc(group * context * sizeof(float));
            if (scores == NULL) {
                failed = 1;
                continue;
            }
            const int64_t first_head = h * group; /* this KV head's query heads, in a row */
            attend_one(out + rows[i] * out_tok + first_head * head_dim,
                       q + rows[i] * q_tok + first_head * head_dim, k_cache, v_cache,
                       block_tables + seq * bt_stride, context, h, group, block_size,
                       num_kv_heads, head_dim, scale, scores);
            free(scores);
        }
    }
    return failed ? -1 : 0;
}
