# Generated from minserve/distributed/layers.py, minserve/distributed/shard_model.py, minserve/distributed/vocab.py, minserve/distributed/layout.py by `python -m minserve.course.generate`;
# edit the marked regions there, not here.
"""Chapter 07, Tensor parallelism: column- and row-parallel linear layers,
where the attention block's all-reduce goes, the vocabulary split, and which
heads and features each rank holds.

Megatron-LM splits a linear layer over N ranks by its output features (column-
parallel: no communication) or by its input features (row-parallel: one
all-reduce). `comm` is the rank's `Communicator` (all_reduce, all_gather,
gather). Plug this module into the engine with `LLM(tensor_parallel_size=3,
plugins=CoursePlugins(tensor_parallel_layers="exercises.ch07_parallel_linear"))`:
every rank builds
its shard with your layers, your vocabulary blocks and your `TPLayout`.
"""

from __future__ import annotations  # 7.3 names TPLayout, which 7.5 defines

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F  # noqa: F401  (your code will want it)
from torch import nn

from minserve.distributed.comm import Communicator
from minserve.distributed.layers import even_split, meta_parameter
from minserve.distributed.layout import TensorParallelError
from minserve.model.llama import SelfAttention
from minserve.model_config import ModelConfig


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
        shard = {"weight": weight[self.rows.start : self.rows.stop]}  # [out_local, in]
        if bias is not None:
            shard["bias"] = bias[self.rows.start : self.rows.stop]  # [out_local]
        return shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out_local], or [T, out] with gather_output."""
        y = F.linear(x, self.weight, self.bias)  # [T, out_local]
        return self.comm.all_gather(y) if self.gather_output else y


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
        shard = {"weight": weight[:, self.cols.start : self.cols.stop]}  # [out, in_local]
        if bias is not None:
            shard["bias"] = bias  # every rank keeps it; it is added once, after the sum
        return shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_local] (or [T, in] without input_is_parallel) -> the full y [T, out]."""
        if not self.input_is_parallel:
            x = x[..., self.cols.start : self.cols.stop]  # [T, in_local]
        partial = F.linear(x, self.weight)  # [T, out]: this rank's share of the sum
        y = self.comm.all_reduce(partial)
        return y if self.bias is None else y + self.bias


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
    cfg = layout.config
    hidden, q_rows, kv_rows = cfg.hidden_size, layout.q_features(), layout.kv_features()
    for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
        full = cfg.q_size if name == "q_proj" else cfg.kv_size
        column = linear.ColumnParallelLinear(
            hidden, full, comm, cfg.qkv_bias, rows=rows, dtype=dtype
        )
        setattr(attn, name, column)
    attn.o_proj = linear.RowParallelLinear(
        cfg.q_size, hidden, comm, cfg.o_bias, cols=q_rows, dtype=dtype
    )


# Exercise 7.4: the vocabulary-parallel embedding and LM head
def vocab_block(vocab_size: int, rank: int, world_size: int) -> range:
    """Rank `rank`'s token ids: blocks of ceil(vocab / world_size), the last one shorter.

    Every rank but the last holds ceil(vocab / world_size) ids; the last holds what is left,
    which may be nothing at all (vocab 5 over 4 ranks: blocks of 2, rank 3 gets range(5, 5)).
    """
    per_rank = math.ceil(vocab_size / world_size)
    return range(min(rank * per_rank, vocab_size), min((rank + 1) * per_rank, vocab_size))


class VocabParallelEmbedding(nn.Module):
    """Token id -> hidden vector, with this rank holding only its block of the table."""

    def __init__(
        self, vocab_size: int, hidden_size: int, comm: Communicator, dtype: torch.dtype | None
    ) -> None:
        super().__init__()
        self.comm = comm
        self.vocab_size = vocab_size
        self.rows = vocab_block(vocab_size, comm.rank, comm.world_size)
        self.padded_rows = math.ceil(vocab_size / comm.world_size)
        self.weight = meta_parameter((self.padded_rows, hidden_size), dtype)  # [V_local, hidden]

    def shard(self, weight: torch.Tensor, bias: None = None) -> dict[str, torch.Tensor]:
        """The full table [V, hidden] -> this rank's block, zero-padded to [V_local, hidden].

        V_local is `self.padded_rows` on every rank: rows `self.rows` of the table, then
        zero rows up to that size (the last rank's block can be short, even empty).
        """
        block = weight[self.rows.start : self.rows.stop]
        padding = weight.new_zeros(self.padded_rows - len(self.rows), weight.shape[1])
        return {"weight": torch.cat([block, padding])}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden] (one all-reduce).

        Look up the ids in this rank's block (`self.rows`) in the local table; every other
        id gets a zero row, so that the all-reduce adds exactly one real row per token. Ids
        of other blocks must not index outside the local table.
        """
        local_ids = input_ids - self.rows.start
        mine = (local_ids >= 0) & (local_ids < len(self.rows))  # [T]
        x = F.embedding(local_ids.clamp(0, self.padded_rows - 1), self.weight)  # [T, hidden]
        x = x * mine[:, None].to(x.dtype)  # rows of other ranks' tokens become zeros
        return self.comm.all_reduce(x)


class ParallelLMHead(nn.Module):
    """hidden -> logits over this rank's vocabulary block; rank 0 gathers the whole row."""

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool) -> None:
        super().__init__()
        self.comm = embedding.comm
        self.vocab_size = embedding.vocab_size
        self.rows = embedding.rows
        self.padded_rows = embedding.padded_rows
        if tied:  # SmolLM2: the LM head is the embedding table, block for block
            self.weight = embedding.weight
        else:
            self.weight = meta_parameter(tuple(embedding.weight.shape), embedding.weight.dtype)

    shard = VocabParallelEmbedding.shard

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, V] on rank 0; [N, 0] elsewhere (they never sample).

        Score this rank's (padded) block, then `self.comm.gather(local)`: rank 0 receives
        every block side by side, [N, world_size * V_local], other ranks None. Rank 0 drops
        the padding columns, which sit past `self.vocab_size`.
        """
        local = F.linear(hidden, self.weight)  # [N, V_local]
        logits = self.comm.gather(local)  # rank 0: [N, world_size * V_local]
        return local[:, :0] if logits is None else logits[:, : self.vocab_size]


# Exercise 7.5: which heads and features a rank holds
@dataclass(frozen=True)
class TPLayout:
    """Rank `rank` of `world_size`: its query heads, KV heads and MLP features.

    Everything is a contiguous `range`, rank 0 first. Query heads and MLP features split
    evenly. KV heads split evenly too when there are at least as many as ranks; with fewer
    (grouped-query attention at high TP), rank r holds the one KV head its query heads
    read, so each KV head is replicated on world_size / num_kv_heads neighbouring ranks.
    """

    config: ModelConfig
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        check_divisible(self.config, self.world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside 0 .. {self.world_size - 1}")

    @property
    def kv_replicated(self) -> bool:
        """Fewer KV heads than ranks: each KV head lives on several ranks."""
        return self.config.num_kv_heads < self.world_size

    @property
    def q_heads(self) -> range:
        """This rank's query heads: its even share, num_heads / world_size of them."""
        per_rank = self.config.num_heads // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def kv_heads(self) -> range:
        """The KV heads this rank's query heads read (one, when KV heads are replicated)."""
        cfg = self.config
        if self.kv_replicated:
            head = self.rank // (self.world_size // cfg.num_kv_heads)
            return range(head, head + 1)
        per_rank = cfg.num_kv_heads // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def mlp_features(self) -> range:
        """This rank's MLP inner features: rows of gate/up, columns of down_proj."""
        per_rank = self.config.intermediate_size // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def q_features(self) -> range:
        """Rows of q_proj (columns of o_proj) for this rank's query heads."""
        return _features(self.q_heads, self.config.head_dim)

    def kv_features(self) -> range:
        """Rows of k_proj and v_proj for this rank's KV heads."""
        return _features(self.kv_heads, self.config.head_dim)

    def local_config(self) -> ModelConfig:
        """The decoder this rank runs: its heads and MLP width; hidden and vocab unchanged."""
        return replace(
            self.config,
            num_heads=len(self.q_heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=len(self.mlp_features),
        )


def _features(heads: range, head_dim: int) -> range:
    """The features (rows of a projection) of `heads`: head_dim consecutive ones each."""
    return range(heads.start * head_dim, heads.stop * head_dim)


def check_divisible(config: ModelConfig, world_size: int) -> None:
    """Raise `TensorParallelError` unless heads, KV heads and the MLP split over the ranks.

    world_size must be at least 1 and divide the query heads and the MLP's features; KV
    heads and world_size must divide one another (either one splits the other). Each
    message names tensor_parallel_size and the number it fails on.
    """
    if world_size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be at least 1, got {world_size}")
    heads, kv, inner = config.num_heads, config.num_kv_heads, config.intermediate_size
    if heads % world_size:
        raise TensorParallelError(
            f"tensor_parallel_size={world_size} must divide the model's {heads} query heads"
        )
    if kv % world_size and world_size % kv:
        raise TensorParallelError(
            f"tensor_parallel_size={world_size} and the model's {kv} KV heads must divide one "
            "another (KV heads are split over ranks, or replicated when there are fewer)"
        )
    if inner % world_size:
        raise TensorParallelError(
            f"tensor_parallel_size={world_size} must divide the MLP's {inner} features"
        )
