# Your workspace for chapter 07 (Tensor parallelism): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 07` from the repository root.
# Generated from minserve/distributed/layers.py, minserve/distributed/shard_model.py by `python -m minserve.course.generate`.
# stub fingerprint: c22588ba79b1 (lets the generator tell your edits from a stale stub)
"""Chapter 07, Tensor parallelism: column- and row-parallel linear layers, and
where the attention block's all-reduce goes.

Megatron-LM splits a linear layer over N ranks by its output features (column-
parallel: no communication) or by its input features (row-parallel: one
all-reduce). `comm` is the rank's `Communicator` (all_reduce, all_gather).
Plug this module into the engine with `LLM(tensor_parallel_size=3,
tensor_parallel_layers="exercises.ch07_parallel_linear")`.
"""

from typing import Any

import torch
import torch.nn.functional as F  # noqa: F401  (your code will want it)
from torch import nn

from minserve.distributed.comm import Communicator
from minserve.distributed.layers import even_split, meta_parameter
from minserve.distributed.layout import TPLayout
from minserve.model.llama import SelfAttention


# Exercise 7.1: column-parallel linear
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
        raise NotImplementedError("Exercise 7.1: column-parallel linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out_local], or [T, out] with gather_output."""
        raise NotImplementedError("Exercise 7.1: column-parallel linear")


# Exercise 7.2: row-parallel linear
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
        raise NotImplementedError("Exercise 7.2: row-parallel linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_local] (or [T, in] without input_is_parallel) -> the full y [T, out]."""
        raise NotImplementedError("Exercise 7.2: row-parallel linear")


# Exercise 7.3: the all-reduce of the attention block
def parallelize_attention(
    attn: SelfAttention, layout: TPLayout, comm: Communicator, dtype: torch.dtype, linear: Any
) -> None:
    """Query heads and their KV heads stay on this rank; o_proj sums the heads' outputs.

    Replace `attn`'s q_proj, k_proj, v_proj and o_proj (built on the meta device) with
    `linear.ColumnParallelLinear` / `linear.RowParallelLinear` so that one forward of the
    block makes exactly one all-reduce and no all-gather: the rank attends its own heads
    (q rows `layout.q_features()`, k and v rows `layout.kv_features()`) with no
    communication, and o_proj, whose input features are those heads' outputs, turns the
    rank's partial sum into the block's output. Sizes and biases come from
    `layout.config` (q_size, kv_size, hidden_size, qkv_bias, o_bias); pass `dtype` on.
    """
    raise NotImplementedError("Exercise 7.3: the all-reduce of the attention block")
