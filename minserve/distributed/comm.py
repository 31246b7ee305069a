"""What tensor-parallel layers need from the other ranks: three collectives, nothing else.

`Communicator` is that interface. `ProcessGroupComm` implements it on torch.distributed
(gloo on CPUs, NCCL on GPUs: real processes, one per rank); `minserve.distributed.threads`
implements it with threads in one process, so a notebook or a test can run N ranks cheaply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist


class Communicator(Protocol):
    """One rank's view of its tensor-parallel group."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; every rank gets the sum (and it is returned)."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., n * world_size] on every rank, in rank order."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Like `all_gather`, but only rank 0 receives the result (None elsewhere)."""
        ...


@dataclass
class CommStats:
    """Seconds spent in collectives and how many ran (waiting for slower ranks included)."""

    all_reduce_seconds: float = 0.0
    num_all_reduces: int = 0
    gather_seconds: float = 0.0


class ProcessGroupComm:
    """`Communicator` over a torch.distributed process group (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.stats = CommStats()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.stats.all_reduce_seconds += time.perf_counter() - start
        self.stats.num_all_reduces += 1
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, group=self.group, group_dst=0)
        self.stats.gather_seconds += time.perf_counter() - start
        return None if parts is None else torch.cat(parts, dim=-1)
