"""Checks for chapter 07 (tensor parallelism), run against any module that defines
`ColumnParallelLinear`, `RowParallelLinear`, `parallelize_attention`, `vocab_block`,
`VocabParallelEmbedding`, `ParallelLMHead`, `TPLayout` and `check_divisible`: minserve's own,
the solutions, or a student's exercise file.

The ranks run as threads of this process (`minserve.distributed.threads`), so a check
takes milliseconds. Weights are small integers, so every expected value can be worked out
on paper: W = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]] maps 3 inputs to 4 outputs.
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import ModuleType
from typing import Any

import torch
from hypothesis import Verbosity, given, settings
from hypothesis import strategies as st

from minserve.course.nonfinite import lead_with_nonfinite
from minserve.distributed import layers
from minserve.distributed.layers import load_shard
from minserve.distributed.layout import TensorParallelError, TPLayout, check_divisible
from minserve.distributed.threads import run_on_threads
from minserve.distributed.vocab import vocab_block
from minserve.model.llama import RotaryEmbedding, SelfAttention
from minserve.model.ops import MODEL_OPS
from minserve.model_config import ModelConfig

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
    assert got.shape == want.shape and torch.allclose(got, want), lead_with_nonfinite(
        got, f"{what}: expected {want.tolist()}, got {got.tolist()}"
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


# Exercise 7.3: the attention block over 2 (and 4) thread-ranks against the single-rank block.
ATTN = ModelConfig(
    architecture="llama", vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1,
    num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=64, tie_word_embeddings=True,
)  # fmt: skip
NUM_TOKENS = 5


class CountingComm:
    """A rank's communicator that counts the collectives the block makes."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self.all_reduces = self.all_gathers = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.all_reduces += 1
        return self.comm.all_reduce(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.all_gathers += 1
        return self.comm.all_gather(x)

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.comm.gather(x)


def causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Plain causal grouped-query attention: q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5  # [Hq, T, T]
    mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1)
    weights = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", weights, v)


def _dense_block(bias: bool) -> tuple[SelfAttention, torch.Tensor]:
    """A single-rank attention block with seeded random weights, and its input [T, hidden]."""
    torch.manual_seed(0)
    attn = SelfAttention(replace(ATTN, qkv_bias=bias, o_bias=bias)).eval()
    for param in attn.parameters():
        param.data.normal_(0, 0.5)
    return attn, torch.randn(NUM_TOKENS, ATTN.hidden_size)


def _run_block(attn: Any, x: torch.Tensor) -> torch.Tensor:
    rotation = RotaryEmbedding(attn.config)(torch.arange(x.shape[0]), x.dtype, MODEL_OPS)
    with torch.inference_mode():
        return attn(x, rotation, causal_attention, 0)  # [T, hidden]


def _rank_block(comm: Any, impl: ModuleType, dense: SelfAttention, x: torch.Tensor) -> dict:
    """This rank's block: the implementation places the layers, minserve loads the shards."""
    counting = CountingComm(comm)
    layout = TPLayout(dense.config, comm.rank, comm.world_size)
    with torch.device("meta"):
        attn = SelfAttention(layout.local_config())
    impl.parallelize_attention(attn, layout, counting, torch.float32, layers)
    kinds = {n: type(getattr(attn, n)).__name__ for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        full = getattr(dense, name)
        bias = None if full.bias is None else full.bias.data
        load_shard(getattr(attn, name), full.weight.data, bias)
    out = _run_block(attn, x)
    return {"out": out, "kinds": kinds, "counts": (counting.all_reduces, counting.all_gathers)}


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to float rounding (the all-reduce adds the heads in another order)."""
    shapes = tuple(want.shape), tuple(got.shape)
    assert shapes[0] == shapes[1], f"{what}: expected shape {shapes[0]}, got {shapes[1]}"
    err = float((got - want).abs().max())
    assert err < 1e-4, lead_with_nonfinite(
        got,
        f"{what}: expected the single-rank block's output, largest difference {err:.4g}; "
        f"token 0 expected {[round(v, 3) for v in want[0].tolist()]}, "
        f"got {[round(v, 3) for v in got[0].tolist()]}",
    )


def _tp_attention(impl: ModuleType, world_size: int, bias: bool = True) -> tuple[list, Any]:
    dense, x = _dense_block(bias)
    return run_on_threads(_rank_block, world_size, impl, dense, x), _run_block(dense, x)


def check_attention_projections_are_split_by_heads(impl: ModuleType) -> None:
    """q, k, v column-parallel (this rank's heads), o_proj row-parallel over the same heads."""
    ranks, _ = _tp_attention(impl, 2)
    want = {"q_proj": "ColumnParallelLinear", "k_proj": "ColumnParallelLinear",
            "v_proj": "ColumnParallelLinear", "o_proj": "RowParallelLinear"}  # fmt: skip
    got = ranks[0]["kinds"]
    assert got == want, f"rank 0's attention projections: expected {want}, got {got}"


def check_one_all_reduce_per_attention_block(impl: ModuleType) -> None:
    """One forward of the block over 2 ranks: exactly 1 all-reduce and 0 all-gathers per rank."""
    ranks, _ = _tp_attention(impl, 2)
    got = [r["counts"] for r in ranks]
    assert got == [(1, 0), (1, 0)], (
        "collectives per rank in one forward of the attention block, as (all-reduces, "
        f"all-gathers): expected [(1, 0), (1, 0)], got {got}"
    )


def check_tp2_attention_equals_the_single_rank_block(impl: ModuleType) -> None:
    """4 query heads, 2 KV heads over 2 ranks: every rank's output is the dense block's."""
    for bias in (True, False):
        ranks, dense = _tp_attention(impl, 2, bias)
        for rank, r in enumerate(ranks):
            _close(r["out"], dense, f"rank {rank}'s attention output at TP=2 (bias={bias})")


def check_tp4_replicated_kv_heads_equal_the_single_rank_block(impl: ModuleType) -> None:
    """4 ranks, 2 KV heads: each KV head lives on 2 ranks; outputs still equal the dense block's."""
    ranks, dense = _tp_attention(impl, 4)
    for rank, r in enumerate(ranks):
        _close(r["out"], dense, f"rank {rank}'s attention output at TP=4 (KV heads replicated)")


# Exercise 7.4: the vocabulary over thread-ranks against the whole table.
TABLE = torch.arange(10 * 3, dtype=torch.float32).view(10, 3) + 1  # [V 10, hidden 3]: row i
IDS = torch.tensor([0, 3, 4, 9, 7, 4])  # [T 6]: ids of every rank's block, one repeated


def check_vocab_blocks_match_minserves(impl: ModuleType) -> None:
    """vocab_block over vocab 1..24 and 1..6 ranks: ceil-sized blocks, the last short or empty."""
    assert list(impl.vocab_block(10, 2, 3)) == [8, 9], (
        f"vocab 10 over 3 ranks, rank 2: expected range(8, 10), got {impl.vocab_block(10, 2, 3)}"
    )
    for vocab in range(1, 25):
        for world in range(1, 7):
            want = [vocab_block(vocab, r, world) for r in range(world)]
            got = [impl.vocab_block(vocab, r, world) for r in range(world)]
            assert got == want, f"vocab {vocab} over {world} ranks: expected {want}, got {got}"


def _embedding(comm: Any, impl: ModuleType) -> Any:
    embed = impl.VocabParallelEmbedding(TABLE.shape[0], TABLE.shape[1], comm, torch.float32)
    return _load(embed, TABLE, None)


def check_embedding_shard_is_the_block_zero_padded(impl: ModuleType) -> None:
    """Vocab 10 over 3 ranks: blocks of 4 rows; rank 2 holds rows 8-9 and 2 zero rows."""
    for world in (3, 4):
        shards = run_on_threads(lambda comm: _embedding(comm, impl).weight.data, world)
        per_rank = -(-TABLE.shape[0] // world)
        for rank, got in enumerate(shards):
            rows = TABLE[rank * per_rank : (rank + 1) * per_rank]
            want = torch.cat([rows, torch.zeros(per_rank - len(rows), TABLE.shape[1])])
            _same(got, want, f"rank {rank} of {world}'s block of the table [10, 3]")


def check_embedding_lookup_is_the_whole_tables_rows_with_one_all_reduce(impl: ModuleType) -> None:
    """Every rank returns TABLE[ids] for ids of all blocks (vocab 10 over 2, 3 and 4 ranks)."""

    def lookup(comm: Any) -> tuple[torch.Tensor, int]:
        counting = CountingComm(comm)
        embed = _embedding(counting, impl)
        return embed(IDS), counting.all_reduces

    for world in (2, 3, 4):
        for rank, (got, reduces) in enumerate(run_on_threads(lookup, world)):
            _same(got, TABLE[IDS], f"rank {rank} of {world}: rows of ids {IDS.tolist()}")
            assert reduces == 1, f"rank {rank} of {world}: expected 1 all-reduce, got {reduces}"


def check_lm_head_gives_rank_0_the_whole_logits(impl: ModuleType) -> None:
    """Tied LM head over 3 ranks: rank 0 gets hidden @ TABLE^T [2, 10], the others [2, 0]."""
    hidden = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, -1.0]])  # [N 2, hidden 3]

    def score(comm: Any) -> torch.Tensor:
        embed = _embedding(comm, impl)
        return impl.ParallelLMHead(embed, tied=True)(hidden)

    for world in (1, 3, 4):
        for rank, got in enumerate(run_on_threads(score, world)):
            want = hidden @ TABLE.T if rank == 0 else torch.zeros(2, 0)
            _same(got, want, f"rank {rank} of {world}'s logits")


# Exercise 7.5: a rank's heads and features against minserve's layout.
def _config(heads: int, kv_heads: int, inner: int, head_dim: int = 2) -> ModelConfig:
    return replace(ATTN, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=inner,
                   head_dim=head_dim, hidden_size=heads * head_dim)  # fmt: skip


def _layout_of(layout: Any) -> dict[str, Any]:
    local = layout.local_config()
    return {
        "q_heads": layout.q_heads, "kv_heads": layout.kv_heads,
        "mlp_features": layout.mlp_features, "q_features": layout.q_features(),
        "kv_features": layout.kv_features(),
        "local (heads, kv heads, inner)": (
            local.num_heads, local.num_kv_heads, local.intermediate_size
        ),
        "local hidden, vocab": (local.hidden_size, local.vocab_size),
    }  # fmt: skip


def _compare_layouts(impl: ModuleType, heads: int, kv_heads: int, inner: int, world: int) -> None:
    config = _config(heads, kv_heads, inner)
    case = f"{heads} query heads, {kv_heads} KV heads, MLP {inner}, over {world} ranks"
    for rank in range(world):
        want = _layout_of(TPLayout(config, rank, world))
        got = _layout_of(impl.TPLayout(config, rank, world))
        for key in want:
            assert got[key] == want[key], (
                f"{case}, rank {rank}: {key} expected {want[key]}, got {got[key]}"
            )


def check_layout_splits_heads_and_features_as_minserves(impl: ModuleType) -> None:
    """Every rank's heads, features and local config equal minserve's (SmolLM2, random shapes)"""
    _compare_layouts(impl, 9, 3, 1536, 3)  # an untouched stub stops here
    _compare_layouts(impl, 4, 2, 8, 4)  # each KV head on 2 ranks

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              verbosity=Verbosity.quiet, report_multiple_bugs=False)  # fmt: skip
    @given(
        st.sampled_from([1, 2, 3, 4, 6, 8]),  # world size
        st.integers(1, 4),  # KV heads per rank, or ranks per KV head
        st.booleans(),  # fewer KV heads than ranks
        st.integers(1, 3),  # query heads per KV head
        st.integers(1, 5),  # MLP features per rank
    )
    def random_shape(world: int, k: int, replicated: bool, group: int, inner: int) -> None:
        kv_heads = max(1, world // k) if replicated and world % k == 0 else k * world
        heads = kv_heads * group * (world // math.gcd(world, kv_heads * group))
        _compare_layouts(impl, heads, kv_heads, inner * world, world)

    random_shape()


def check_each_ranks_query_heads_read_its_kv_heads(impl: ModuleType) -> None:
    """The ranks' query heads cover every head once, and each reads a KV head its rank holds."""
    for heads, kv_heads, world in ((9, 3, 3), (4, 2, 4), (8, 2, 8), (8, 4, 2), (6, 2, 6)):
        config = _config(heads, kv_heads, 4 * world)
        layouts = [impl.TPLayout(config, rank, world) for rank in range(world)]
        covered = [h for layout in layouts for h in layout.q_heads]
        assert covered == list(range(heads)), (
            f"{heads} heads over {world} ranks: expected every head once, rank 0 first, "
            f"got {covered}"
        )
        group = heads // kv_heads  # query heads per KV head
        for rank, layout in enumerate(layouts):
            needed = sorted({h // group for h in layout.q_heads})
            assert set(needed) <= set(layout.kv_heads), (
                f"{heads} heads, {kv_heads} KV heads over {world} ranks: rank {rank}'s query "
                f"heads {list(layout.q_heads)} read KV heads {needed}, but it holds "
                f"{list(layout.kv_heads)}"
            )


def check_shapes_that_do_not_split_are_refused(impl: ModuleType) -> None:
    """check_divisible refuses what minserve refuses, naming the size that fails."""
    cases = [(9, 3, 1536, 3), (9, 3, 1536, 2), (4, 2, 8, 4), (8, 4, 8, 8), (6, 6, 6, 4),
             (6, 2, 6, 6), (6, 2, 9, 6), (4, 4, 10, 4), (4, 2, 8, 0), (12, 4, 12, 6)]  # fmt: skip
    for heads, kv_heads, inner, world in cases:
        config = _config(heads, kv_heads, inner)
        case = f"{heads} query heads, {kv_heads} KV heads, MLP {inner}, over {world} ranks"
        try:
            check_divisible(config, world)
            want = None
        except TensorParallelError as error:
            want = str(error)
        try:
            impl.check_divisible(config, world)
            got = None
        except TensorParallelError as error:
            got = str(error)
        assert (got is None) == (want is None), (
            f"{case}: expected {'TensorParallelError: ' + want if want else 'no error'}, "
            f"got {'TensorParallelError: ' + got if got else 'no error'}"
        )
        assert got is None or str(world) in got, (
            f"{case}: the message should name tensor_parallel_size={world}, got {got!r}"
        )


CHECKS = [
    check_column_shard_keeps_this_ranks_output_rows,
    check_column_forward_gives_each_rank_its_output_slice,
    check_column_gather_output_gives_every_rank_the_whole_output,
    check_row_shard_keeps_this_ranks_input_columns_and_the_whole_bias,
    check_row_forward_sums_partials_and_adds_the_bias_once,
    check_row_forward_slices_a_whole_input_itself,
    check_column_then_row_is_the_dense_two_layer_network,
    check_one_rank_is_the_dense_layer,
    check_attention_projections_are_split_by_heads,
    check_one_all_reduce_per_attention_block,
    check_tp2_attention_equals_the_single_rank_block,
    check_tp4_replicated_kv_heads_equal_the_single_rank_block,
    check_vocab_blocks_match_minserves,
    check_embedding_shard_is_the_block_zero_padded,
    check_embedding_lookup_is_the_whole_tables_rows_with_one_all_reduce,
    check_lm_head_gives_rank_0_the_whole_logits,
    check_layout_splits_heads_and_features_as_minserves,
    check_each_ranks_query_heads_read_its_kv_heads,
    check_shapes_that_do_not_split_are_refused,
]

HINTS: dict[str, tuple[str, str, str]] = {
    "7.1": (
        "Column-parallel splits W by output features: each rank owns a block of W's rows "
        "and computes its slice of y from the whole input, with no communication.",
        "shard: slice the rows self.rows of the weight (and of the bias). forward: a plain "
        "linear with the local weight and bias; only with gather_output, concatenate every "
        "rank's slice with the communicator.",
        "`weight[self.rows.start : self.rows.stop]` is the shard; in forward, "
        "`F.linear(x, self.weight, self.bias)` then `self.comm.all_gather(...)` when "
        "`self.gather_output`.",
    ),
    "7.2": (
        "Row-parallel splits W by input features: each rank's product is a partial sum of "
        "the whole y, so one all-reduce adds them; the bias must be added once, after it.",
        "shard: slice the columns self.cols of the weight; keep the whole bias on every "
        "rank. forward: slice x first if it is whole, multiply without the bias, all-reduce, "
        "then add the bias.",
        "`weight[:, self.cols.start : self.cols.stop]`; `partial = F.linear(x, "
        "self.weight)`; all-reduce the partial sums with self.comm; the bias goes on the "
        "sum, not on "
        "partial (or it would be added world_size times).",
    ),
    "7.3": (
        "Split attention by heads: a rank that owns whole query heads, and the KV heads "
        "they read, can attend with no communication. Only the output projection mixes "
        "heads, so its partial sums are the one place the ranks must add up.",
        "q_proj, k_proj, v_proj become column-parallel over the rank's head features, "
        "without gathering their outputs; o_proj becomes row-parallel whose input columns "
        "are the same query-head features. That pairing leaves exactly one all-reduce.",
        "`linear.ColumnParallelLinear(cfg.hidden_size, cfg.q_size, comm, cfg.qkv_bias, "
        "rows=layout.q_features(), dtype=dtype)` is q_proj; k and v use cfg.kv_size and "
        "layout.kv_features(); o_proj is a `linear.RowParallelLinear` from q_size to hidden "
        "with `cols=` the query features.",
    ),
}

HINTS["7.4"] = (
    "Split the vocabulary into contiguous blocks, one per rank, all padded to the same "
    "size. A token's row lives on exactly one rank: the others contribute zeros, so an "
    "all-reduce (a sum) gives every rank the row. The LM head scores each block locally "
    "and only the sampling rank collects the pieces.",
    "vocab_block: the block size is the ceiling of vocab / world_size; clamp both ends of "
    "the range to the vocabulary. shard: slice the block, append zero rows up to "
    "padded_rows. forward: shift the ids into the block, build a mask of the ones inside "
    "it, look up clamped ids, zero the masked-out rows, all-reduce. LM head: a linear "
    "with the local block, gather to rank 0, cut off the padding.",
    "`math.ceil(vocab_size / world_size)` is the block size; `weight.new_zeros(...)` and "
    "`torch.cat` pad; `input_ids - self.rows.start` are local ids, kept in range with "
    "`.clamp(0, self.padded_rows - 1)` before `F.embedding`; `self.comm.gather(...)` "
    "returns None off rank 0, where an empty `[N, 0]` slice of the local scores is the answer.",
)
HINTS["7.5"] = (
    "Megatron splits attention by heads and the MLP by inner features, each rank a "
    "contiguous share. Grouped-query attention adds a twist: a rank needs the KV heads "
    "its query heads read, and when there are fewer KV heads than ranks, several ranks "
    "hold copies of the same one.",
    "q_heads and mlp_features: the rank's even share as a range. kv_heads: if KV heads "
    "are replicated, the one head is the rank divided by the number of ranks per KV "
    "head; else an even share. Features are heads times head_dim. local_config is the "
    "config with the rank's counts in place of the whole model's. check_divisible: test "
    "world_size >= 1, then heads, KV heads (either way round) and the MLP in turn.",
    "The share is `self.config.num_heads // self.world_size` heads, starting at "
    "`self.rank` times that; in the replicated case the ranks per KV head "
    "are `self.world_size // cfg.num_kv_heads`; `dataclasses.replace(self.config, "
    "num_heads=..., ...)` builds the local config; raise `TensorParallelError(...)` with "
    "f-strings that show world_size.",
)
