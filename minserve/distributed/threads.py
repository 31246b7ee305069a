"""N tensor-parallel ranks as threads of one process: the `Communicator` for demos and tests.

Each rank runs in its own thread and meets the others at a barrier for every collective;
no sockets, no process start-up, so a notebook cell or a unit test can shard a layer
over 4 ranks in milliseconds. Real deployments use `ProcessGroupComm` (one process per
rank); the layers cannot tell the difference.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class ThreadWorld:
    """The meeting point of `world_size` threads: a barrier and one slot per rank."""

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor, in rank order (each rank passes its own)."""
        self.slots[rank] = x
        self.barrier.wait()  # all slots written
        parts = [s.clone() for s in self.slots]  # type: ignore[union-attr]
        self.barrier.wait()  # all slots read before anyone writes the next round
        return parts


class ThreadComm:
    """`Communicator` for one thread-rank of a `ThreadWorld`."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.world.exchange(self.rank, x)
        total = parts[0]
        for part in parts[1:]:  # the same order on every rank: identical sums
            total = total + part
        return x.copy_(total)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.world.exchange(self.rank, x), dim=-1)

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        gathered = self.all_gather(x)
        return gathered if self.rank == 0 else None


def run_on_threads(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0
) -> list[Any]:
    """Run `fn(comm, *args)` on `world_size` thread-ranks; their results in rank order.

    An exception on any rank is raised here (the others are released by the barrier's
    timeout or by the broken barrier).
    """
    world = ThreadWorld(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(ThreadComm(world, rank), *args)
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return results
