"""Megatron-LM's parallel linear layers: split a weight by output columns or by input rows.

A linear layer y = x W^T + b with W [out, in] can be cut two ways over N ranks:

- Column-parallel: each rank holds out/N output features (a block of W's rows). Every rank
  sees the whole input and computes its slice of y. No communication, unless the full y
  is wanted (`gather_output`).
- Row-parallel: each rank holds in/N input features (a block of W's columns) and gets the
  matching slice of x. Each rank's product is a *partial sum* of y; one all-reduce adds
  them up. The bias is added once, after the sum.

A column-parallel layer followed by a row-parallel one needs no communication in between
(the slice one produces is the slice the other consumes): Megatron's MLP and attention
block, one all-reduce each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minserve.distributed.comm import Communicator


def even_split(size: int, rank: int, world_size: int) -> range:
    """The `rank`-th of `world_size` equal, contiguous parts of range(size)."""
    if size % world_size:
        raise ValueError(f"cannot split {size} features evenly over {world_size} ranks")
    part = size // world_size
    return range(rank * part, (rank + 1) * part)


def meta_parameter(shape: tuple[int, ...], dtype: torch.dtype | None) -> nn.Parameter:
    """An uninitialised parameter on the meta device: `load` gives it real values."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)


# >>> exercise 7.1: column-parallel linear
class ColumnParallelLinear(nn.Module):
    """y[:, rows] = x W[rows]^T + b[rows]: this rank's block of output features.

    `rows` are the output features this rank owns (default: its even share). With
    `gather_output`, the slices of every rank are concatenated so each rank returns the
    whole y; without it (the usual case), the slice goes on to a row-parallel layer.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        bias: bool = True,
        gather_output: bool = False,
        rows: range | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.gather_output = gather_output
        self.rows = (
            rows if rows is not None else even_split(out_features, comm.rank, comm.world_size)
        )
        self.weight = meta_parameter((len(self.rows), in_features), dtype)  # [out_local, in]
        self.bias = meta_parameter((len(self.rows),), dtype) if bias else None  # [out_local]

    def shard(self, weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The full weight [out, in] (and bias [out]) -> this rank's {"weight", "bias"}."""
        # >>> solution
        shard = {"weight": weight[self.rows.start : self.rows.stop]}  # [out_local, in]
        if bias is not None:
            shard["bias"] = bias[self.rows.start : self.rows.stop]  # [out_local]
        return shard
        # <<< solution

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out_local], or [T, out] with gather_output."""
        # >>> solution
        y = F.linear(x, self.weight, self.bias)  # [T, out_local]
        return self.comm.all_gather(y) if self.gather_output else y
        # <<< solution


# <<< exercise


# >>> exercise 7.2: row-parallel linear
class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[:, cols] W[:, cols]^T, then + b: one all-reduce.

    `cols` are the input features this rank owns (default: its even share). With
    `input_is_parallel` (the usual case) x is already this rank's slice [T, in_local],
    as a column-parallel layer produced it; otherwise x is whole and is sliced here.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        bias: bool = True,
        input_is_parallel: bool = True,
        cols: range | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.input_is_parallel = input_is_parallel
        self.cols = (
            cols if cols is not None else even_split(in_features, comm.rank, comm.world_size)
        )
        self.weight = meta_parameter((out_features, len(self.cols)), dtype)  # [out, in_local]
        self.bias = meta_parameter((out_features,), dtype) if bias else None  # [out], replicated

    def shard(self, weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The full weight [out, in] (and bias [out]) -> this rank's {"weight", "bias"}."""
        # >>> solution
        shard = {"weight": weight[:, self.cols.start : self.cols.stop]}  # [out, in_local]
        if bias is not None:
            shard["bias"] = bias  # every rank keeps it; it is added once, after the sum
        return shard
        # <<< solution

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_local] (or [T, in] without input_is_parallel) -> the full y [T, out]."""
        # >>> solution
        if not self.input_is_parallel:
            x = x[..., self.cols.start : self.cols.stop]  # [T, in_local]
        partial = F.linear(x, self.weight)  # [T, out]: this rank's share of the sum
        y = self.comm.all_reduce(partial)
        return y if self.bias is None else y + self.bias
        # <<< solution


# <<< exercise


def load_shard(module: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Give a parallel layer its slice of the full tensors (copies: the full ones can go)."""
    for name, value in module.shard(weight, bias).items():
        target = getattr(module, name)
        setattr(module, name, nn.Parameter(value.to(target.dtype).clone(), requires_grad=False))
