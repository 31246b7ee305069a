/* A decode step's decoder layers in one call (`platforms/cpu/fused_decode.py`).
 *
 * At batch 1 the arithmetic of SmolLM2's 30 layers takes about 10 ms, and walking them in
 * Python, some twenty calls a layer (norms, linears, RoPE, the KV store, attention, the
 * residual adds), costs 3 to 4 ms more: the interpreter, not the CPU, sets a third of the
 * step. This file runs the same kernels, in the same order, on the same inputs, from C: the
 * step's hidden states come out bit for bit as `DecoderLayer.forward` leaves them
 * (`tests/test_decode_layers.py`). A GPU engine gets the same from a CUDA graph (vLLM's
 * decode steps replay one); here there is nothing to capture, only the loop to move.
 *
 * Each layer, for m rows x [m, hidden] (the residual stream, updated in place):
 *   h = rms_norm(x); qkv = h . Wqkv; q, k = rope(q, k); store k, v; a = attend(q)
 *   x = x + a . Wo; h = rms_norm(x); x = x + silu(h . Wgate) * (h . Wup) . Wdown
 * Every tensor is fp32, or bfloat16 (`bf16`) rounded where torch rounds it: each kernel's
 * output, and each residual sum. The linears are whichever kernel the layer's module runs for
 * m rows (`Linear.kind`, filled in by `platforms/cpu/fused_decode.py`); the pool is in the model's
 * dtype or int8 (`kv_int8`). Returns 0, -1 without memory, or a kernel's error.
 */

#include <stdint.h>
#include <stdlib.h>

#include "layer_kernels.h"
#include "vec16.h"

/* Which kernel a linear layer runs (`kernels/decode_layers.py` LINEAR_KINDS). */
enum {
    LINEAR_ROWS = 1, /* few rows, row-major weight (`linear_rows.c`), fp32 or bf16 */
    LINEAR_PANELS,   /* bf16 pair panels (`bf16_panels.c`) */
    QUANT_ROWS_Q8_0, /* GGUF blocks, few rows (`quant_rows.c`) */
    QUANT_ROWS_Q4_0,
    QUANT_ROWS_Q4_1,
    QUANT_PANELS_Q8_0, /* GGUF blocks widened into panels, a bf16 model's many rows */
    QUANT_PANELS_Q4_0,
    QUANT_PANELS_Q4_1,
    INT8_ROWS, /* int8 weights, one fp32 scale per output (`quant_rows.c`) */
};

typedef struct {
    int64_t kind;
    const void *weight; /* the kernel's form of it: row-major, panels, blocks or int8 */
    const float *scales; /* INT8_ROWS */
    const void *bias;    /* NULL, or in the dtype the kernel takes (fp32 for quant and int8) */
    int64_t out_features, in_features;
} Linear;

typedef struct {
    const void *input_norm, *post_norm; /* [hidden] */
    Linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* this layer's pool */
} Layer;

typedef struct {
    int64_t bf16, kv_int8;
    int64_t hidden, num_heads, num_kv_heads, head_dim, inner;
    float eps, scale;
    const void *cos, *sin; /* [m, head_dim]: each row's rotation */
    const int64_t *slots;  /* [m]: where each row's k and v go */
    const int32_t *tables, *context_lens;     /* context_lens [m]: each row's keys */
    const int64_t *decode_seqs, *decode_rows; /* [m]: each row's sequence, and 0 .. m - 1 */
    int64_t table_stride, block_size;
} Step;

static int linear(const Linear *l, void *out, const void *x, int64_t m, int64_t bf16) {
    const int64_t n = l->out_features, k = l->in_features;
    switch (l->kind) {
    case LINEAR_ROWS:
        if (!bf16) {
            linear_rows_f32(out, x, l->weight, l->bias, m, n, k);
            return 0;
        }
        return linear_rows_bf16(out, x, l->weight, l->bias, m, n, k);
    case LINEAR_PANELS: return linear_panels_bf16(out, x, l->weight, l->bias, m, n, k);
    case QUANT_ROWS_Q8_0: return quant_rows_q8_0(out, x, l->weight, l->bias, m, n, k, bf16);
    case QUANT_ROWS_Q4_0: return quant_rows_q4_0(out, x, l->weight, l->bias, m, n, k, bf16);
    case QUANT_ROWS_Q4_1: return quant_rows_q4_1(out, x, l->weight, l->bias, m, n, k, bf16);
    case QUANT_PANELS_Q8_0: return quant_panels_q8_0(out, x, l->weight, l->bias, m, n, k);
    case QUANT_PANELS_Q4_0: return quant_panels_q4_0(out, x, l->weight, l->bias, m, n, k);
    case QUANT_PANELS_Q4_1: return quant_panels_q4_1(out, x, l->weight, l->bias, m, n, k);
    case INT8_ROWS: return int8_rows(out, x, l->weight, l->scales, l->bias, m, n, k, bf16);
    default: return -3; /* a kind this file does not know */
    }
}

/* x += y over n values, each sum rounded to bfloat16 where `bf16` (torch's `x + y`). */
static void add_into(void *x, const void *y, int64_t n, int64_t bf16) {
    if (bf16) {
        uint16_t *a = x;
        const uint16_t *b = y;
        for (int64_t i = 0; i < n; i++) a[i] = narrow(widen(a[i]) + widen(b[i]));
    } else {
        float *a = x;
        const float *b = y;
        for (int64_t i = 0; i < n; i++) a[i] += b[i];
    }
}

static void rms_norm(const Step *s, void *out, const void *x, const void *weight, int64_t m) {
    if (s->bf16)
        rms_norm_bf16(out, x, weight, m, s->hidden, s->hidden, s->hidden, s->eps);
    else
        rms_norm_f32(out, x, weight, m, s->hidden, s->hidden, s->hidden, s->eps);
}

/* The scratch a layer's m rows pass through, in elements of the model's dtype. */
typedef struct {
    void *normed, *qkv, *qk, *attended, *gate_up, *act, *sum;
} Scratch;

/* Attention for the m decodes: q and k rotated (qk [m, Hq + Hkv, D]), k and v stored in the
 * pool, every row attending over its sequence's blocks into `attended` [m, Hq * D]. */
static int attend(const Step *s, const Layer *layer, const Scratch *b, int64_t m) {
    const int64_t d = s->head_dim, q_size = s->num_heads * d, kv_size = s->num_kv_heads * d;
    const int64_t qkv_row = q_size + 2 * kv_size, qk_row = q_size + kv_size;
    const int64_t size = s->bf16 ? 2 : 4, heads = s->num_heads + s->num_kv_heads;
    if (s->bf16)
        rope_bf16(b->qk, b->qkv, s->cos, s->sin, m, heads, d, qkv_row);
    else
        rope_f32(b->qk, b->qkv, s->cos, s->sin, m, heads, d, qkv_row);
    const char *k = (const char *)b->qk + q_size * size;
    const char *v = (const char *)b->qkv + qk_row * size;
    if (s->kv_int8 && s->bf16)
        store_kv_int8_bf16(layer->k_cache, layer->v_cache, k, v, s->slots, m, qk_row, qkv_row,
                           s->num_kv_heads, d);
    else if (s->kv_int8)
        store_kv_int8_f32(layer->k_cache, layer->v_cache, k, v, s->slots, m, qk_row, qkv_row,
                          s->num_kv_heads, d);
    else
        store_kv(layer->k_cache, layer->v_cache, k, v, s->slots, m, qk_row * size,
                 qkv_row * size, kv_size * size);
    const void *kc = layer->k_cache, *vc = layer->v_cache;
    if (s->kv_int8)
        return paged_decode_i8(b->attended, b->qk, kc, vc, s->tables, s->context_lens,
                               s->decode_seqs, s->decode_rows, m, qk_row, q_size,
                               s->table_stride, s->block_size, s->num_heads, s->num_kv_heads, d,
                               s->scale, s->bf16);
    if (s->bf16)
        return paged_decode_bf16(b->attended, b->qk, kc, vc, s->tables, s->context_lens,
                                 s->decode_seqs, s->decode_rows, m, qk_row, q_size,
                                 s->table_stride, s->block_size, s->num_heads, s->num_kv_heads,
                                 d, s->scale, 1);
    return paged_decode_f32(b->attended, b->qk, kc, vc, s->tables, s->context_lens,
                            s->decode_seqs, s->decode_rows, m, qk_row, q_size, s->table_stride,
                            s->block_size, s->num_heads, s->num_kv_heads, d, s->scale, 0);
}

/* One pre-norm block on x [m, hidden]: x + attn(norm(x)), then x + mlp(norm(x)). */
static int layer_forward(const Step *s, const Layer *layer, void *x, const Scratch *b,
                         int64_t m) {
    const int64_t n = m * s->hidden;
    int status;
    rms_norm(s, b->normed, x, layer->input_norm, m);
    if ((status = linear(&layer->qkv, b->qkv, b->normed, m, s->bf16))) return status;
    if ((status = attend(s, layer, b, m))) return status;
    if ((status = linear(&layer->o, b->sum, b->attended, m, s->bf16))) return status;
    add_into(x, b->sum, n, s->bf16);
    rms_norm(s, b->normed, x, layer->post_norm, m);
    if ((status = linear(&layer->gate_up, b->gate_up, b->normed, m, s->bf16))) return status;
    if (s->bf16)
        silu_mul_bf16(b->act, b->gate_up, m, s->inner, 2 * s->inner, s->inner);
    else
        silu_mul_f32(b->act, b->gate_up, m, s->inner, 2 * s->inner, s->inner);
    if ((status = linear(&layer->down, b->sum, b->act, m, s->bf16))) return status;
    add_into(x, b->sum, n, s->bf16);
    return 0;
}

/* x [m, hidden] (the embedded tokens, every row a decode) through layers[0 .. num_layers). */
int decode_layers(void *x, const Layer *layers, int64_t num_layers, const Step *s, int64_t m) {
    const int64_t d = s->head_dim, q_size = s->num_heads * d, kv_size = s->num_kv_heads * d;
    const int64_t widths[] = {s->hidden, q_size + 2 * kv_size, q_size + kv_size, q_size,
                              2 * s->inner, s->inner, s->hidden};
    int64_t total = 0;
    for (int i = 0; i < 7; i++) total += m * widths[i];
    char *scratch = malloc(total * (s->bf16 ? 2 : 4));
    if (scratch == NULL) return -1;
    void *parts[7];
    int64_t at = 0;
    for (int i = 0; i < 7; i++) {
        parts[i] = scratch + at;
        at += m * widths[i] * (s->bf16 ? 2 : 4);
    }
    const Scratch b = {parts[0], parts[1], parts[2], parts[3], parts[4], parts[5], parts[6]};
    int status = 0;
    for (int64_t l = 0; l < num_layers && status == 0; l++)
        status = layer_forward(s, &layers[l], x, &b, m);
    free(scratch);
    return status;
}
