"""Paged decode attention in Triton over an 8-bit KV cache (`kv_cache_dtype`).

The pool holds bytes (`minserve/kvcache/kv_format.py`): fp8 e4m3 / e5m2 values, or int8
values followed by each row's fp16 scale. The kernel loads those bytes and widens them to
fp32 itself, by bit arithmetic (the interpreter has no fp8 type): an fp8 byte's exponent and
mantissa fields move into a float32's places; an int8 value is multiplied by its row's scale.
So a decode reads a quarter of an fp32 cache's bytes, half of a bfloat16 one's.

One program handles one sequence and one KV head, for every query head that shares it
(GQA), with an online softmax over the context (one pass, as `triton_decode.py`).
`int8_store_kernel` quantizes a step's keys and values as it stores them (the fp8 formats
are converted by torch and their bytes stored by `triton_store.py`'s kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minserve.attention import triton_env  # noqa: F401  (TRITON_INTERPRET on a CPU)
from minserve.kvcache.kv_format import KVFormat

E4M3, E5M2, INT8 = 0, 1, 2  # the kernel's FORMAT
FORMAT_CODES = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2, "int8": INT8}


@triton.jit
def minifloat(byte, MANT_BITS: tl.constexpr, BIAS: tl.constexpr):
    """An 8-bit float's byte (as int32) -> float32: fields moved, exponent rebiased; a
    subnormal read as the number with exponent field 1, less that field's implicit one."""
    em = byte & 0x7F
    sub = em < (1 << MANT_BITS)
    bits = ((em + tl.where(sub, 1 << MANT_BITS, 0)) << (23 - MANT_BITS)) + ((127 - BIAS) << 23)
    f = bits.to(tl.float32, bitcast=True)
    one = (tl.zeros_like(bits) + ((128 - BIAS) << 23)).to(tl.float32, bitcast=True)  # 2^(1-BIAS)
    f = tl.where(sub, f - one, f)
    return tl.where((byte & 0x80) != 0, -f, f)


@triton.jit
def widen(byte, FORMAT: tl.constexpr):
    """Stored bytes (as int32, 0..255) -> their values in float32 (int8: before its scale)."""
    if FORMAT == 0:
        return minifloat(byte, 3, 7)  # e4m3
    elif FORMAT == 1:
        return minifloat(byte, 2, 15)  # e5m2
    else:
        return tl.where(byte > 127, byte - 256, byte).to(tl.float32)  # two's complement


@triton.jit
def row_scales(cache_ptr, rows, valid, head_dim, FORMAT: tl.constexpr):
    """Each row's multiplier [BLOCK_N]: its int8 scale (two bytes after its values, fp16,
    little-endian), or 1.0 for fp8."""
    if FORMAT == 2:
        lo = tl.load(cache_ptr + rows + head_dim, mask=valid, other=0).to(tl.int32)
        hi = tl.load(cache_ptr + rows + head_dim + 1, mask=valid, other=0).to(tl.int32)
        half = (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        return half.to(tl.float32)
    else:
        return tl.full(rows.shape, 1.0, dtype=tl.float32)


@triton.jit(do_not_specialize=["stride_qs", "stride_bs"])  # they change per step
def kv8_decode_kernel(
    q_ptr,  # [S, Hq, D]: each sequence's one query token
    k_cache_ptr,  # [num_blocks, block_size, Hkv, row] uint8 (the pool's bytes)
    v_cache_ptr,  # the same strides as k_cache
    block_tables_ptr,  # [S, max_blocks] int32
    context_lens_ptr,  # [S] int32: tokens to attend over, the new one included
    out_ptr,  # [S, Hq, D]
    stride_qs, stride_qh,
    stride_cb, stride_cs, stride_ch,  # bytes; a row's bytes are contiguous
    stride_bs,
    stride_os, stride_oh,
    scale,
    block_size,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two
    BLOCK_N: tl.constexpr,  # context tokens per loop iteration
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
    FORMAT: tl.constexpr,  # E4M3, E5M2 or INT8
):  # fmt: skip
    """Attend one sequence's query heads of one KV head over its whole context, in fp32."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    group = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + group
    dims = tl.arange(0, BLOCK_D)
    q_mask = (group < GROUP)[:, None] & (dims < head_dim)[None, :]
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0
    ).to(tl.float32)  # [BLOCK_G, BLOCK_D]
    table = block_tables_ptr + seq * stride_bs
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for first in range(0, context_len, BLOCK_N):
        tokens = first + tl.arange(0, BLOCK_N)
        valid = tokens < context_len
        blocks = tl.load(table + tokens // block_size, mask=valid, other=0)
        rows = blocks.to(tl.int64) * stride_cb + (tokens % block_size) * stride_cs
        rows += kv_head * stride_ch  # [BLOCK_N]: each token's row of this KV head
        kv_mask = valid[:, None] & (dims < head_dim)[None, :]
        k_bytes = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0)
        v_bytes = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0)
        k = widen(k_bytes.to(tl.int32), FORMAT)  # [BLOCK_N, BLOCK_D]
        k = k * row_scales(k_cache_ptr, rows, valid, head_dim, FORMAT)[:, None]
        v = widen(v_bytes.to(tl.int32), FORMAT)
        v = v * row_scales(v_cache_ptr, rows, valid, head_dim, FORMAT)[:, None]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l[:, None]
    out_rows = out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def quantize_row_store(src, cache_ptr, rows, dims, heads_ok, head_dim):
    """Rows [BLOCK_H, BLOCK_D] at `src` -> int8 values at cache_ptr + rows + d, then each
    row's fp16 scale's two bytes at + head_dim (`kv_format.quantize_int8`, bit for bit)."""
    mask = heads_ok[:, None] & (dims < head_dim)[None, :]
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    absmax = tl.max(tl.abs(x), axis=1)  # [BLOCK_H]
    scale = tl.minimum(absmax / 127.0, 65504.0).to(tl.float16)
    scale32 = scale.to(tl.float32)
    safe = tl.where(scale32 > 0, scale32, 1.0)
    y = tl.div_rn(x, safe[:, None])  # |y| <= 127 and a little: the fp16 scale's rounding
    y = (y + 12582912.0) - 12582912.0  # rounded to nearest even (1.5 x 2^23 trick)
    q = tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int32)
    tl.store(cache_ptr + rows[:, None] + dims[None, :], (q & 0xFF).to(tl.uint8), mask=mask)
    bits = scale.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF  # [BLOCK_H], little-endian:
    tl.store(cache_ptr + rows + head_dim, (bits & 0xFF).to(tl.uint8), mask=heads_ok)
    tl.store(cache_ptr + rows + head_dim + 1, (bits >> 8).to(tl.uint8), mask=heads_ok)


@triton.jit
def int8_store_kernel(
    k_ptr,  # [T, Hkv, D]: the step's new keys
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D + 2] uint8
    v_cache_ptr,  # the same strides as k_cache
    slot_mapping_ptr,  # [T] int64; negative: padding, store nothing
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Quantize token `program_id(0)`'s K and V rows [Hkv, D] into its slot of both caches."""
    token = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads_ok = (heads < num_kv_heads) & (slot >= 0)  # [BLOCK_H]
    rows = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + heads * stride_ch
    k_src = k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    v_src = v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    quantize_row_store(k_src, k_cache_ptr, rows, dims, heads_ok, head_dim)
    quantize_row_store(v_src, v_cache_ptr, rows, dims, heads_ok, head_dim)


def int8_store(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Quantize k, v [T, Hkv, D] into an int8 pool [blocks, bs, Hkv, D + 2] at their slots:
    `kv_format.Int8Format.encode` then `paged_store_reference`, in one kernel."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("int8_store needs each key, value and cache row contiguous")
    if num_tokens == 0:
        return
    int8_store_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3],
        k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit tensor's bytes as uint8 (a view): the kernels address fp8 as bytes."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def kv8_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    fmt: KVFormat,
    scale: float | None = None,
    block_n: int = 16,
) -> torch.Tensor:
    """q [S, Hq, D] (one token per sequence) over an 8-bit pool [blocks, bs, Hkv, row] ->
    [S, Hq, D] in q's dtype. The same contract as the decode rows of `paged_torch.py`."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    if k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("kv8_decode needs each KV row and each query head contiguous")
    out = torch.empty_like(q)
    k_bytes, v_bytes = as_bytes(k_cache), as_bytes(v_cache)
    group = num_heads // num_kv_heads
    kv8_decode_kernel[(num_seqs, num_kv_heads)](
        q, k_bytes, v_bytes, block_tables, context_lens, out,
        q.stride(0), q.stride(1), *k_bytes.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale if scale is not None else head_dim**-0.5, block_size, head_dim,
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), FORMAT=FORMAT_CODES[fmt.name],
    )  # fmt: skip
    return out
