"""The simplest KV cache: one contiguous K/V buffer per sequence, sized for its whole life.

This is the reference path (the oracle and the baseline the paged engine must beat). It
wastes memory the way pre-PagedAttention servers did: every sequence reserves room for
prompt + max_tokens up front, whether it uses it or not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minserve.model_config import ModelConfig

# causal attention of q [n, Hq, D] over k, v [start + n, Hkv, D], given start -> [n, Hq, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


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
    `attend_fn` is the attention itself (chapter 00's exercise 0.4 plugs in here).
    """

    def __init__(
        self,
        slices: list[ContiguousSlice],
        attend_fn: Attend | None = None,
    ) -> None:
        self.slices = slices
        self.attend = attend_fn or attend

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
            out[rows] = self.attend(q[rows], s.kv.k[layer, :end], s.kv.v[layer, :end], s.start)
            offset += s.num_tokens
        return out


# >>> exercise 0.4: grouped-query causal attention
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal GQA attention of q [n, Hq, D] over k, v [start + n, Hkv, D] -> [n, Hq, D].

    The queries sit at positions start..start+n-1; query i may see keys 0..start+i.
    Hq is a multiple of Hkv: query heads h*g .. h*g+g-1 (g = Hq // Hkv) share KV head h.
    Scores are q . k / sqrt(D), softmaxed over the keys each query may see, in float32;
    the output is the softmax-weighted sum of v rows, in q's dtype.
    """
    # >>> solution
    n, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [ctx, Hq, D]: each KV head serves its group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / math.sqrt(head_dim)
    key_pos = torch.arange(k.shape[0], device=q.device)
    query_pos = torch.arange(start, start + n, device=q.device)
    future = key_pos[None, :] > query_pos[:, None]  # [n, ctx]: keys a query may not see
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)  # [Hq, n, ctx]
    return torch.einsum("hqk,khd->qhd", weights, v.float()).to(q.dtype)  # [n, Hq, D]
    # <<< solution


# <<< exercise
