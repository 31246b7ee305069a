"""`run_on_ranks`: real gloo processes, and their tensors reach the parent intact."""

from __future__ import annotations

import multiprocessing as mp

import torch

from minserve.distributed import demo
from minserve.distributed.group import free_port
from minserve.distributed.ranks import _collect, _rank_main, run_on_ranks


def test_megatron_mlp_on_two_processes_equals_the_dense_mlp() -> None:
    ranks = run_on_ranks(demo.megatron_mlp, 2)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["up_shard"] == (768, 576) and ranks[1]["down_shard"] == (576, 768)
    torch.testing.assert_close(ranks[0]["partial"] + ranks[1]["partial"], ranks[0]["dense"])
    for r in ranks:
        torch.testing.assert_close(r["output"], r["dense"], atol=1e-5, rtol=1e-5)


def test_a_result_is_readable_after_its_rank_has_exited() -> None:
    """A tensor sent through the queue's pickler would cross as a file descriptor to fetch
    from the live sender; once the rank exits that fails (the CI flake this guards)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    proc = context.Process(
        target=_rank_main, args=(0, 1, free_port(), demo.megatron_mlp, (), results)
    )
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    [(rank, value)] = _collect(results, 1, timeout=10)
    assert rank == 0
    torch.testing.assert_close(value["output"], value["dense"], atol=1e-5, rtol=1e-5)
