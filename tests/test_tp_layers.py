"""Tensor-parallel layers equal their dense counterparts (ranks run as threads).

Each test shards a dense layer (or a whole tiny model) over N thread-ranks joined by
`ThreadComm`, runs every rank, and compares with the dense result computed in one piece.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minserve.attention.contiguous import ContiguousAttention, ContiguousSlice, SequenceKV
from minserve.distributed.checkpoint import CheckpointTensors
from minserve.distributed.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    even_split,
    load_shard,
)
from minserve.distributed.layout import TensorParallelError, TPLayout
from minserve.distributed.shard_model import build_shard, parameter_bytes
from minserve.distributed.threads import run_on_threads
from minserve.distributed.vocab import ParallelLMHead, VocabParallelEmbedding
from minserve.loader import load_model

torch.manual_seed(0)
X = torch.randn(5, 12)  # [T, in]
DENSE = nn.Linear(12, 6)  # W [6, 12], b [6]


def _column(comm, gather: bool) -> torch.Tensor:
    layer = ColumnParallelLinear(12, 6, comm, gather_output=gather)
    load_shard(layer, DENSE.weight.detach(), DENSE.bias.detach())
    return layer(X)


def _row(comm, input_is_parallel: bool) -> torch.Tensor:
    layer = RowParallelLinear(12, 6, comm, input_is_parallel=input_is_parallel)
    load_shard(layer, DENSE.weight.detach(), DENSE.bias.detach())
    x = X[:, layer.cols.start : layer.cols.stop] if input_is_parallel else X
    return layer(x)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_column_parallel_ranks_compute_slices_of_the_dense_output(world_size: int) -> None:
    outs = run_on_threads(_column, world_size, False)
    torch.testing.assert_close(torch.cat(outs, dim=-1), DENSE(X))


def test_column_parallel_gather_output_gives_every_rank_the_dense_output() -> None:
    for out in run_on_threads(_column, 2, True):
        torch.testing.assert_close(out, DENSE(X))


@pytest.mark.parametrize("input_is_parallel", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_row_parallel_all_reduce_gives_the_dense_output_bias_once(
    world_size: int, input_is_parallel: bool
) -> None:
    for out in run_on_threads(_row, world_size, input_is_parallel):
        torch.testing.assert_close(out, DENSE(X))


UP, DOWN = nn.Linear(12, 8), nn.Linear(8, 12)


def _mlp(comm) -> torch.Tensor:
    col, row = ColumnParallelLinear(12, 8, comm), RowParallelLinear(8, 12, comm)
    load_shard(col, UP.weight.detach(), UP.bias.detach())
    load_shard(row, DOWN.weight.detach(), DOWN.bias.detach())
    return row(torch.relu(col(X)))  # no communication between the two


def test_column_then_row_is_the_dense_mlp_with_one_all_reduce() -> None:
    dense = DOWN(torch.relu(UP(X)))
    for out in run_on_threads(_mlp, 2):
        torch.testing.assert_close(out, dense)


def test_uneven_split_is_refused_with_the_sizes() -> None:
    with pytest.raises(ValueError, match="cannot split 6 features evenly over 4 ranks"):
        even_split(6, 0, 4)


def _vocab(comm, table: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor):
    embed = VocabParallelEmbedding(table.shape[0], table.shape[1], comm, torch.float32)
    load_shard(embed, table, None)
    head = ParallelLMHead(embed, tied=True)
    return embed(ids), head(hidden)


@pytest.mark.parametrize("world_size", [2, 3])
def test_vocab_parallel_embedding_and_lm_head_equal_the_dense_ones(world_size: int) -> None:
    table = torch.randn(10, 4)  # 10 tokens: blocks of 4, 4, 2 over 3 ranks (padded)
    ids = torch.tensor([0, 9, 3, 4, 7, 5])
    hidden = torch.randn(2, 4)
    results = run_on_threads(_vocab, world_size, table, ids, hidden)
    for rank, (embedded, logits) in enumerate(results):
        torch.testing.assert_close(embedded, table[ids])
        if rank == 0:
            torch.testing.assert_close(logits, hidden @ table.T)  # [2, 10], padding dropped
        else:
            assert logits.shape == (2, 0)  # only rank 0 samples


def test_layout_shards_smollm2_heads_over_three_ranks(smollm_gguf) -> None:
    config = CheckpointTensors(smollm_gguf).config  # 9 heads, 3 KV heads, MLP 1536
    layouts = [TPLayout(config, r, 3) for r in range(3)]
    assert [list(lay.q_heads) for lay in layouts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [list(lay.kv_heads) for lay in layouts] == [[0], [1], [2]]
    assert layouts[1].local_config().intermediate_size == 512
    with pytest.raises(TensorParallelError, match="must divide the model's 9 query heads"):
        TPLayout(config, 0, 2)


def test_layout_replicates_kv_heads_when_ranks_outnumber_them(tiny_model) -> None:
    config = CheckpointTensors(tiny_model("llama")).config  # 4 heads, 2 KV heads
    layouts = [TPLayout(config, r, 4) for r in range(4)]
    assert [list(lay.kv_heads) for lay in layouts] == [[0], [0], [1], [1]]
    assert all(lay.kv_replicated for lay in layouts)
    # query heads 0, 1 read KV head 0 and heads 2, 3 read KV head 1 (group size 2)
    assert [list(lay.q_heads) for lay in layouts] == [[0], [1], [2], [3]]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    kv = SequenceKV(model.config, 16, torch.float32, torch.device("cpu"))
    attention = ContiguousAttention([ContiguousSlice(kv, 0, ids.numel())])
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(ids.numel()), attention))


def _sharded_logits(comm, source: CheckpointTensors, ids: torch.Tensor):
    model = build_shard(source, comm, torch.float32, torch.device("cpu"))
    return _logits(model, ids), parameter_bytes(model)


@pytest.mark.parametrize(
    ("kind", "world_size"),
    [("llama", 2), ("llama", 4), ("llama3_rope", 2), ("qwen2", 2), ("qwen3", 2)],
)
def test_sharded_tiny_model_logits_equal_the_dense_model(tiny_model, kind, world_size) -> None:
    """Biases (qkv, o), qk-norm, untied heads, and replicated KV heads (4 ranks, 2 KV heads)."""
    path = tiny_model(kind)
    ids = torch.tensor([1, 504, 3458, 282, 4649, 314, 7])
    dense = load_model(path).model
    results = run_on_threads(_sharded_logits, world_size, CheckpointTensors(path), ids)
    torch.testing.assert_close(results[0][0], _logits(dense, ids), atol=1e-4, rtol=1e-4)
    full = parameter_bytes(dense)
    for _, nbytes in results:
        assert full / world_size <= nbytes < full / world_size * 1.02
