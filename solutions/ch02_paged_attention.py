# Generated from minserve/attention/triton_decode.py by `python -m minserve.course.generate`;
# edit the marked regions there, not here.
"""Chapter 02, Paged attention: the Triton decode kernel.

One program attends one sequence's query heads (those sharing a KV head) over its
keys and values, found through the block table, with an online softmax. Launch
your kernel with `paged_decode(..., kernel=paged_decode_kernel)`; on a CPU it runs
in Triton's interpreter (TRITON_INTERPRET=1, set by minserve.attention.triton_env).
"""

import triton
import triton.language as tl

from minserve.attention import triton_env  # noqa: F401  (before any @triton.jit)
from minserve.attention.triton_decode import paged_decode  # noqa: F401


# Exercise 2.1: the paged decode kernel
@triton.jit
def paged_decode_kernel(
    q_ptr,  # [S, Hq, D]: each sequence's one query token
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D], the same strides as k_cache
    block_tables_ptr,  # [S, max_blocks] int32: physical block of each logical block
    context_lens_ptr,  # [S] int32: tokens to attend over, the new one included
    out_ptr,  # [S, Hq, num_splits, D]: each split's normalised output
    lse_ptr,  # [S, Hq, num_splits] fp32: each split's log2-sum-exp of scores
    stride_qs, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bs,
    stride_os, stride_oh, stride_osplit,
    stride_ls, stride_lh,
    scale,  # softmax scale, usually 1 / sqrt(head_dim)
    tokens_per_split,  # context tokens per split, a multiple of BLOCK_N
    block_size,  # tokens per KV block
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head (GQA ratio)
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two, at least 16 (for tl.dot)
    BLOCK_N: tl.constexpr,  # context tokens per loop iteration
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 caches
):  # fmt: skip
    """Attend one sequence's query heads of one KV head over one split of its context.

    Token t of the sequence sits in physical block `block_tables[seq, t // block_size]` at
    offset `t % block_size`. Walk the split's tokens BLOCK_N at a time: look up each
    token's block, load its K and V (masked: never read past the context), score the
    queries against them and keep an online softmax, so the context is read exactly once.
    q arrives pre-multiplied by scale * log2(e): use exp2 for the softmax. Leave the running
    max `m` [BLOCK_G], sum `l` [BLOCK_G] and weighted sum of values `acc` [BLOCK_G, BLOCK_D]
    for the lines after the loop, which normalise and store them.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(context_len, start + tokens_per_split)

    group = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + group  # the query heads that share this KV head
    dims = tl.arange(0, BLOCK_D)
    q_mask = (group < GROUP)[:, None] & (dims < head_dim)[None, :]
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=q_mask,
        other=0.0,
    ).to(tl.float32)  # [BLOCK_G, BLOCK_D]
    q = q * (scale * 1.4426950408889634)  # fold the scale and log2(e): softmax with exp2
    table = block_tables_ptr + seq * stride_bs
    kv_base = kv_head * stride_ch + dims[None, :] * stride_cd  # [1, BLOCK_D]

    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max of scores
    l = tl.zeros([BLOCK_G], dtype=tl.float32)  # running sum of exp2(score - m)  # noqa: E741
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)  # running sum of weights * v
    for first in range(start, end, BLOCK_N):
        tokens = first + tl.arange(0, BLOCK_N)
        valid = tokens < end
        blocks = tl.load(table + tokens // block_size, mask=valid, other=0)  # [BLOCK_N]
        rows = blocks.to(tl.int64) * stride_cb + (tokens % block_size) * stride_cs  # [BLOCK_N]
        kv_mask = valid[:, None] & (dims < head_dim)[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + kv_base, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + kv_base, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)
        scores = tl.where(valid[None, :], scores, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)  # rescales what was summed under the old max
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        m = m_new

    # An empty split (a short sequence in a long batch) has l = 0: output 0, weight 0.
    l_safe = tl.where(l > 0, l, 1.0)
    out = acc / l_safe[:, None]
    out_rows = out_ptr + seq * stride_os + heads[:, None] * stride_oh + split * stride_osplit
    tl.store(out_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)
    lse_rows = lse_ptr + seq * stride_ls + heads * stride_lh + split
    lse = tl.where(l > 0, m + tl.log2(l_safe), float("-inf"))
    tl.store(lse_rows, lse, mask=group < GROUP)
