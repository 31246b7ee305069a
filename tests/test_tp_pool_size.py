"""Tensor-parallel KV pool sizing: every rank measures its own shard, together, and the pool
is the smallest any rank affords. Two real gloo processes on the CPU; the budget function
is injected, and it all-reduces as the shard's layers do, so a rank that measured alone
would wait for the other until the test's timeout."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import torch
import torch.distributed as dist

from minserve.distributed.group import free_port
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.model_config import ModelConfig
from minserve.worker.pool_size import PoolRequest, agree_pool_blocks

CONFIG = ModelConfig("llama", 256, 64, 128, num_layers=2, num_heads=4, num_kv_heads=1,
                     head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                     max_position_embeddings=512, tie_word_embeddings=True)  # fmt: skip
BLOCK_SIZE = 16
BLOCK_BYTES = PagedKVPool.bytes_per_block(CONFIG, BLOCK_SIZE, torch.float32)  # 4 KiB
FREE_BLOCKS = {0: 50, 1: 30}  # rank 1's GPU has less left: its shard's pool is the limit


class Shard(torch.nn.Module):
    """What sizing reads of a rank's model: its config and its parameters' dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.config = CONFIG
        self.weight = torch.nn.Parameter(torch.zeros(1))


def measure(model: torch.nn.Module, utilization: float, num_tokens: int, num_logits: int) -> int:
    """A rank's budget in bytes; first an all-reduce, as the profile forward's layers do.
    A budget of -1 blocks (rank 1 in the failure case) raises, as a profile out of memory."""
    seen = torch.tensor([float(num_tokens + num_logits)])
    dist.all_reduce(seen)  # the compute group: both ranks must be here
    rank = dist.get_rank()
    if FREE_BLOCKS.get(rank, 0) < 0:
        raise ValueError(f"rank {rank}: no GPU memory left for the KV cache")
    assert seen.item() == 2 * (num_tokens + num_logits)  # both ran the same step
    return int(FREE_BLOCKS[rank] * BLOCK_BYTES * utilization / 0.5) + BLOCK_BYTES // 2


def rank_main(rank: int, port: int, request: PoolRequest, free: dict, results: mp.Queue) -> None:
    FREE_BLOCKS.update(free)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=20))  # fmt: skip
    control = dist.new_group(backend="gloo")
    try:
        got = agree_pool_blocks(control, request if rank == 0 else None, Shard(), measure)
        results.put((rank, got))
    except Exception as error:
        results.put((rank, f"{type(error).__name__}: {error}"))
    finally:
        dist.destroy_process_group()


def run_two_ranks(request: PoolRequest, free: dict[int, int]) -> dict[int, object]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=rank_main, args=(r, port, request, free, results))
             for r in (0, 1)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        return dict(results.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()


MEASURED = PoolRequest(None, BLOCK_SIZE, 0.5, num_tokens=64, num_logits=4)


def test_every_rank_measures_and_the_smallest_pool_wins() -> None:
    assert run_two_ranks(MEASURED, FREE_BLOCKS) == {0: 30, 1: 30}


def test_each_rank_reads_the_utilization_rank_0_sent() -> None:
    request = PoolRequest(None, BLOCK_SIZE, 0.25, num_tokens=64, num_logits=4)
    assert run_two_ranks(request, {0: 40, 1: 60}) == {0: 20, 1: 20}  # half of rank 0's 40


def test_a_given_size_is_rank_0s_on_every_rank_without_measuring() -> None:
    given = PoolRequest(12, BLOCK_SIZE, 0.5, num_tokens=64, num_logits=4)
    assert run_two_ranks(given, {0: -1, 1: -1}) == {0: 12, 1: 12}  # a measure would raise


def test_a_rank_that_cannot_measure_fails_every_rank_instead_of_hanging() -> None:
    results = run_two_ranks(MEASURED, {0: 50, 1: -1})
    assert results[1] == "ValueError: rank 1: no GPU memory left for the KV cache"
    assert results[0].startswith("PoolSizeError: another tensor-parallel rank could not size")


def test_the_request_crosses_as_it_was_sent() -> None:
    assert PoolRequest.decode(MEASURED.encode()) == MEASURED
    given = PoolRequest(7, 32, 0.9, 8192, 256)
    assert PoolRequest.decode(given.encode()) == given
