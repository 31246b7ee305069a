/* The kernels a decoder layer is made of, as the other files define them: what
 * `decode_layers.c` calls to run a whole layer without going back to Python. */
#pragma once
#include <stdint.h>

void rms_norm_f32(float *out, const float *x, const float *weight, int64_t rows, int64_t dim,
                  int64_t x_stride, int64_t out_stride, float eps);
void rms_norm_bf16(uint16_t *out, const uint16_t *x, const uint16_t *weight, int64_t rows,
                   int64_t dim, int64_t x_stride, int64_t out_stride, float eps);
void rope_f32(float *out, const float *x, const float *cos, const float *sin, int64_t rows,
              int64_t heads, int64_t head_dim, int64_t x_stride);
void rope_bf16(uint16_t *out, const uint16_t *x, const uint16_t *cos, const uint16_t *sin,
               int64_t rows, int64_t heads, int64_t head_dim, int64_t x_stride);
void silu_mul_f32(float *out, const float *gate_up, int64_t rows, int64_t inner,
                  int64_t in_stride, int64_t out_stride);
void silu_mul_bf16(uint16_t *out, const uint16_t *gate_up, int64_t rows, int64_t inner,
                   int64_t in_stride, int64_t out_stride);

void linear_rows_f32(float *out, const float *x, const float *w, const float *bias, int64_t m,
                     int64_t n, int64_t k);
int linear_rows_bf16(uint16_t *out, const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                     int64_t m, int64_t n, int64_t k);
int linear_panels_bf16(uint16_t *out, const uint16_t *x, const uint16_t *packed,
                       const uint16_t *bias, int64_t m, int64_t n, int64_t k);
int quant_rows_q8_0(void *out, const void *x, const uint8_t *w, const float *bias, int64_t m,
                    int64_t n, int64_t k, int64_t io_bf16);
int quant_rows_q4_0(void *out, const void *x, const uint8_t *w, const float *bias, int64_t m,
                    int64_t n, int64_t k, int64_t io_bf16);
int quant_rows_q4_1(void *out, const void *x, const uint8_t *w, const float *bias, int64_t m,
                    int64_t n, int64_t k, int64_t io_bf16);
int quant_panels_q8_0(uint16_t *out, const uint16_t *x, const uint8_t *w, const uint16_t *bias,
                      int64_t m, int64_t n, int64_t k);
int quant_panels_q4_0(uint16_t *out, const uint16_t *x, const uint8_t *w, const uint16_t *bias,
                      int64_t m, int64_t n, int64_t k);
int quant_panels_q4_1(uint16_t *out, const uint16_t *x, const uint8_t *w, const uint16_t *bias,
                      int64_t m, int64_t n, int64_t k);
int int8_rows(void *out, const void *x, const int8_t *w, const float *scales, const float *bias,
              int64_t m, int64_t n, int64_t k, int64_t io_bf16);

void store_kv(void *k_cache, void *v_cache, const void *k, const void *v, const int64_t *slots,
              int64_t num_tokens, int64_t k_tok, int64_t v_tok, int64_t row);
void store_kv_int8_f32(void *k_cache, void *v_cache, const void *k, const void *v,
                       const int64_t *slots, int64_t num_tokens, int64_t k_tok, int64_t v_tok,
                       int64_t heads, int64_t head_dim);
void store_kv_int8_bf16(void *k_cache, void *v_cache, const void *k, const void *v,
                        const int64_t *slots, int64_t num_tokens, int64_t k_tok, int64_t v_tok,
                        int64_t heads, int64_t head_dim);
int paged_decode_f32(void *out, const void *q, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, const int32_t *context_lens,
                     const int64_t *seqs, const int64_t *rows, int64_t num_decodes,
                     int64_t q_tok, int64_t out_tok, int64_t bt_stride, int64_t block_size,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                     int64_t io_bf16);
int paged_decode_bf16(void *out, const void *q, const uint16_t *k_cache,
                      const uint16_t *v_cache, const int32_t *block_tables,
                      const int32_t *context_lens, const int64_t *seqs, const int64_t *rows,
                      int64_t num_decodes, int64_t q_tok, int64_t out_tok, int64_t bt_stride,
                      int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, float scale, int64_t io_bf16);
int paged_decode_i8(void *out, const void *q, const uint8_t *k_cache, const uint8_t *v_cache,
                    const int32_t *block_tables, const int32_t *context_lens,
                    const int64_t *seqs, const int64_t *rows, int64_t num_decodes,
                    int64_t q_tok, int64_t out_tok, int64_t bt_stride, int64_t block_size,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
                    int64_t io_bf16);
