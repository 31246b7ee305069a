"""The simplest KV cache: one contiguous K/V buffer per sequence, sized for its whole life.

This is the reference path (the oracle and the baseline the paged engine must beat). It
wastes memory the way pre-PagedAttention servers did: every sequence reserves room for
prompt + max_tokens up front, whether it uses it or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minserve.model_config import ModelConfig


class SequenceKV:
    """K and V of one sequence for every layer, preallocated to `capacity` tokens."""

    def __init__(
        self, config: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (config.num_layers, capacity, config.num_kv_heads, config.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, capacity, Hkv, D]
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.capacity = capacity


@dataclass(frozen=True)
class ContiguousSlice:
    """Where one sequence's query tokens sit in the flat batch and in its own cache."""

    kv: SequenceKV
    start: int  # position of the first query token (= tokens already cached)
    num_tokens: int  # query tokens of this sequence in this step


class ContiguousAttention:
    """`AttentionFn` over per-sequence contiguous caches: write the new k/v, then attend.

    Sequences are handled one after another: simple, exact, and slow for big batches.
    """

    def __init__(self, slices: list[ContiguousSlice]) -> None:
        self.slices = slices

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        out = torch.empty_like(q)  # [T, Hq, D]
        offset = 0
        for s in self.slices:
            rows = slice(offset, offset + s.num_tokens)
            end = s.start + s.num_tokens
            s.kv.k[layer, s.start : end] = k[rows]
            s.kv.v[layer, s.start : end] = v[rows]
            out[rows] = attend(q[rows], s.kv.k[layer, :end], s.kv.v[layer, :end], s.start)
            offset += s.num_tokens
        return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal GQA attention of q [n, Hq, D] over k, v [start + n, Hkv, D].

    The queries sit at positions start..start+n-1; query i may see keys 0..start+i.
    """
    n, ctx = q.shape[0], k.shape[0]
    mask = None
    if n > 1:  # query i may see keys 0..start+i
        key_pos = torch.arange(ctx, device=q.device)
        query_pos = torch.arange(start, start + n, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [n, ctx]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # [Hq, n, D]
        k.transpose(0, 1),  # [Hkv, ctx, D]
        v.transpose(0, 1),
        attn_mask=mask,
        enable_gqa=True,
    )
    return out.transpose(0, 1)  # [n, Hq, D]
