"""PagedAttention in plain torch: the CPU backend, and the reference the Triton kernels match.

A step does two things per layer. *Store*: each new token's k/v goes to the pool slot the
scheduler gave it (`slot_mapping`). *Attend*: each query token sees its own sequence's cached
tokens, gathered block by block through the sequence's block table, up to its own position.

Decodes (one query token each) are many and short, so they run together in padded, masked
batches: sorted by context length and cut into buckets of similar lengths, so that little
work goes into padding. Prefill and extend chunks are few and long, so they run one by one.
Math runs in the cache's dtype; torch's attention kernel accumulates in fp32 either way.
An 8-bit cache (`kv_cache_dtype`) is encoded as it is stored and its gathered blocks decoded
to fp32 as they are read; attention over it runs in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minserve.attention.metadata import AttentionMetadata, PagedKVCache, cache_format
from minserve.attention.paged_plan import AttentionGroup, plan_step
from minserve.kvcache.kv_format import KVFormat, attention_dtype, stored_format


def flat_slots(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, Hkv, D] -> [num_blocks * block_size, Hkv, D], a view by slot."""
    try:
        return cache.view(-1, *cache.shape[2:])
    except RuntimeError as e:
        raise ValueError(
            f"a layer's KV cache of shape {tuple(cache.shape)} and strides {cache.stride()} "
            "cannot be viewed as one row per slot; keep each layer's blocks contiguous"
        ) from e


def paged_store_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: KVFormat | None = None,
) -> None:
    """Write k, v [T, Hkv, D] into the caches [num_blocks, block_size, Hkv, row] at their
    slots, encoded in `fmt` (default: the one the cache's dtype names; `kv_format.py`;
    row = D but for int8).

    Slot s is block s // block_size, offset s % block_size: row s of the flat view.
    """
    fmt = fmt or stored_format(k_cache.dtype)
    flat_slots(k_cache)[slot_mapping] = fmt.encode(k)
    flat_slots(v_cache)[slot_mapping] = fmt.encode(v)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]: each query attends causally over its sequence's pages.

    `scale` defaults to 1 / sqrt(head_dim). The step's own k/v must already be stored.
    """
    groups = plan_step(metadata, k_cache.shape[1], attention_dtype(k_cache.dtype))
    return attend_groups(q, k_cache, v_cache, groups, scale)


def attend_groups(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    groups: list[AttentionGroup],
    scale: float | None,
    fmt: KVFormat | None = None,
) -> torch.Tensor:
    """Run each planned group and scatter its output back to its rows: [T, Hq, D].

    The groups' masks are in `attention_dtype(cache dtype)`: the queries are cast to it.
    8-bit rows are decoded by `fmt` (default: the format the cache's dtype names).
    """
    num_heads, head_dim = q.shape[1:]
    fmt, dtype = fmt or stored_format(k_cache.dtype), attention_dtype(k_cache.dtype)
    outputs = []
    for g in groups:
        batch, n = g.positions.shape
        group_q = q[g.rows].view(batch, n, num_heads, head_dim).to(dtype)  # [B, n, Hq, D]
        k = gather_context(k_cache, g)  # [B, S, Hkv, row]
        v = gather_context(v_cache, g)
        if fmt.quantized:  # 8-bit blocks widened to fp32: [B, S, Hkv, D]
            k, v = fmt.decode(k), fmt.decode(v)
        group_out = causal_attention(group_q, k, v, g.mask, scale)  # [B, n, Hq, D]
        outputs.append(group_out.reshape(batch * n, num_heads, head_dim).to(q.dtype))
    if len(groups) == 1 and is_every_row(groups[0].rows, q.shape[0]):
        return outputs[0]  # one group holding every row in order: nothing to scatter
    out = torch.empty_like(q)  # [T, Hq, D]
    for g, group_out in zip(groups, outputs):
        out[g.rows] = group_out
    return out


def is_every_row(rows: torch.Tensor | slice, num_rows: int) -> bool:
    return isinstance(rows, slice) and rows == slice(0, num_rows)


def gather_context(cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """Copy each sequence's blocks out of the pool, in order: [B, num_blocks * block_size, Hkv, D].

    Whole blocks are copied (one index per block, not per token: many times faster on a
    CPU). Keys past a sequence's last position (the rest of its last block, table padding)
    are masked in `causal_attention`; they hold stale but finite values, since the pool
    starts zeroed and only the model writes to it. (A NaN there would still poison the
    output under a zero weight; the Triton kernels never load those slots at all.)
    """
    num_blocks = cache.shape[0]
    batch = group.positions.shape[0]
    rows = cache.view(num_blocks, -1).index_select(0, group.block_index)  # [B * blocks, ...]
    return rows.view(batch, -1, *cache.shape[2:])  # [B, S, Hkv, D]


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """GQA attention of q [B, n, Hq, D] over k, v [B, S, Hkv, D]; `mask` [B, n, S] is added
    to the scores: 0 for the keys each query sees (query at p: keys 0..p), -inf for the rest.

    One mask covers both causality within a chunk and the padding of shorter sequences.
    """
    if q.shape[1] == 1:
        return decode_attention(q, k, v, mask, scale)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [B, Hq, n, D]
        k.transpose(1, 2),  # [B, Hkv, S, D]
        v.transpose(1, 2),
        attn_mask=mask[:, None],  # [B, 1, n, S], the same for every head
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)  # [B, n, Hq, D]


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """One query token per sequence, q [B, 1, Hq, D] over k, v [B, S, Hkv, D] with `mask`
    [B, 1, S]: [B, 1, Hq, D].

    The query heads that share a KV head become that head's query *rows*: [B, Hkv, g, D].
    Each K/V row is then read once for its whole group, where torch's GQA path reads it
    once per query head (several times faster in bf16 on a CPU). All g rows sit at the
    same position, so one mask per sequence covers them.
    """
    batch, _, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    folded = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, g, D]
    out = F.scaled_dot_product_attention(
        folded,
        k.transpose(1, 2),  # [B, Hkv, S, D]
        v.transpose(1, 2),
        attn_mask=mask[:, None],  # [B, 1, 1, S]
        scale=scale,
    )
    return out.view(batch, 1, num_heads, head_dim)


class TorchPagedAttention:
    """`AttentionFn` over a paged KV pool (PagedAttention), in plain torch.

    Built once per step: the step's plan is computed here and reused by every layer.
    """

    def __init__(
        self, kv: PagedKVCache, metadata: AttentionMetadata, scale: float | None = None
    ) -> None:
        self.kv = kv
        self.metadata = metadata
        self.scale = scale
        self.format = cache_format(kv)  # the pool's own: a kv_codec's arithmetic included
        cache = kv.k_cache(0)
        self.groups = plan_step(metadata, cache.shape[1], attention_dtype(cache.dtype))

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.metadata.check_num_tokens(q.shape[0])
        k_cache, v_cache = self.kv.k_cache(layer), self.kv.v_cache(layer)
        paged_store_reference(k_cache, v_cache, k, v, self.metadata.slot_mapping, self.format)
        return attend_groups(q, k_cache, v_cache, self.groups, self.scale, self.format)
