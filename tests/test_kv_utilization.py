"""KV-cache utilization: the on-paper comparison on hand-computed cases, and the reading of a
real engine's pool (allocator and block tables) on a tiny random model."""

from __future__ import annotations

import random

import pytest

from minserve import LLM
from minserve.kvcache import BlockAllocator, BlockTable
from minserve.sampling_params import SamplingParams
from minserve.viz.kv_utilization import (
    ContiguousMaxLen,
    ContiguousMaxTokens,
    Paged,
    compare_layouts,
    kv_utilization,
    measure_engine,
    pool_snapshot,
    request_lengths,
    tokens_stored,
)

# Request A: prompt 3, output 2 -> KV holds 3, then 4 tokens.
# Request B: prompt 5, output 3 -> KV holds 5, 6, then 7 tokens.  Stored: 7 + 18 = 25 over 5 steps.
WORKLOAD = [(3, 2), (5, 3)]


def test_a_request_holds_its_prompt_then_one_more_token_per_step() -> None:
    assert list(request_lengths(3, 2)) == [3, 4]
    assert list(request_lengths(5, 1)) == [5]


def test_paged_blocks_of_4_reserve_whole_blocks() -> None:
    # A: 4 + 4 slots; B: 8 + 8 + 8 slots -> 25 / 32; 64 slots / (32 / 5) per request = 10
    u = kv_utilization(WORKLOAD, Paged(block_size=4), budget_tokens=64)
    assert (u.tokens_stored, u.slots_reserved, u.request_steps) == (25, 32, 5)
    assert u.utilization == 25 / 32
    assert u.requests_fit == 10


def test_paged_blocks_of_1_waste_nothing() -> None:
    u = kv_utilization(WORKLOAD, Paged(block_size=1), budget_tokens=64)
    assert (u.slots_reserved, u.utilization, u.requests_fit) == (25, 1.0, 12)


def test_contiguous_prompt_plus_max_tokens_reserves_the_final_length_from_the_start() -> None:
    # A: 5 + 5 slots; B: 8 + 8 + 8 slots -> 25 / 34; 64 * 5 // 34 = 9
    u = kv_utilization(WORKLOAD, ContiguousMaxTokens(), budget_tokens=64)
    assert (u.slots_reserved, u.utilization, u.requests_fit) == (34, 25 / 34, 9)


def test_contiguous_max_model_len_reserves_it_for_every_request() -> None:
    # 5 steps x 8 slots -> 25 / 40; the budget holds 64 // 8 = 8 requests
    u = kv_utilization(WORKLOAD, ContiguousMaxLen(max_model_len=8), budget_tokens=64)
    assert (u.slots_reserved, u.utilization, u.requests_fit) == (40, 25 / 40, 8)


def test_compare_layouts_keeps_the_order_and_labels() -> None:
    layouts = [Paged(16), ContiguousMaxLen(2048), ContiguousMaxTokens()]
    labels = [u.label for u in compare_layouts(WORKLOAD, layouts, 4096)]
    assert labels == [
        "paged, block_size=16",
        "contiguous, max_model_len=2048",
        "contiguous, prompt + max_tokens",
    ]


def test_a_request_longer_than_max_model_len_is_refused() -> None:
    with pytest.raises(ValueError, match="request 1 needs 8 tokens"):
        kv_utilization(WORKLOAD, ContiguousMaxLen(max_model_len=7), budget_tokens=64)


def test_empty_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="output_len >= 1"):
        kv_utilization([(4, 0)], Paged(4), budget_tokens=64)


def test_a_block_shared_by_forked_sequences_is_counted_once() -> None:
    allocator = BlockAllocator(8)
    parent = BlockTable(block_size=4)
    parent.append(allocator, 6)  # blocks [0, 1]: 4 + 2 tokens
    child = parent.fork(allocator)
    child.append(allocator, 1)  # copy-on-write: block 1 -> block 2, which now holds 3 tokens
    assert (parent.blocks, child.blocks) == ([0, 1], [0, 2])
    assert tokens_stored([parent, child]) == 4 + 2 + 3


@pytest.fixture(scope="module")
def tiny_llm(tiny_model) -> LLM:
    # 16 blocks of 4 slots: the workload below needs more, so the scheduler must preempt
    return LLM(model=str(tiny_model("llama")), block_size=4, num_blocks=16, max_model_len=64)


def tiny_workload(seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 14))] for _ in range(6)]
    return prompts, [rng.randint(2, 9) for _ in prompts]


def test_each_snapshot_matches_the_block_tables(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    prompts, output_lens = tiny_workload()
    for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.add_request(f"snap-{i}", None, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        snap = pool_snapshot(engine)
        tables = [s.block_table for s in engine.scheduler.running + engine.scheduler.waiting]
        assert snap.tokens_stored == sum(t.num_tokens for t in tables)
        assert snap.tokens_stored == sum(s.num_computed_tokens for s in engine.scheduler.running)
        assert snap.slots_reserved == sum(len(t.blocks) for t in tables) * 4
        assert snap.tokens_stored <= snap.slots_reserved <= 16 * 4


def test_an_engine_run_reports_utilization_between_0_and_1(tiny_llm: LLM) -> None:
    prompts, output_lens = tiny_workload(seed=1)
    run = measure_engine(tiny_llm.engine, prompts, output_lens)
    assert run.pool_slots == 64 and run.max_model_len == 64
    assert run.num_preemptions > 0  # the pool was too small to hold every request at once
    assert all(0 < s.utilization <= 1 for s in run.snapshots)
    assert 0 < run.mean_utilization <= 1
    assert run.peak.slots_reserved == max(s.slots_reserved for s in run.snapshots) <= 64
    contiguous = run.contiguous_utilization(run.peak)
    assert contiguous["contiguous, max_model_len=64"] < run.peak.utilization
    assert tiny_llm.engine.kv.allocator.num_free == 16  # every block came back
