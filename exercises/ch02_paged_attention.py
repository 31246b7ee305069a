# Your workspace for chapter 02 (Paged attention): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 02` from the repository root.
# Generated from minserve/attention/triton_first_steps.py, minserve/attention/triton_tiles.py, minserve/attention/triton_decode.py, minserve/attention/triton_store.py, minserve/attention/triton_prefill.py by `python -m minserve.course.generate`.
# stub fingerprint: 3a2ec9b0688f (lets the generator tell your edits from a stale stub)
"""Chapter 02, Paged attention: the Triton kernels of the engine's attention.

2.1-2.3 are Triton's first moves: one program per block (`tl.program_id`,
`tl.arange`), masked loads and stores, a 2-D tile through strides; launch them with
`scale_vector`, `add_vectors` and `copy_tile`. 2.4 gathers a sequence's K rows
through its block table; 2.5 attends one query over a context that fits one tile;
2.6 is the engine's decode kernel, an online softmax tile after tile; 2.7 merges the
splits of flash-decoding; 2.8 stores a step's new keys and values in the pool by
slot; 2.9 attends a prefill chunk causally over its cached prefix and itself. Launch
them with `gather_kv`, `tile_attention`, `paged_decode(..., kernel=,
combine_kernel=)`, `paged_store(..., kernel=)` and `paged_prefill(..., kernel=)`;
run the engine on 2.6-2.9 with `LLM(attention_backend="triton",
plugins=CoursePlugins(decode_kernels=DecodeKernels.from_module(module)))`.
On a CPU they run in Triton's interpreter (TRITON_INTERPRET=1, set by
minserve.attention.triton_env).
"""

import triton
import triton.language as tl

from minserve.attention import triton_env  # noqa: F401  (before any @triton.jit)
from minserve.attention.triton_decode import DecodeKernels  # noqa: F401
from minserve.attention.triton_decode import paged_decode  # noqa: F401
from minserve.attention.triton_store import paged_store  # noqa: F401
from minserve.attention.triton_env import dot_precision  # noqa: F401
from minserve.attention.triton_first_steps import (  # noqa: F401
    add_vectors,
    copy_tile,
    scale_vector,
)
from minserve.attention.triton_prefill import paged_prefill  # noqa: F401
from minserve.attention.triton_tiles import gather_kv, tile_attention  # noqa: F401


# Exercise 2.1: one program per block (tl.program_id and tl.arange)
@triton.jit
def scale_kernel(
    x_ptr,  # [n]: n a multiple of BLOCK
    out_ptr,  # [n]
    factor,
    BLOCK: tl.constexpr,  # elements per program
):
    """out = factor * x, one program per block of BLOCK elements.

    The launcher starts n // BLOCK programs; program p owns elements p * BLOCK up to
    p * BLOCK + BLOCK - 1. Build the program's offsets from its id and `tl.arange`, load its
    block of x, and store factor times it at the same offsets of out.
    """
    raise NotImplementedError("Exercise 2.1: one program per block (tl.program_id and tl.arange)")


# Exercise 2.2: a masked load and store (vectors of any length)
@triton.jit
def add_kernel(
    x_ptr,  # [n]
    y_ptr,  # [n]
    out_ptr,  # [n]
    n,
    BLOCK: tl.constexpr,
):
    """out = x + y for any n: cdiv(n, BLOCK) programs, so the last block may stick out.

    Lanes at offsets >= n lie past the vectors: memory that belongs to something else. Mask
    them off in both loads and in the store, so they read and write nothing.
    """
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    raise NotImplementedError("Exercise 2.2: a masked load and store (vectors of any length)")


# Exercise 2.3: a 2-D tile with strides
@triton.jit
def copy_tile_kernel(
    x_ptr,  # [rows, cols], any strides: element (r, c) is at x_ptr + r * stride_r + c * stride_c
    out_ptr,  # [rows, cols], contiguous: element (r, c) is at out_ptr + r * cols + c
    rows,
    cols,
    stride_r,
    stride_c,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Copy x into a contiguous out, one program per [BLOCK_R, BLOCK_C] tile.

    Program (i, j) = (`tl.program_id(0)`, `tl.program_id(1)`) copies rows i * BLOCK_R ...
    and columns j * BLOCK_C ...: a [BLOCK_R] vector of rows and a [BLOCK_C] vector of
    columns, broadcast into a [BLOCK_R, BLOCK_C] tile of pointers (`r[:, None]`,
    `c[None, :]`). Mask the tiles that stick out past the last row or column.
    """
    raise NotImplementedError("Exercise 2.3: a 2-D tile with strides")


# Exercise 2.4: gather K rows through the block table
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
    raise NotImplementedError("Exercise 2.4: gather K rows through the block table")


# Exercise 2.5: one tile of softmax attention
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
    raise NotImplementedError("Exercise 2.5: one tile of softmax attention")
    tl.store(out_ptr + head * stride_oh + dims, out, mask=dims < head_dim)


# Exercise 2.6: the paged decode kernel
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

    raise NotImplementedError("Exercise 2.6: the paged decode kernel")

    # An empty split (a short sequence in a long batch) has l = 0: output 0, weight 0.
    l_safe = tl.where(l > 0, l, 1.0)
    out = acc / l_safe[:, None]
    out_rows = out_ptr + seq * stride_os + heads[:, None] * stride_oh + split * stride_osplit
    tl.store(out_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)
    lse_rows = lse_ptr + seq * stride_ls + heads * stride_lh + split
    lse = tl.where(l > 0, m + tl.log2(l_safe), float("-inf"))
    tl.store(lse_rows, lse, mask=group < GROUP)


# Exercise 2.7: combine the splits (flash-decoding)
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
    raise NotImplementedError("Exercise 2.7: combine the splits (flash-decoding)")
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


# Exercise 2.8: store the step's keys and values by slot
@triton.jit
def paged_store_kernel(
    k_ptr,  # [T, Hkv, D]: the step's new keys
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # the same strides as k_cache
    slot_mapping_ptr,  # [T] int64
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,  # num_kv_heads padded to a power of two
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two
):  # fmt: skip
    """Copy token `program_id(0)`'s K and V rows [Hkv, D] to its slot of both caches.

    Read the token's slot from `slot_mapping`; a negative slot is padding: store nothing
    (mask every load and store with it, never branch). Slot s is offset s % block_size of
    block s // block_size; do the slot arithmetic in int64 (a large pool overflows int32).
    Mask the heads and dims past `num_kv_heads` and `head_dim` (BLOCK_H and BLOCK_D are
    padded to powers of two), follow every tensor's own strides (k and v may be views
    into a wider qkv tensor) and convert to the cache's dtype before storing.
    """
    token = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    raise NotImplementedError("Exercise 2.8: store the step's keys and values by slot")


# Exercise 2.9: the paged prefill kernel (causal, over the cached prefix)
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
    raise NotImplementedError("Exercise 2.9: the paged prefill kernel (causal, over the cached prefix)")

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    out_rows = out_ptr + (query_start + rows)[:, None] * stride_ot + head * stride_oh
    tl.store(out_rows + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)
