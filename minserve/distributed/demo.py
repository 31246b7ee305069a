"""Chapter 07's live experiments, run on every rank by `run_on_ranks` (or `run_on_threads`).

Every rank builds the same dense weights from a seed, keeps its shard, and reports what it
computed, so the notebook can compare with the dense layer and see where time goes.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

from minserve.distributed.comm import Communicator
from minserve.distributed.layers import even_split, load_shard


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
    rows = even_split(inner, comm.rank, comm.world_size)
    up_shard = up[rows.start : rows.stop]  # [inner / N, hidden]: column-parallel
    down_shard = down[:, rows.start : rows.stop]  # [hidden, inner / N]: row-parallel
    timings = {}
    for t in token_counts:
        x, y = torch.randn(t, hidden), torch.randn(t, hidden)
        mlp = partial(_mlp_shard, x, up_shard, down_shard)
        comm.all_reduce(y)  # warm up the connection for this size
        timings[t] = {
            "mlp_seconds": _best(mlp, repeats),
            "all_reduce_seconds": _best(partial(comm.all_reduce, y), repeats),
        }
    return timings


def _mlp_shard(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, up)), down)  # [T, hidden], before the all-reduce


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def plot_mlp_vs_all_reduce(timings: dict[int, dict[str, float]]) -> Figure:
    """Bars per token count: one rank's MLP shard against the all-reduce that follows it."""
    counts = sorted(timings)
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.subplots()
    x = range(len(counts))
    ax.bar([i - 0.2 for i in x], [timings[t]["mlp_seconds"] * 1e3 for t in counts], 0.4,
           label="MLP shard (compute)")  # fmt: skip
    ax.bar([i + 0.2 for i in x], [timings[t]["all_reduce_seconds"] * 1e3 for t in counts], 0.4,
           label="all-reduce of its output")  # fmt: skip
    ax.set_xticks(list(x), [str(t) for t in counts])
    ax.set_xlabel("tokens in the step")
    ax.set_ylabel("milliseconds (log)")
    ax.set_yscale("log")
    ax.set_title("One rank of 2: SmolLM2-sized MLP (576 -> 1536 -> 576) vs its all-reduce")
    ax.legend()
    return fig
