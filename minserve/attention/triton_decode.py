"""Paged decode attention in Triton: one query token per sequence, keys read through the
block table (PagedAttention), softmax computed online in one pass (FlashAttention).

One program handles one sequence, one KV head and one *split* of the context. Grouped-query
attention: the program serves every query head that shares its KV head, so each K/V tile
is loaded once for the whole group. With one split the program writes the final output;
with several (flash-decoding, for long contexts and small batches) each writes its part's
output and log-sum-exp, and `combine_splits_kernel` merges them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch
import triton
import triton.language as tl

from minserve.attention import triton_env  # noqa: F401  (TRITON_INTERPRET on a CPU)
from minserve.attention.triton_env import compile_for_any, dot_precision
from minserve.attention.triton_prefill import paged_prefill_kernel
from minserve.attention.triton_store import paged_store_kernel

MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism


# >>> exercise 2.6: the paged decode kernel
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

    # >>> solution
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
    # <<< solution

    # An empty split (a short sequence in a long batch) has l = 0: output 0, weight 0.
    l_safe = tl.where(l > 0, l, 1.0)
    out = acc / l_safe[:, None]
    out_rows = out_ptr + seq * stride_os + heads[:, None] * stride_oh + split * stride_osplit
    tl.store(out_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)
    lse_rows = lse_ptr + seq * stride_ls + heads * stride_lh + split
    lse = tl.where(l > 0, m + tl.log2(l_safe), float("-inf"))
    tl.store(lse_rows, lse, mask=group < GROUP)


# <<< exercise


# >>> exercise 2.7: combine the splits (flash-decoding)
@triton.jit
def combine_splits_kernel(
    part_ptr,  # [S, Hq, num_splits, D] fp32: each split's normalised output
    lse_ptr,  # [S, Hq, num_splits] fp32: each split's log2-sum-exp
    out_ptr,  # [S, Hq, D]
    stride_ps, stride_ph, stride_psplit,
    stride_ls, stride_lh,
    stride_os, stride_oh,
    num_splits,
    head_dim,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Merge the splits of one (sequence, head) into its output.

    Split i wrote its normalised output `part_i` [D] and `lse_i` = log2 of its sum of
    exp2(scores): its share of the softmax's denominator is 2^lse_i. So the output is
    sum_i 2^lse_i part_i / sum_i 2^lse_i; subtract the largest lse before exp2 (no
    overflow). An empty split has lse = -inf: weight 0. Mask the splits past `num_splits`
    (other=-inf for lse) and leave the merged row `out` [BLOCK_D] for the store below.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    # >>> solution
    lse = tl.load(
        lse_ptr + seq * stride_ls + head * stride_lh + splits,
        mask=splits < num_splits,
        other=float("-inf"),
    )  # [BLOCK_SPLITS]; an empty split has -inf and weighs nothing
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    mask = (splits < num_splits)[:, None] & (dims < head_dim)[None, :]
    parts = tl.load(
        part_ptr
        + seq * stride_ps
        + head * stride_ph
        + splits[:, None] * stride_psplit
        + dims[None, :],
        mask=mask,
        other=0.0,
    )  # [BLOCK_SPLITS, BLOCK_D]
    out = tl.sum(weights[:, None] * parts, axis=0) / tl.sum(weights, axis=0)
    # <<< solution
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


# <<< exercise


# Integers that change from step to step compile no new variant (the warm-up's promise).
paged_decode_kernel = compile_for_any(
    paged_decode_kernel, "stride_qs", "stride_bs", "stride_os", "stride_oh", "stride_ls",
    "stride_lh",
)  # fmt: skip
combine_splits_kernel = compile_for_any(
    combine_splits_kernel, "stride_ps", "stride_ph", "stride_ls", "stride_lh", "num_splits"
)


@dataclass(frozen=True)
class DecodeKernels:
    """The kernels of the Triton backend's steps: the two `paged_decode` launches, the store
    of the step's k/v (`paged_store`) and the prefill chunks' attention (`paged_prefill`);
    chapter 02's exercises can replace any of them
    (`LLM(attention_backend="triton", decode_kernels=DecodeKernels.from_module(m))`)."""

    decode: triton.JITFunction = paged_decode_kernel
    combine: triton.JITFunction = combine_splits_kernel
    store: triton.JITFunction = paged_store_kernel
    prefill: triton.JITFunction = paged_prefill_kernel

    @classmethod
    def from_module(cls, module: ModuleType) -> DecodeKernels:
        """The module's `paged_decode_kernel`, `combine_splits_kernel`, `paged_store_kernel`
        and `paged_prefill_kernel`."""
        return cls(
            module.paged_decode_kernel,
            module.combine_splits_kernel,
            module.paged_store_kernel,
            module.paged_prefill_kernel,
        )


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, device: torch.device
) -> int:
    """Flash-decoding's split count: enough programs to fill the GPU, none too short."""
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: splitting only adds work
    programs = num_seqs * num_kv_heads
    sms = torch.cuda.get_device_properties(device).multi_processor_count  # this GPU's
    wanted = math.ceil(2 * sms / programs)
    return max(1, min(wanted, max_context_len // MIN_TOKENS_PER_SPLIT, 64))


def split_plan(
    num_seqs: int,
    num_kv_heads: int,
    max_context_len: int,
    device: torch.device,
    num_splits: int | None = None,
    block_n: int = 64,
) -> tuple[int, int]:
    """A decode step's (splits, context tokens per split): the chooser's count (or the one
    given), then as many splits as whole tiles of `block_n` tokens need."""
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context_len, device)
    context = max(max_context_len, 1)
    tokens_per_split = triton.cdiv(triton.cdiv(context, num_splits), block_n) * block_n
    return triton.cdiv(context, tokens_per_split), tokens_per_split


def decode_variant(num_splits: int) -> int:
    """What a decode step with `num_splits` compiles, as one number: 1 for one pass (its
    output in the query's dtype), else the combine's BLOCK_SPLITS (fp32 parts, combined)."""
    return 1 if num_splits == 1 else triton.next_power_of_2(num_splits)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
    kernel: triton.JITFunction = paged_decode_kernel,
    combine_kernel: triton.JITFunction = combine_splits_kernel,
) -> torch.Tensor:
    """Decode attention: q [S, Hq, D] over each sequence's paged K/V -> [S, Hq, D].

    `kernel` and `combine_kernel` may be any kernels with `paged_decode_kernel`'s and
    `combine_splits_kernel`'s signatures (chapter 02's exercises 2.6 and 2.7).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    _check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens)
    num_splits, tokens_per_split = split_plan(
        num_seqs, num_kv_heads, max_context_len, q.device, num_splits, block_n
    )
    out = q.new_empty(q.shape)  # [S, Hq, D], contiguous whatever q's strides
    if num_splits == 1:  # the kernel's output is final: write it in place
        parts = out.view(num_seqs, num_heads, 1, head_dim)
    else:
        parts = q.new_empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32)
    lse = q.new_empty((num_seqs, num_heads, num_splits), dtype=torch.float32)
    group = num_heads // num_kv_heads
    kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, parts, lse,
        *q.stride(), *k_cache.stride(), block_tables.stride(0),
        *parts.stride()[:3], *lse.stride()[:2],
        scale if scale is not None else head_dim**-0.5,
        tokens_per_split, k_cache.shape[1], head_dim,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PRECISION=dot_precision(k_cache.dtype),
    )  # fmt: skip
    if num_splits > 1:
        combine_splits(parts, lse, out, combine_kernel)
    return out


def combine_splits(
    parts: torch.Tensor,
    lse: torch.Tensor,
    out: torch.Tensor,
    kernel: triton.JITFunction = combine_splits_kernel,
) -> torch.Tensor:
    """Merge parts [S, Hq, splits, D] (fp32) weighted by lse [S, Hq, splits] into out [S, Hq, D]."""
    num_seqs, num_heads, num_splits, head_dim = parts.shape
    kernel[(num_seqs, num_heads)](
        parts, lse, out, *parts.stride()[:3], *lse.stride()[:2], *out.stride()[:2],
        num_splits, head_dim,
        BLOCK_SPLITS=decode_variant(num_splits),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out


def _check_decode_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly; "
            "grouped-query attention needs a whole number of query heads per KV head"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if q.shape[0] != block_tables.shape[0] or q.shape[0] != context_lens.shape[0]:
        raise ValueError(
            f"{q.shape[0]} query rows but {block_tables.shape[0]} block tables and "
            f"{context_lens.shape[0]} context lengths; need one of each per sequence"
        )
