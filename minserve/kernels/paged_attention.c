/* PagedAttention's two CPU kernels in C: store a step's k/v, attend for every query row.
 *
 * Plain torch runs a decode's attention as a chain of ops per layer: copy the sequence's
 * blocks out of the pool (index_select, twice), then torch's attention over the copy. For
 * one query token per sequence the arithmetic is tiny, so the copies and the ops' fixed
 * costs are most of the time. These kernels read the blocks where they lie, through the
 * block table, in one call per layer (vLLM's CPU backend does the same in C++). A prompt's
 * rows are queries too, each over the keys up to its own position (a short prompt's keys
 * stay in cache while its rows read them): over prompts of 32-256 tokens this took 0.46 of
 * the time of torch's flash attention on the prompts' own k/v; a long prompt's first chunk
 * still runs torch's (`FLASH_FROM` in `attention/paged_cpu.py`).
 *
 * Layouts (what `paged_cpu.py` passes; strides in elements):
 *   k_cache, v_cache  [num_blocks, block_size, Hkv, row], contiguous (one layer of the pool),
 *                     fp32 (`paged_decode_f32`) or bfloat16 (`paged_decode_bf16`: half the
 *                     bytes a decode reads; each key and value widened as it is read), or
 *                     8 bits (`kv_format.py`): fp8 e4m3 / e5m2 (`paged_decode_e4m3`, `_e5m2`)
 *                     or int8 (`paged_decode_i8`), its row D values then an fp16 scale
 *                     (row = D + 2 bytes), the scale applied to each dot product and weight
 *   q, out            [T, Hq, D] fp32, or bfloat16 where `io_bf16` (a bfloat16 model's step:
 *                     each task reads its query rows as they are against a bfloat16 cache on
 *                     a CPU with AVX512-BF16, else widens them, and rounds its output rows
 *                     back), token stride q_tok, out_tok; heads and D contiguous
 *   block_tables      [num_seqs, max_blocks] int32, row stride bt_stride
 * Query head h reads KV head h / (Hq / Hkv) (grouped-query attention). Each (query row, KV
 * head) pair is one task for OpenMP: the pair's query heads share every K/V row it reads.
 * Softmax is exact (two passes over the scores), accumulated in fp32.
 *
 * Built and loaded by `build.py`; `paged_torch.py` is the reference it is tested on.
 */

#include <math.h>
#include <stdint.h>

#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"
#include "vec16.h"

/* Write token t's k and v (`row` bytes each, at byte strides k_tok, v_tok) to its slot:
 * any dtype, the cache's own (an 8-bit cache's rows come encoded, by `kv_format.py`). */
void store_kv(void *k_cache, void *v_cache, const void *k, const void *v, const int64_t *slots,
              int64_t num_tokens, int64_t k_tok, int64_t v_tok, int64_t row) {
    for (int64_t t = 0; t < num_tokens; t++) {
        memcpy((char *)k_cache + slots[t] * row, (const char *)k + t * k_tok, row);
        memcpy((char *)v_cache + slots[t] * row, (const char *)v + t * v_tok, row);
    }
}

/* An fp16 scale's bits as a float (a normal number or zero: absmax / 127 of finite values). */
static inline float half_scale(uint16_t h) {
    if ((h & 0x7c00u) == 0) return (float)(h & 0x3ffu) * 0x1p-24f; /* zero, subnormals */
    const uint32_t bits = ((uint32_t)(h & 0x7fffu) << 13) + (112u << 23);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The fp16 bits of a finite x in [0, 65504], rounded to nearest, ties to even (as torch's
 * .to(torch.float16)): zero and subnormals count in steps of 2^-24 (1024 steps make the
 * smallest normal, whose bits are 1024), normals keep 10 of float32's 23 mantissa bits. */
static inline uint16_t half_bits(float x) {
    if (x < 0x1p-14f) return (uint16_t)rintf(x * 0x1p24f);
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint32_t h = (((bits >> 23) - 112u) << 10) | ((bits & 0x7fffffu) >> 13);
    const uint32_t rest = bits & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)h;
}

/* One KV head's D values (x, in format f) as an int8 cache row: D int8, then the fp16
 * scale absmax / 127 (saturating at fp16's largest), q = round(x / scale) to even, in
 * [-127, 127]; an all-zero row gets scale 0 and q 0 (`kv_format.quantize_int8`, bit for
 * bit). */
ALWAYS_INLINE void encode_int8_row(uint8_t *restrict out, const void *restrict x, int64_t d,
                                   Format f) {
    float absmax = 0.0f;
    for (int64_t i = 0; i < d; i++) absmax = fmaxf(absmax, fabsf(load_as(x, i, f)));
    const uint16_t h = half_bits(fminf(absmax / 127.0f, 65504.0f));
    const float scale = half_scale(h), safe = scale > 0.0f ? scale : 1.0f;
    for (int64_t i = 0; i < d; i++) {
        const float q = rintf(load_as(x, i, f) / safe);
        out[i] = (uint8_t)(int8_t)fminf(fmaxf(q, -127.0f), 127.0f);
    }
    memcpy(out + d, &h, sizeof h);
}

/* store_kv for an int8 cache: token t's k and v (Hkv heads of D values in format f, token
 * strides k_tok and v_tok in elements) encoded into their slot's rows of D + 2 bytes. One
 * call where encoding in torch takes a dozen ops per layer. */
static void store_kv_int8(void *k_cache, void *v_cache, const void *k, const void *v,
                          const int64_t *slots, int64_t num_tokens, int64_t k_tok,
                          int64_t v_tok, int64_t heads, int64_t head_dim, Format f) {
    const int64_t row = head_dim + 2;
    for (int64_t t = 0; t < num_tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = (slots[t] * heads + h) * row;
            encode_int8_row((uint8_t *)k_cache + at, element_at(k, t * k_tok + h * head_dim, f),
                            head_dim, f);
            encode_int8_row((uint8_t *)v_cache + at, element_at(v, t * v_tok + h * head_dim, f),
                            head_dim, f);
        }
}
void store_kv_int8_f32(void *k_cache, void *v_cache, const void *k, const void *v,
                       const int64_t *slots, int64_t num_tokens, int64_t k_tok, int64_t v_tok,
                       int64_t heads, int64_t head_dim) {
    store_kv_int8(k_cache, v_cache, k, v, slots, num_tokens, k_tok, v_tok, heads, head_dim, F32);
}
void store_kv_int8_bf16(void *k_cache, void *v_cache, const void *k, const void *v,
                        const int64_t *slots, int64_t num_tokens, int64_t k_tok, int64_t v_tok,
                        int64_t heads, int64_t head_dim) {
    store_kv_int8(k_cache, v_cache, k, v, slots, num_tokens, k_tok, v_tok, heads, head_dim, BF16);
}

/* q . key, the key stored in format f. */
ALWAYS_INLINE float dot(const float *restrict q, const void *restrict key, int64_t n, Format f) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += q[i] * load_as(key, i, f);
    return s;
}

/* y += a * x, x stored in format f. */
ALWAYS_INLINE void axpy(float *restrict y, float a, const void *restrict x, int64_t n,
                        Format f) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * load_as(x, i, f);
}

/* Ask for the next block's rows of these heads while this block is computed: blocks sit
 * anywhere in the pool, so the hardware cannot guess where the next one starts. Into L2
 * (prefetcht1), a few rows at a time between the computing: a burst of prefetches into L1
 * filled its miss buffers and held the loads up behind them (with the pool in DRAM, one
 * layer's decode took 1.6x as long at batch 8, 48 and 64 on the 2-core EPYC). */
static void prefetch_rows(const void *row, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)row + i, 0, 2);
}

/* Where a task's pass over a sequence reads: its block table and the slots' layout. */
typedef struct {
    const int32_t *table;
    int64_t context, block_size, token_row; /* token_row: one slot, every KV head */
    int64_t first, count;                   /* the KV heads this task covers */
    int64_t head_dim, group;                /* group: query heads per KV head */
    int64_t row;                            /* one KV head's stored elements: D (int8: D + 2) */
} Pass;

/* What a stored K or V row's values are multiplied by: its int8 scale, stored after its
 * head_dim values; 1 in the other formats. */
ALWAYS_INLINE float row_scale(const void *row, int64_t head_dim, Format f) {
    if (f != I8) return 1.0f;
    uint16_t h;
    memcpy(&h, (const char *)row + head_dim, sizeof h);
    return half_scale(h);
}

/* Block b of the sequence in `cache`, at the task's first head (NULL past the context). */
ALWAYS_INLINE const void *block_at(const void *cache, const Pass *p, int64_t b, Format f) {
    if (b * p->block_size >= p->context) return NULL;
    const int64_t block_row = p->block_size * p->token_row;
    return element_at(cache, (int64_t)p->table[b] * block_row + p->first * p->row, f);
}

/* Tokens of the sequence in block b: block_size, or fewer in its last block. */
static int64_t tokens_in(const Pass *p, int64_t b) {
    const int64_t left = p->context - b * p->block_size;
    return left < p->block_size ? left : p->block_size;
}

/* scores[r][j] = q_r . k_j * scale for the task's query rows r (count * group of them),
 * walking the sequence's blocks in order, each slot's heads read as one run; one dot
 * product (and its lane sum) at a time: any head_dim. */
ALWAYS_INLINE void score_each_key(float *scores, const float *q, const void *k_cache,
                                  const Pass *p, float scale, Format f) {
    const int64_t span = p->count * p->row * format_bytes(f), rows = p->count * p->group;
    for (int64_t b = 0, j0 = 0; j0 < p->context; b++, j0 += p->block_size) {
        const void *block = block_at(k_cache, p, b, f), *next = block_at(k_cache, p, b + 1, f);
        for (int64_t j = 0; j < tokens_in(p, b); j++) {
            const void *slot = element_at(block, j * p->token_row, f);
            if (next != NULL) prefetch_rows(element_at(next, j * p->token_row, f), span);
            for (int64_t r = 0; r < rows; r++) {
                const void *key = element_at(slot, (r / p->group) * p->row, f);
                const float qk = dot(q + r * p->head_dim, key, p->head_dim, f) *
                                 row_scale(key, p->head_dim, f);
                scores[r * p->context + j0 + j] = qk * scale;
            }
        }
    }
}

/* The slots (every KV head from the task's first) of keys j .. j + n - 1 in `cache`, n <= LANES,
 * walking the block table from key j's block: one division per chunk of keys, not one per
 * key. Lanes past n repeat the first slot (their scores are computed and dropped). */
ALWAYS_INLINE void chunk_slots(const void *slot[LANES], const void *cache, const Pass *p,
                               int64_t j, int64_t n, Format f) {
    int64_t b = j / p->block_size, offset = j % p->block_size;
    const void *block = block_at(cache, p, b, f);
    for (int64_t t = 0; t < n; t++) {
        slot[t] = element_at(block, offset * p->token_row, f);
        if (++offset == p->block_size && t + 1 < n) {
            offset = 0;
            block = block_at(cache, p, ++b, f);
        }
    }
    for (int64_t t = n; t < LANES; t++) slot[t] = slot[0];
}

/* Sixteen keys' products with one query row, lane-wise, added into parts[REVERSED[t]] for
 * key t (lane_sums16 finishes the dot products): the query row fp32 and each key widened from
 * format f as it is read; or, where `pairs` (a bfloat16 query row against a bfloat16 cache,
 * head_dim a multiple of 32, AVX512-BF16), both read as stored: each vdpbf16ps multiplies 32
 * pairs of bfloat16 exactly and adds each pair's two products into one fp32 lane, a quarter
 * of the instructions widening takes (the fp32 sums in another order; subnormal inputs read
 * as zero). */
ALWAYS_INLINE void multiply_keys(f32x16 parts[LANES], const void *qr, const void *slot[LANES],
                                 int64_t head, int64_t head_dim, Format f, int pairs) {
#if defined(__AVX512BF16__)
    if (pairs) {
        for (int64_t c = 0; c < head_dim; c += 2 * LANES) {
            const __m512bh qc = (__m512bh)_mm512_loadu_si512((const uint16_t *)qr + c);
            for (int t = 0; t < LANES; t++) {
                const __m512bh kc =
                    (__m512bh)_mm512_loadu_si512((const uint16_t *)slot[t] + head + c);
                parts[REVERSED[t]] =
                    (f32x16)_mm512_dpbf16_ps((__m512)parts[REVERSED[t]], qc, kc);
            }
        }
        return;
    }
#endif
    for (int64_t c = 0; c < head_dim; c += LANES) {
        const f32x16 qc = load16((const float *)qr + c);
        for (int t = 0; t < LANES; t++) parts[REVERSED[t]] += qc * load16_as(slot[t], head + c, f);
    }
}

/* True where multiply_keys can take bfloat16 query rows as they are (see there). */
static int reads_pairs(int64_t head_dim) {
#if defined(__AVX512BF16__)
    return head_dim % (2 * LANES) == 0;
#else
    (void)head_dim;
    return 0;
#endif
}

/* score_each_key for head_dim a multiple of 16, sixteen keys at a time: each query row's
 * sixteen products stay as vectors and are summed together (lane_sums16), not one lane sum
 * per key, which was most of the work at head_dim 64. The next sixteen keys' slots are found
 * and fetched meanwhile, a few keys between one query row and the next (blocks sit
 * anywhere in the pool, so the hardware cannot guess them), and kept for the next round.
 * q is fp32, or bfloat16 where `pairs` (multiply_keys). */
ALWAYS_INLINE void score_keys(float *scores, const void *q, const void *k_cache,
                              const Pass *p, float scale, Format f, int pairs) {
    if (p->head_dim % LANES != 0) {
        score_each_key(scores, q, k_cache, p, scale, f);
        return;
    }
    const int64_t rows = p->count * p->group, q_bytes = pairs ? 2 : 4;
    const int64_t span = p->count * p->row * format_bytes(f);
    const void *slot[LANES], *next[LANES];
    chunk_slots(slot, k_cache, p, 0, p->context < LANES ? p->context : LANES, f);
    for (int64_t j0 = 0; j0 < p->context; j0 += LANES) {
        const int64_t n = p->context - j0 < LANES ? p->context - j0 : LANES;
        const int64_t left = p->context - (j0 + LANES), ahead = left < LANES ? left : LANES;
        if (ahead > 0) /* the next chunk's slots: fetched now, scored next round */
            chunk_slots(next, k_cache, p, j0 + LANES, ahead, f);
        int64_t fetched = 0; /* of the next chunk's keys: spread over the query rows */
        for (int64_t r = 0; r < rows; r++) {
            const int64_t upto = ahead * (r + 1) / rows;
            for (; fetched < upto; fetched++) prefetch_rows(next[fetched], span);
            const void *qr = (const char *)q + r * p->head_dim * q_bytes;
            f32x16 parts[LANES] = {0};
            multiply_keys(parts, qr, slot, (r / p->group) * p->row, p->head_dim, f, pairs);
            f32x16 s = lane_sums16(parts) * scale; /* lane t: key t */
            if (f == I8)
                for (int t = 0; t < LANES; t++)
                    s[t] *= row_scale(element_at(slot[t], (r / p->group) * p->row, f),
                                      p->head_dim, f);
            memcpy(scores + r * p->context + j0, &s, n * sizeof(float));
        }
        if (ahead > 0) memcpy(slot, next, sizeof slot);
    }
}

/* Each row of scores [rows, context] -> its softmax, exact: max, exp, sum, divide. */
static void softmax_rows(float *scores, int64_t rows, int64_t context) {
    for (int64_t r = 0; r < rows; r++) {
        float *s = scores + r * context;
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
}

/* out_r = sum_j p_rj v_j for the task's query rows, blocks walked as in score_each_key;
 * each value row added into every query row's output in memory: any head_dim. */
ALWAYS_INLINE void weigh_each_value(float *out, const float *probs, const void *v_cache,
                                    const Pass *p, Format f) {
    const int64_t span = p->count * p->row * format_bytes(f), rows = p->count * p->group;
    memset(out, 0, rows * p->head_dim * sizeof(float));
    for (int64_t b = 0, j0 = 0; j0 < p->context; b++, j0 += p->block_size) {
        const void *block = block_at(v_cache, p, b, f), *next = block_at(v_cache, p, b + 1, f);
        for (int64_t j = 0; j < tokens_in(p, b); j++) {
            const void *slot = element_at(block, j * p->token_row, f);
            if (next != NULL) prefetch_rows(element_at(next, j * p->token_row, f), span);
            for (int64_t r = 0; r < rows; r++) {
                const void *value = element_at(slot, (r / p->group) * p->row, f);
                const float weight =
                    probs[r * p->context + j0 + j] * row_scale(value, p->head_dim, f);
                axpy(out + r * p->head_dim, weight, value, p->head_dim, f);
            }
        }
    }
}

/* weigh_each_value for head_dim a multiple of 16 up to 128: one query row at a time, its
 * output held in registers over the whole context instead of loaded and stored for every
 * value row (the rows a KV head's queries share come from L1 or L2 the second time). */
enum { MAX_VECS = 8 };
ALWAYS_INLINE void weigh_each_row(float *out, const float *probs, const void *v_cache,
                                  const Pass *p, Format f) {
    const int64_t vecs = p->head_dim / LANES;
    for (int64_t r = 0; r < p->count * p->group; r++) {
        const float *pr = probs + r * p->context;
        const int64_t head = (r / p->group) * p->row;
        f32x16 sums[MAX_VECS] = {0};
        for (int64_t b = 0, j0 = 0; j0 < p->context; b++, j0 += p->block_size) {
            const void *slot = element_at(block_at(v_cache, p, b, f), head, f);
            for (int64_t j = 0; j < tokens_in(p, b); j++) {
                const float w = pr[j0 + j] * row_scale(slot, p->head_dim, f);
                const f32x16 weight = {w, w, w, w, w, w, w, w, w, w, w, w, w, w, w, w};
                for (int64_t c = 0; c < vecs; c++)
                    sums[c] = fma16(weight, load16_as(slot, c * LANES, f), sums[c]);
                slot = element_at(slot, p->token_row, f);
            }
        }
        memcpy(out + r * p->head_dim, sums, p->head_dim * sizeof(float));
    }
}

/* Query rows r .. r + nr - 1, all of one KV head, against its values: each value row read and
 * widened once for the nr rows (nr * vecs sums and vecs values in registers, nr and vecs
 * constants where this is inlined), each added with one fused multiply-add (`fma16`: this
 * file is compiled without contraction, and a multiply then an add is twice the work). */
ALWAYS_INLINE void weigh_rows(float *out, const float *probs, const void *v_cache,
                              const Pass *p, int64_t r, int nr, int vecs, Format f) {
    const int64_t head = (r / p->group) * p->row;
    const int64_t span = p->count * p->row * format_bytes(f);
    f32x16 sums[4][MAX_VECS] = {{0}};
    for (int64_t b = 0, j0 = 0; j0 < p->context; b++, j0 += p->block_size) {
        const void *slot = element_at(block_at(v_cache, p, b, f), head, f);
        const void *next = r == 0 ? block_at(v_cache, p, b + 1, f) : NULL;
        const int64_t next_tokens = next != NULL ? tokens_in(p, b + 1) : 0;
        for (int64_t j = 0; j < tokens_in(p, b); j++) {
            if (j < next_tokens) /* every head's rows of the next block, a token per token */
                prefetch_rows(element_at(next, j * p->token_row, f), span);
            const float row_weight = row_scale(slot, p->head_dim, f);
            f32x16 value[MAX_VECS];
            for (int c = 0; c < vecs; c++) value[c] = load16_as(slot, c * LANES, f);
            for (int g = 0; g < nr; g++) {
                const float w = probs[(r + g) * p->context + j0 + j] * row_weight;
                const f32x16 weight = {w, w, w, w, w, w, w, w, w, w, w, w, w, w, w, w};
                for (int c = 0; c < vecs; c++) sums[g][c] = fma16(weight, value[c], sums[g][c]);
            }
            slot = element_at(slot, p->token_row, f);
        }
    }
    for (int g = 0; g < nr; g++) memcpy(out + (r + g) * p->head_dim, sums[g], vecs * 64);
}

/* weigh_rows over every KV head of the task, `most` of a head's query rows at a time (its
 * group may be larger), for head_dim = vecs * 16. */
ALWAYS_INLINE void weigh_groups(float *out, const float *probs, const void *v_cache,
                                const Pass *p, int vecs, int most, Format f) {
    for (int64_t r = 0; r < p->count * p->group;) {
        const int64_t left = p->group - r % p->group; /* rows of this head not yet weighed */
        const int nr = left < most ? (int)left : most;
        switch (nr) {
        case 1: weigh_rows(out, probs, v_cache, p, r, 1, vecs, f); break;
        case 2: weigh_rows(out, probs, v_cache, p, r, 2, vecs, f); break;
        case 3: weigh_rows(out, probs, v_cache, p, r, 3, vecs, f); break;
        default: weigh_rows(out, probs, v_cache, p, r, 4, vecs, f); break;
        }
        r += nr;
    }
}

/* out_r = sum_j p_rj v_j for the task's query rows. Grouped-query heads share their KV head's
 * value rows, so at head_dim 64 (128) up to four (two) of them are weighed together, each
 * value widened once for all; other multiples of 16 one row at a time; the rest by
 * weigh_each_value. */
ALWAYS_INLINE void weigh_values(float *out, const float *probs, const void *v_cache,
                                const Pass *p, Format f) {
    if (p->head_dim == 4 * LANES)
        weigh_groups(out, probs, v_cache, p, 4, 4, f);
    else if (p->head_dim == 8 * LANES)
        weigh_groups(out, probs, v_cache, p, 8, 2, f);
    else if (p->head_dim % LANES == 0 && p->head_dim / LANES <= MAX_VECS)
        weigh_each_row(out, probs, v_cache, p, f);
    else
        weigh_each_value(out, probs, v_cache, p, f);
}

/* One task of the decode: its sequence's Pass, its query rows at q (fp32, or bfloat16 where
 * `pairs`), its fp32 output rows at out. Returns 0, or 1 when scratch memory ran out. */
ALWAYS_INLINE int decode_task(float *out, const void *q, const void *k_cache,
                              const void *v_cache, const Pass *pass, float scale, Format f,
                              int pairs) {
    const int64_t rows = pass->count * pass->group;
    float *scores = malloc(rows * pass->context * sizeof(float));
    if (scores == NULL) return 1;
    score_keys(scores, q, k_cache, pass, scale, f, pairs);
    softmax_rows(scores, rows, pass->context);
    weigh_values(out, scores, v_cache, pass, f);
    free(scores);
    return 0;
}

/* One function per cache format, so that each is compiled with its format a constant (the
 * parallel loop below is outlined by OpenMP before anything is inlined into it). */
typedef int (*TaskFn)(float *, const void *, const void *, const void *, const Pass *, float);
static int decode_task_f32(float *out, const void *q, const void *k_cache, const void *v_cache,
                           const Pass *pass, float scale) {
    return decode_task(out, q, k_cache, v_cache, pass, scale, F32, 0);
}
static int decode_task_bf16(float *out, const void *q, const void *k_cache,
                            const void *v_cache, const Pass *pass, float scale) {
    return decode_task(out, q, k_cache, v_cache, pass, scale, BF16, 0);
}
static int decode_task_e4m3(float *out, const void *q, const void *k_cache,
                            const void *v_cache, const Pass *pass, float scale) {
    return decode_task(out, q, k_cache, v_cache, pass, scale, E4M3, 0);
}
static int decode_task_e5m2(float *out, const void *q, const void *k_cache,
                            const void *v_cache, const Pass *pass, float scale) {
    return decode_task(out, q, k_cache, v_cache, pass, scale, E5M2, 0);
}
static int decode_task_i8(float *out, const void *q, const void *k_cache, const void *v_cache,
                          const Pass *pass, float scale) {
    return decode_task(out, q, k_cache, v_cache, pass, scale, I8, 0);
}
/* A bfloat16 model's task over a bfloat16 cache, its query rows read as stored (`pairs`). */
static int decode_task_bf16_pairs(float *out, const void *q, const void *k_cache,
                                  const void *v_cache, const Pass *pass, float scale) {
    return decode_task(out, q, k_cache, v_cache, pass, scale, BF16, 1);
}
static const TaskFn TASKS[] = {
    [F32] = decode_task_f32, [BF16] = decode_task_bf16, [E4M3] = decode_task_e4m3,
    [E5M2] = decode_task_e5m2, [I8] = decode_task_i8,
};

/* A task of a bfloat16 model's step: its query rows widened to fp32 (unless `run` reads them
 * as they are: `widen_q` 0), the task run, its fp32 output rows rounded back to bfloat16 (`n`
 * values each way: the task's heads of one token, a few hundred). Returns 0, or 1 when
 * scratch memory ran out. */
static int bf16_task(uint16_t *out, const uint16_t *q, const void *k_cache, const void *v_cache,
                     const Pass *pass, float scale, TaskFn run, int64_t n, int widen_q) {
    float *rows = malloc(2 * n * sizeof(float)); /* [query rows | output rows] */
    if (rows == NULL) return 1;
    for (int64_t i = 0; widen_q && i < n; i++) rows[i] = widen(q[i]);
    const int failed = run(rows + n, widen_q ? (const void *)rows : q, k_cache, v_cache, pass,
                           scale);
    for (int64_t i = 0; i < n; i++) out[i] = narrow(rows[n + i]);
    free(rows);
    return failed;
}

/* Attention for `num_decodes` query rows: query i is the token at row rows[i] of sequence
 * seqs[i], whose blocks are block_tables[seqs[i]], and reads the first context_lens[i] keys
 * of it (its own, already stored, the last): a decode's whole context, or a prompt row's
 * keys up to its own position, so a prefill chunk is as many queries as it has rows. q and
 * out are fp32, or bfloat16 where `io_bf16` (a bfloat16 model's step, whatever the cache's
 * format). One task per query, reading each slot's KV heads as one run; with fewer queries
 * than threads, one task per (query, KV head) instead, so that every thread has work.
 * Returns 0, or -1 when scratch memory ran out. */
static int paged_decode(void *out, const void *q, const void *k_cache, const void *v_cache,
                        const int32_t *block_tables, const int32_t *context_lens,
                        const int64_t *seqs, const int64_t *rows, int64_t num_decodes,
                        int64_t q_tok, int64_t out_tok, int64_t bt_stride, int64_t block_size,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                        int64_t io_bf16, Format f) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t per_task = num_decodes >= omp_get_max_threads() ? num_kv_heads : 1;
    const int64_t tasks_per_seq = num_kv_heads / per_task;
    const int pairs = io_bf16 && f == BF16 && reads_pairs(head_dim); /* multiply_keys */
    const TaskFn run = pairs ? decode_task_bf16_pairs : TASKS[f];
    const int64_t row = f == I8 ? head_dim + 2 : head_dim; /* int8: the fp16 scale follows */
    int failed = 0;
    const int64_t num_tasks = num_decodes * tasks_per_seq;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed) if (num_tasks > 1)
    for (int64_t task = 0; task < num_tasks; task++) {
        const int64_t i = task / tasks_per_seq, seq = seqs[i];
        const Pass pass = {
            .table = block_tables + seq * bt_stride, .context = context_lens[i],
            .block_size = block_size, .token_row = num_kv_heads * row,
            .first = task % tasks_per_seq * per_task, .count = per_task,
            .head_dim = head_dim, .group = group, .row = row,
        };
        const int64_t first_row = pass.first * group * head_dim; /* its query heads, in a row */
        const int64_t at_q = rows[i] * q_tok + first_row, at_out = rows[i] * out_tok + first_row;
        if (io_bf16)
            failed |= bf16_task((uint16_t *)out + at_out, (const uint16_t *)q + at_q, k_cache,
                                v_cache, &pass, scale, run, per_task * group * head_dim, !pairs);
        else
            failed |= run((float *)out + at_out, (const float *)q + at_q, k_cache, v_cache,
                          &pass, scale);
    }
    return failed ? -1 : 0;
}

/* One entry point per cache format (fp32, bfloat16, then the 8-bit ones of `kv_format.py`,
 * their bytes widened to fp32 as they are read). */
#define PAGED_DECODE(name, cache_t, format)                                                   \
    int name(void *out, const void *q, const cache_t *k_cache, const cache_t *v_cache,       \
             const int32_t *block_tables, const int32_t *context_lens, const int64_t *seqs,  \
             const int64_t *rows, int64_t num_decodes, int64_t q_tok, int64_t out_tok,       \
             int64_t bt_stride, int64_t block_size, int64_t num_heads, int64_t num_kv_heads, \
             int64_t head_dim, float scale, int64_t io_bf16) {                               \
        return paged_decode(out, q, k_cache, v_cache, block_tables, context_lens, seqs,      \
                            rows, num_decodes, q_tok, out_tok, bt_stride, block_size,        \
                            num_heads, num_kv_heads, head_dim, scale, io_bf16, format);      \
    }
PAGED_DECODE(paged_decode_f32, float, F32)
PAGED_DECODE(paged_decode_bf16, uint16_t, BF16)
PAGED_DECODE(paged_decode_e4m3, uint8_t, E4M3)
PAGED_DECODE(paged_decode_e5m2, uint8_t, E5M2)
PAGED_DECODE(paged_decode_i8, uint8_t, I8)
