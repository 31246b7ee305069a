"""Paged KV pool, contiguous attention: each sequence's keys and values gathered in order.

The step's new k/v are stored in the pool at their slots like any paged backend; then,
sequence by sequence, the slots of positions 0..context-1 (found through the block table:
block * block_size + offset) are read out into contiguous K and V, and an `Attend`
function of `contiguous.py`'s shape does the attention. Slow (one call per sequence per
layer), and exact: it lets a plain attention function, such as chapter 00's exercise,
run inside the paged engine.
"""

from __future__ import annotations

import torch

from minserve.attention.contiguous import Attend
from minserve.attention.metadata import AttentionMetadata, PagedKVCache, cache_format
from minserve.attention.paged_torch import flat_slots, paged_store_reference


def context_slots(metadata: AttentionMetadata, block_size: int) -> list[torch.Tensor]:
    """Per sequence, the pool slots of its tokens 0..context_len-1, in order: [context_len]."""
    slots = []
    for table, context_len in zip(metadata.block_tables, metadata.context_lens_list()):
        positions = torch.arange(context_len, device=table.device)
        blocks = table.long()[positions // block_size]  # [context_len]
        slots.append(blocks * block_size + positions % block_size)
    return slots


class PerSequenceAttention:
    """`AttentionFn` over a paged pool that calls a contiguous `attend` once per sequence."""

    def __init__(self, kv: PagedKVCache, metadata: AttentionMetadata, attend: Attend) -> None:
        self.kv = kv
        self.metadata = metadata
        self.attend = attend
        self.format = cache_format(kv)  # the pool's own: a kv_codec's arithmetic included
        self.slots = context_slots(metadata, kv.k_cache(0).shape[1])
        self.starts = metadata.query_starts_list()  # [num_seqs + 1]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.metadata.check_num_tokens(q.shape[0])
        k_cache, v_cache = self.kv.k_cache(layer), self.kv.v_cache(layer)
        paged_store_reference(k_cache, v_cache, k, v, self.metadata.slot_mapping, self.format)
        fmt = self.format
        out = torch.empty_like(q)  # [T, Hq, D]
        for i, slots in enumerate(self.slots):
            rows = slice(self.starts[i], self.starts[i + 1])
            start = slots.shape[0] - (rows.stop - rows.start)  # tokens cached before this step
            keys, values = flat_slots(k_cache)[slots], flat_slots(v_cache)[slots]  # [ctx, Hkv, row]
            if fmt.quantized:  # an 8-bit cache, widened to the queries' dtype: [ctx, Hkv, D]
                keys, values = fmt.decode(keys).to(q.dtype), fmt.decode(values).to(q.dtype)
            out[rows] = self.attend(q[rows], keys, values, start)
        return out
