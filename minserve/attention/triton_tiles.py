"""The paged decode kernel taken apart: its two per-tile steps as kernels of their own.

For every tile of BLOCK_N tokens, `paged_decode_kernel` (triton_decode.py) does two things:
it gathers the tile's K and V rows through the block table (`gather_kv_kernel` here), and
it scores the query against them and takes a softmax (`tile_attention_kernel` here, which
stops after one tile: its context fits in one). The decode kernel's loop is these two
bodies, repeated tile after tile, with the running max and sum carried from one tile to the
next (the online softmax). The engine launches only the decode kernel; chapter 02 builds up
to it through these two (exercises 2.4 and 2.5), each checked on its own against torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minserve.attention import triton_env  # noqa: F401  (TRITON_INTERPRET on a CPU)


# >>> exercise 2.4: gather K rows through the block table
@triton.jit
def gather_kv_kernel(
    cache_ptr,  # [num_blocks, block_size, Hkv, D]: the pool's K (or V) of one layer
    block_table_ptr,  # [max_blocks] int32: one sequence's physical blocks, in order
    out_ptr,  # [num_tiles * BLOCK_N, D]: the sequence's rows of one KV head, contiguous
    context_len,  # tokens in the sequence
    kv_head,
    block_size,  # tokens per KV block
    head_dim,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_ot,
    BLOCK_N: tl.constexpr,  # tokens per program (one tile)
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
):  # fmt: skip
    """Copy the tile of tokens [tile * BLOCK_N, (tile + 1) * BLOCK_N) to rows of `out`.

    Token t sits in physical block `block_table[t // block_size]` at offset
    `t % block_size`. Load only tokens below `context_len` (the rest of the pool belongs to
    other sequences, or to nobody; the block table may hold garbage past the context) and
    store token t's row of KV head `kv_head` to row t of `out`. Rows past the context stay
    as they were.
    """
    tile = tl.program_id(0)
    tokens = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]: this program's positions
    dims = tl.arange(0, BLOCK_D)
    # >>> solution
    valid = tokens < context_len
    blocks = tl.load(block_table_ptr + tokens // block_size, mask=valid, other=0)
    rows = blocks.to(tl.int64) * stride_cb + (tokens % block_size) * stride_cs  # [BLOCK_N]
    mask = valid[:, None] & (dims < head_dim)[None, :]  # [BLOCK_N, BLOCK_D]
    cols = kv_head * stride_ch + dims[None, :] * stride_cd  # [1, BLOCK_D]
    tile_kv = tl.load(cache_ptr + rows[:, None] + cols, mask=mask)  # [BLOCK_N, BLOCK_D]
    tl.store(out_ptr + tokens[:, None] * stride_ot + dims[None, :], tile_kv, mask=mask)
    # <<< solution


# <<< exercise


# >>> exercise 2.5: one tile of softmax attention
@triton.jit
def tile_attention_kernel(
    q_ptr,  # [Hq, D]: one sequence's query token
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D], the same strides as k_cache
    block_table_ptr,  # [max_blocks] int32: the sequence's physical blocks
    out_ptr,  # [Hq, D]
    context_len,  # tokens in the sequence: at most BLOCK_N
    scale,  # softmax scale, usually 1 / sqrt(head_dim)
    block_size,
    head_dim,
    group,  # query heads per KV head (GQA ratio)
    stride_qh,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_oh,
    BLOCK_N: tl.constexpr,  # the tile: context_len padded to a power of two
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Attend one query head over a context that fits one tile: `out[head]` =
    softmax(scale * K q) V over the sequence's first `context_len` tokens.

    Gather the tile's K and V as in exercise 2.4 (masked: other=0.0), convert them to fp32,
    score q against every key, give the slots past the context a score of -inf, and take
    the softmax with its maximum subtracted first (exp of a large score overflows). Leave
    the output row `out` [BLOCK_D] for the store below.
    """
    head = tl.program_id(0)
    kv_head = head // group  # grouped-query attention: the KV head this query head reads
    tokens = tl.arange(0, BLOCK_N)  # [BLOCK_N]: the whole context, one tile
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + head * stride_qh + dims, mask=dims < head_dim, other=0.0)
    q = q.to(tl.float32)  # [BLOCK_D]
    # >>> solution
    valid = tokens < context_len
    blocks = tl.load(block_table_ptr + tokens // block_size, mask=valid, other=0)
    rows = blocks.to(tl.int64) * stride_cb + (tokens % block_size) * stride_cs  # [BLOCK_N]
    mask = valid[:, None] & (dims < head_dim)[None, :]
    cols = kv_head * stride_ch + dims[None, :] * stride_cd
    k = tl.load(k_cache_ptr + rows[:, None] + cols, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_cache_ptr + rows[:, None] + cols, mask=mask, other=0.0).to(tl.float32)
    scores = tl.sum(q[None, :] * k, axis=1) * scale  # [BLOCK_N]
    scores = tl.where(valid, scores, float("-inf"))
    p = tl.exp(scores - tl.max(scores, axis=0))  # [BLOCK_N]: 0 past the context
    out = tl.sum(p[:, None] * v, axis=0) / tl.sum(p, axis=0)  # [BLOCK_D]
    # <<< solution
    tl.store(out_ptr + head * stride_oh + dims, out, mask=dims < head_dim)


# <<< exercise


def gather_kv(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    kv_head: int,
    block_n: int = 4,
    kernel: triton.JITFunction = gather_kv_kernel,
) -> torch.Tensor:
    """One sequence's rows of one KV head, gathered through its block table, one program per
    tile of `block_n` tokens: [num_tiles * block_n, D], zero past the context."""
    head_dim = cache.shape[3]
    num_tiles = triton.cdiv(max(context_len, 1), block_n)
    out = cache.new_zeros((num_tiles * block_n, head_dim))  # [tokens, D]
    kernel[(num_tiles,)](
        cache, block_table, out, context_len, kv_head, cache.shape[1], head_dim,
        *cache.stride(), out.stride(0),
        BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out


def tile_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float | None = None,
    kernel: triton.JITFunction = tile_attention_kernel,
) -> torch.Tensor:
    """Decode attention for one sequence whose context fits one tile: q [Hq, D] -> [Hq, D]
    (fp32), one program per query head."""
    q = q.contiguous()  # the kernel reads a head's dims at stride 1
    num_heads, head_dim = q.shape
    if num_heads % k_cache.shape[2]:
        raise ValueError(f"{num_heads} query heads cannot share {k_cache.shape[2]} KV heads")
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # [Hq, D]
    kernel[(num_heads,)](
        q, k_cache, v_cache, block_table, out, context_len,
        scale if scale is not None else head_dim**-0.5,
        k_cache.shape[1], head_dim, num_heads // k_cache.shape[2],
        q.stride(0), *k_cache.stride(), out.stride(0),
        BLOCK_N=triton.next_power_of_2(max(context_len, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out
