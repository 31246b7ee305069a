"""Chapter 07's live experiments, run on every rank by `run_on_ranks` (or `run_on_threads`).

Every rank builds the same dense weights from a seed, keeps its shard, and reports what it
computed, so the notebook can compare with the dense layer and see where time goes.
"""

from __future__ import annotations

import importlib
import time

import torch
import torch.nn.functional as F

from minserve.distributed.comm import Communicator
from minserve.distributed.layers import load_shard


def dense_mlp(hidden: int, inner: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same two weights on every rank: up [inner, hidden] and down [hidden, inner]."""
    g = torch.Generator().manual_seed(seed)
    scale = hidden**-0.5
    up = torch.randn(inner, hidden, generator=g) * scale
    down = torch.randn(hidden, inner, generator=g) * scale
    return up, down


def megatron_mlp(
    comm: Communicator,
    num_tokens: int = 4,
    hidden: int = 576,
    inner: int = 1536,
    seed: int = 0,
    module: str = "minserve.distributed.layers",
) -> dict[str, object]:
    """down(silu(up(x))) split over the ranks: column, then row, one all-reduce.

    `module` names the layers to use ("exercises.ch07_parallel_linear": yours). Returns
    this rank's shard shapes, its partial sum, the all-reduced output, and the dense one.
    """
    layers = importlib.import_module(module)
    up, down = dense_mlp(hidden, inner, seed)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed + 1))
    column = layers.ColumnParallelLinear(hidden, inner, comm, bias=False)
    row = layers.RowParallelLinear(inner, hidden, comm, bias=False)
    load_shard(column, up, None)
    load_shard(row, down, None)
    middle = F.silu(column(x))  # [T, inner / N]: this rank's slice, no communication
    partial = F.linear(middle, row.weight)  # [T, hidden]: this rank's share of the sum
    return {
        "rank": comm.rank,
        "up_shard": tuple(column.weight.shape),
        "down_shard": tuple(row.weight.shape),
        "partial": partial,
        "output": row(middle),  # the partials, all-reduced
        "dense": F.linear(F.silu(F.linear(x, up)), down),
    }


def time_mlp_vs_all_reduce(
    comm: Communicator,
    token_counts: tuple[int, ...] = (1, 16, 64, 256),
    hidden: int = 576,
    inner: int = 1536,
    repeats: int = 20,
) -> dict[int, dict[str, float]]:
    """Per token count: seconds of this rank's MLP shard vs one all-reduce of its output.

    The best of `repeats` is kept for each (noise only ever slows a run down).
    """
    up, down = dense_mlp(hidden, inner, seed=0)
    column = ColumnShard(up, comm)
    row_weight = down[:, column.rows.start : column.rows.stop]  # [hidden, inner / N]
    timings = {}
    for t in token_counts:
        x = torch.randn(t, hidden)
        compute = _best(lambda: F.linear(F.silu(column(x)), row_weight), repeats)
        y = torch.randn(t, hidden)
        comm.all_reduce(y)  # warm up the connection for this size
        reduce = _best(lambda: comm.all_reduce(y), repeats)
        timings[t] = {"mlp_seconds": compute, "all_reduce_seconds": reduce}
    return timings


class ColumnShard:
    """The rows of a dense weight this rank owns, as a callable x -> x W[rows]^T."""

    def __init__(self, weight: torch.Tensor, comm: Communicator) -> None:
        part = weight.shape[0] // comm.world_size
        self.rows = range(comm.rank * part, (comm.rank + 1) * part)
        self.weight = weight[self.rows.start : self.rows.stop]  # [out / N, in]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _best(fn: object, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best
