"""The prefix cache's host tier: evicted blocks demoted to host memory, promoted on a hit.

Oracle: the reference path's greedy tokens. Workload: four system prompts taking turns in
a pool that holds about two (tests/test_prefix_policy.py), where LRU eviction alone
misses every time; with the host tier, each evicted prefix comes back by copy.
"""

from __future__ import annotations

import pytest
from test_engine import token_ids
from test_prefix_policy import round_robin_workload

from minserve import LLM, CoursePlugins
from minserve.kvcache.host_tier import TierCosts


def test_copy_back_wins_when_copying_is_faster_than_recomputing():
    costs = TierCosts(copy_bytes_per_s=1e9, prefill_tokens_per_s=1000)
    assert costs.copy_back_wins(num_bytes=10**6, num_tokens=16)  # 1 ms against 16 ms
    assert not costs.copy_back_wins(num_bytes=10**8, num_tokens=16)  # 100 ms against 16 ms


def _llm(tiny_model, gib: float) -> LLM:
    return LLM(
        tiny_model("llama"),
        enable_prefix_caching=True,
        kv_offloading_size=gib,
        block_size=4,
        num_blocks=12,
        max_num_seqs=1,
    )


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[list[int]]:
    prompts, params = round_robin_workload()
    reference = LLM(tiny_model("llama"), engine="reference")
    return token_ids(reference.generate(prompts, params, use_tqdm=False))


def test_evicted_prefixes_come_back_from_the_host(tiny_model, expected) -> None:
    llm = _llm(tiny_model, gib=0.01)
    prompts, params = round_robin_workload()
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    metrics = llm.get_metrics()
    ideal = 12 * 16 / (16 * 18)  # every request but each prefix's first reuses 16 tokens
    assert metrics["prefix_cache_hit_rate"] == pytest.approx(ideal)  # 0 without the tier
    assert metrics["prefix_cache_promoted_blocks"] > 0
    block_bytes = llm.engine.worker.pool.block_nbytes
    assert metrics["host_tier_bytes_in"] == metrics["prefix_cache_promoted_blocks"] * block_bytes
    assert metrics["host_tier_bytes_out"] >= metrics["host_tier_bytes_in"]


def test_when_recomputing_is_faster_nothing_is_copied_back(tiny_model, expected) -> None:
    llm = _llm(tiny_model, gib=0.01)
    llm.engine.kv.prefix.host.costs = TierCosts(copy_bytes_per_s=1.0, prefill_tokens_per_s=1e9)
    prompts, params = round_robin_workload()
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    metrics = llm.get_metrics()
    assert metrics["host_tier_bytes_out"] > 0 and metrics["host_tier_bytes_in"] == 0
    assert metrics["prefix_cache_hit_rate"] == 0.0


def test_the_host_tier_is_bounded_and_drops_its_oldest_blocks(tiny_model, expected) -> None:
    llm = _llm(tiny_model, gib=1e-9)  # room for a single block
    prompts, params = round_robin_workload()
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    host = llm.engine.kv.prefix.host
    assert host.capacity_blocks == 1 and len(host) <= 1 and host.num_dropped > 0


def test_the_solutions_host_tier_plugs_in_and_changes_nothing(tiny_model, expected) -> None:
    """Exercise 5.3's class runs the engine's host tier: the same tokens and hits."""
    import solutions.ch05_radix_cache as student

    llm = LLM(
        tiny_model("llama"),
        enable_prefix_caching=True,
        kv_offloading_size=0.01,
        block_size=4,
        num_blocks=12,
        max_num_seqs=1,
        plugins=CoursePlugins(host_tier_cls=student.HostPrefixTier),
    )
    assert isinstance(llm.engine.kv.prefix.host, student.HostPrefixTier)
    prompts, params = round_robin_workload()
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_hit_rate"] == pytest.approx(12 * 16 / (16 * 18))
    promoted = metrics["prefix_cache_promoted_blocks"]
    assert metrics["host_tier_bytes_in"] == promoted * llm.engine.worker.pool.block_nbytes > 0
    with pytest.raises(ValueError, match="host_tier_cls is used only with"):
        LLM(llm.loaded, plugins=CoursePlugins(host_tier_cls=student.HostPrefixTier))
