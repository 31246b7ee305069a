"""Checks for chapter 07 (tensor parallelism), run against any module that defines
`ColumnParallelLinear` and `RowParallelLinear`: minserve's own, the solutions, or a
student's exercise file.

The ranks run as threads of this process (`minserve.distributed.threads`), so a check
takes milliseconds. Weights are small integers, so every expected value can be worked out
on paper: W = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]] maps 3 inputs to 4 outputs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from minserve.distributed.threads import run_on_threads

W = torch.arange(1.0, 13.0).view(4, 3)  # [out 4, in 3]
B = torch.tensor([100.0, 200.0, 300.0, 400.0])  # [out 4]
X = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])  # [T 2, in 3]
W_ROW = torch.arange(1.0, 9.0).view(2, 4)  # [out 2, in 4]: split by its 4 input columns
B_ROW = torch.tensor([1000.0, 2000.0])
X_ROW = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])  # [T 2, in 4]


def _load(layer: Any, weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """Give `layer` its shard, the way minserve's loader does (through `layer.shard`)."""
    for name, value in layer.shard(weight, bias).items():
        setattr(layer, name, torch.nn.Parameter(value.clone(), requires_grad=False))
    return layer


def _column(comm: Any, impl: ModuleType, gather: bool, bias: bool = True) -> Any:
    layer = impl.ColumnParallelLinear(3, 4, comm, bias=bias, gather_output=gather)
    return _load(layer, W, B if bias else None)


def _row(comm: Any, impl: ModuleType, input_is_parallel: bool) -> Any:
    layer = impl.RowParallelLinear(4, 2, comm, bias=True, input_is_parallel=input_is_parallel)
    return _load(layer, W_ROW, B_ROW)


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and torch.allclose(got, want), (
        f"{what}: expected {want.tolist()}, got {got.tolist()}"
    )


def check_column_shard_keeps_this_ranks_output_rows(impl: ModuleType) -> None:
    """Column-parallel over 2 ranks: rank 0 keeps rows 0-1 of W and b, rank 1 rows 2-3."""

    def shard(comm: Any) -> dict:
        layer = impl.ColumnParallelLinear(3, 4, comm, bias=True)
        return layer.shard(W, B)

    for rank, got in enumerate(run_on_threads(shard, 2)):
        rows = slice(2 * rank, 2 * rank + 2)
        _same(got["weight"], W[rows], f"rank {rank}'s shard of W [4, 3]")
        _same(got["bias"], B[rows], f"rank {rank}'s shard of b [4]")


def check_column_forward_gives_each_rank_its_output_slice(impl: ModuleType) -> None:
    """Without gather_output, rank r returns columns 2r, 2r+1 of x W^T + b (no communication)."""
    full = X @ W.T + B  # [[101, 204, 307, 410], [205, 411, 617, 823]]
    outs = run_on_threads(lambda comm: _column(comm, impl, gather=False)(X), 2)
    for rank, got in enumerate(outs):
        _same(got, full[:, 2 * rank : 2 * rank + 2], f"rank {rank}'s output slice")


def check_column_gather_output_gives_every_rank_the_whole_output(impl: ModuleType) -> None:
    """With gather_output, every rank returns the whole x W^T + b, [2, 4]."""
    outs = run_on_threads(lambda comm: _column(comm, impl, gather=True)(X), 2)
    for rank, got in enumerate(outs):
        _same(got, X @ W.T + B, f"rank {rank}'s gathered output")


def check_row_shard_keeps_this_ranks_input_columns_and_the_whole_bias(impl: ModuleType) -> None:
    """Row-parallel over 2 ranks: rank r keeps columns 2r, 2r+1 of W; both keep all of b."""

    def shard(comm: Any) -> dict:
        return impl.RowParallelLinear(4, 2, comm, bias=True).shard(W_ROW, B_ROW)

    for rank, got in enumerate(run_on_threads(shard, 2)):
        _same(got["weight"], W_ROW[:, 2 * rank : 2 * rank + 2], f"rank {rank}'s shard of W")
        _same(got["bias"], B_ROW, f"rank {rank}'s bias (replicated)")


def check_row_forward_sums_partials_and_adds_the_bias_once(impl: ModuleType) -> None:
    """Each rank multiplies its input slice; one all-reduce sums them; b is added once."""
    want = X_ROW @ W_ROW.T + B_ROW  # [[1010, 2026], [1001, 2005]]

    def run(comm: Any) -> torch.Tensor:
        return _row(comm, impl, input_is_parallel=True)(X_ROW[:, 2 * comm.rank : 2 * comm.rank + 2])

    for rank, got in enumerate(run_on_threads(run, 2)):
        _same(got, want, f"rank {rank}'s output (bias {B_ROW.tolist()} counted once?)")


def check_row_forward_slices_a_whole_input_itself(impl: ModuleType) -> None:
    """With input_is_parallel=False, x is whole [2, 4]: each rank takes its columns first."""
    outs = run_on_threads(lambda comm: _row(comm, impl, input_is_parallel=False)(X_ROW), 2)
    for rank, got in enumerate(outs):
        _same(got, X_ROW @ W_ROW.T + B_ROW, f"rank {rank}'s output from the whole input")


def check_column_then_row_is_the_dense_two_layer_network(impl: ModuleType) -> None:
    """Megatron's MLP over 2 ranks: column (3 -> 4), relu, row (4 -> 2) equals the dense one."""
    want = torch.relu(X @ W.T + B) @ W_ROW.T + B_ROW

    def run(comm: Any) -> torch.Tensor:
        column = _column(comm, impl, gather=False)
        return _row(comm, impl, input_is_parallel=True)(torch.relu(column(X)))

    for rank, got in enumerate(run_on_threads(run, 2)):
        _same(got, want, f"rank {rank}'s output of the two-layer network")


def check_one_rank_is_the_dense_layer(impl: ModuleType) -> None:
    """With a single rank, both layers hold all of W and compute x W^T + b."""
    column = run_on_threads(lambda comm: _column(comm, impl, gather=False)(X), 1)[0]
    _same(column, X @ W.T + B, "column-parallel on 1 rank")
    row = run_on_threads(lambda comm: _row(comm, impl, input_is_parallel=True)(X_ROW), 1)[0]
    _same(row, X_ROW @ W_ROW.T + B_ROW, "row-parallel on 1 rank")


CHECKS = [
    check_column_shard_keeps_this_ranks_output_rows,
    check_column_forward_gives_each_rank_its_output_slice,
    check_column_gather_output_gives_every_rank_the_whole_output,
    check_row_shard_keeps_this_ranks_input_columns_and_the_whole_bias,
    check_row_forward_sums_partials_and_adds_the_bias_once,
    check_row_forward_slices_a_whole_input_itself,
    check_column_then_row_is_the_dense_two_layer_network,
    check_one_rank_is_the_dense_layer,
]
