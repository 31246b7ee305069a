"""Paged prefill / extend attention in Triton: variable-length query chunks, each attending
causally over its sequence's cached prefix (read through the block table) and itself.

This is what chunked prefill (Sarathi-Serve) and a prefix cache need: a chunk's first
query sits at position `context_len - query_len`, after tokens earlier steps (or another
request sharing the prefix) already stored. One program handles BLOCK_M query tokens of
one sequence and one query head, and walks the keys BLOCK_N at a time with an online
softmax (FlashAttention), stopping at the tile's last query position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minserve.attention import triton_env  # noqa: F401  (TRITON_INTERPRET on a CPU)
from minserve.attention.triton_env import compile_for_any, dot_precision


# >>> exercise 2.9: the paged prefill kernel (causal, over the cached prefix)
@triton.jit
def paged_prefill_kernel(
    q_ptr,  # [T, Hq, D]: the step's query tokens, each sequence's rows contiguous
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D], the step's own k/v already stored
    v_cache_ptr,
    block_tables_ptr,  # [S, max_blocks] int32
    query_starts_ptr,  # [S] int32: row of each sequence's first query token
    query_lens_ptr,  # [S] int32
    context_lens_ptr,  # [S] int32: cached prefix + query_len
    out_ptr,  # [T, Hq, D]
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bs,
    stride_ot, stride_oh,
    scale,
    block_size,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # keys per loop iteration
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """Causal attention of BLOCK_M query tokens of one sequence and head over its pages.

    Load the tile's queries [BLOCK_M, BLOCK_D] (rows query_start + rows of q, masked by
    q_mask, in fp32) and fold scale * log2(e) into them, for exp2 in the softmax. The
    chunk's query i sits at position `positions[i]` = prefix + i and sees keys 0 to
    positions[i] (the cached prefix and the chunk up to itself; the step's own k/v are in
    the pool already). Walk the keys BLOCK_N at a time, from 0 to the tile's last valid
    query position (a tile wholly past the chunk reads none): look each key up in the
    block table, load K and V of the query head's KV head (GQA: head // GROUP) masked past
    the keys' end, score with tl.dot, -inf where a key is not visible to a row, and keep
    the online softmax of 2.6. Key 0 is visible to every row, so each valid row's max is
    finite. Leave `m` [BLOCK_M], `l` [BLOCK_M] and `acc` [BLOCK_M, BLOCK_D] for the lines
    after the loop.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    query_start = tl.load(query_starts_ptr + seq)
    query_len = tl.load(query_lens_ptr + seq)
    context_len = tl.load(context_lens_ptr + seq)
    prefix = context_len - query_len  # tokens cached before this chunk

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the chunk
    row_valid = rows < query_len
    positions = prefix + rows  # [BLOCK_M]: query i sees keys 0..positions[i]
    dims = tl.arange(0, BLOCK_D)
    q_mask = row_valid[:, None] & (dims < head_dim)[None, :]
    # >>> solution
    q = tl.load(
        q_ptr
        + (query_start + rows)[:, None] * stride_qt
        + head * stride_qh
        + dims[None, :] * stride_qd,
        mask=q_mask,
        other=0.0,
    ).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    q = q * (scale * 1.4426950408889634)  # fold log2(e): softmax with exp2
    # keys up to the tile's last valid query; a tile past the chunk's end reads none
    last = tl.minimum(tile * BLOCK_M + BLOCK_M, query_len)
    end = tl.where(tile * BLOCK_M < query_len, prefix + last, 0)
    table = block_tables_ptr + seq * stride_bs
    kv_base = (head // GROUP) * stride_ch + dims[None, :] * stride_cd  # [1, BLOCK_D]
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for first in range(0, end, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        key_valid = keys < end
        blocks = tl.load(table + keys // block_size, mask=key_valid, other=0)
        slots = blocks.to(tl.int64) * stride_cb + (keys % block_size) * stride_cs
        kv_mask = key_valid[:, None] & (dims < head_dim)[None, :]
        k = tl.load(k_cache_ptr + slots[:, None] + kv_base, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + slots[:, None] + kv_base, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)
        # Key 0 is visible to every row, so each row's max is finite from the first tile on.
        visible = key_valid[None, :] & (keys[None, :] <= positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        m = m_new
    # <<< solution

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    out_rows = out_ptr + (query_start + rows)[:, None] * stride_ot + head * stride_oh
    tl.store(out_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


# <<< exercise


# a step's block table width changes from step to step: one compiled variant serves all
paged_prefill_kernel = compile_for_any(paged_prefill_kernel, "stride_bs")


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    out: torch.Tensor,
    scale: float | None = None,
    block_m: int = 16,
    block_n: int = 64,
    kernel: triton.JITFunction = paged_prefill_kernel,
) -> torch.Tensor:
    """Extend attention for the sequences listed: writes their rows of `out` [T, Hq, D].

    Sequence i's queries are rows query_starts[i] .. + query_lens[i] of q; rows of other
    sequences are left untouched (the decode kernel fills them). `kernel` may be any kernel
    with `paged_prefill_kernel`'s signature (chapter 02's exercise 2.9).
    """
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly; "
            "grouped-query attention needs a whole number of query heads per KV head"
        )
    num_seqs = query_lens.shape[0]
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    kernel[grid](
        q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, out,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), *out.stride()[:2],
        scale if scale is not None else head_dim**-0.5,
        k_cache.shape[1], head_dim,
        GROUP=num_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PRECISION=dot_precision(k_cache.dtype),
    )  # fmt: skip
    return out
