"""Every tensor-parallel rank sizes its own KV pool, together; the smallest pool wins.

On a GPU with no pool size given, a pool takes what `gpu_memory_utilization` leaves after
the weights and the largest step's activations, measured by running that step
(`minserve/worker/memory.py`). Under tensor parallelism each rank holds its own shard on
its own GPU, so each rank measures its own; and the shard's layers all-reduce, so the
ranks run the profile forward together (rank 0 alone would wait forever for the others).
Every rank then holds the same block ids, so the pool is the smallest any rank affords:

    rank 0                              ranks 1..N-1
    broadcast the PoolRequest   ----->  receive it
    measure (a forward: all-reduces) <-> measure (the same forward)
    all_reduce MIN of block counts  <-> all_reduce MIN

A given size (`num_blocks`, or a byte budget) is rank 0's count, the same on every rank.
Both collectives run on the control group (gloo, CPU tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from minserve.config import CacheConfig, SchedulerConfig
from minserve.kvcache.paged_pool import PagedKVPool

# (shard, utilization, tokens of the largest step, logits rows) -> this rank's pool bytes
MeasureBudget = Callable[[torch.nn.Module, float, int, int], int]
MEASURE_FAILED = -1  # a rank's count when its measurement raised


class PoolSizeError(RuntimeError):
    """A rank could not size its KV pool; every rank raises it, none waits forever."""


@dataclass(frozen=True)
class PoolRequest:
    """How rank 0 asks every rank to size its pool: a block count, or a measurement."""

    num_blocks: int | None  # None: each rank measures its own shard
    block_size: int
    utilization: float
    num_tokens: int  # the largest step's tokens (max_num_batched_tokens)
    num_logits: int  # the rows it samples (max_num_seqs)

    @classmethod
    def for_engine(
        cls, cache: CacheConfig, model: torch.nn.Module, scheduler: SchedulerConfig, measure: bool
    ) -> PoolRequest:
        """Rank 0's request: measure, or the count its cache config gives."""
        dtype = next(model.parameters()).dtype
        given = None if measure else PagedKVPool.num_blocks_for(cache, model.config, dtype)
        return cls(given, cache.block_size, cache.gpu_memory_utilization,
                   scheduler.max_num_batched_tokens, scheduler.max_num_seqs)  # fmt: skip

    def encode(self) -> torch.Tensor:
        """[5] float64: what crosses the broadcast (-1: no count given)."""
        count = -1 if self.num_blocks is None else self.num_blocks
        return torch.tensor([count, self.block_size, self.utilization, self.num_tokens,
                             self.num_logits], dtype=torch.float64)  # fmt: skip

    @classmethod
    def decode(cls, message: torch.Tensor) -> PoolRequest:
        count, block_size, utilization, tokens, logits = message.tolist()
        return cls(None if count < 0 else int(count), int(block_size), utilization,
                   int(tokens), int(logits))  # fmt: skip


@runtime_checkable
class PoolPeers(Protocol):
    """Rank 0's view of the other ranks when sizing the pool (`BroadcastPeers`)."""

    def agree_pool_blocks(self, request: PoolRequest, model: torch.nn.Module) -> int: ...


def rank_pool_blocks(request: PoolRequest, model: torch.nn.Module, measure: MeasureBudget) -> int:
    """This rank's block count: the one given, or what its measured budget holds."""
    if request.num_blocks is not None:
        return request.num_blocks
    budget = measure(model, request.utilization, request.num_tokens, request.num_logits)
    dtype = next(model.parameters()).dtype
    return budget // PagedKVPool.bytes_per_block(model.config, request.block_size, dtype)


def agree_pool_blocks(
    control: dist.ProcessGroup,
    request: PoolRequest | None,
    model: torch.nn.Module,
    measure: MeasureBudget,
) -> int:
    """Rank 0 passes its request, the others None; every rank returns the smallest count."""
    message = torch.zeros(5, dtype=torch.float64) if request is None else request.encode()
    dist.broadcast(message, src=0, group=control)
    request = PoolRequest.decode(message)
    failure: Exception | None = None
    try:
        count = rank_pool_blocks(request, model, measure)
    except Exception as error:  # still join the MIN, so no rank waits for this one
        count, failure = MEASURE_FAILED, error
    counts = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=control)
    if failure is not None:
        raise failure
    if counts.item() == MEASURE_FAILED:
        raise PoolSizeError("another tensor-parallel rank could not size its KV pool (its "
                            "error is in its own report)")  # fmt: skip
    return int(counts.item())
