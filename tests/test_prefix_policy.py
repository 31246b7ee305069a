"""The cache-aware policy ("lpm"): longest cached prefix first, with a starvation guard."""

from __future__ import annotations

import time
from functools import partial

import pytest
from test_engine import token_ids

from minserve import LLM, SamplingParams
from minserve.config import SchedulerConfig
from minserve.kvcache import BlockAllocator
from minserve.kvcache.manager import KVCacheManager
from minserve.kvcache.radix_cache import RadixCache
from minserve.request import Request
from minserve.scheduler.cache_aware import LongestPrefixMatch
from minserve.scheduler.policy import get_policy
from minserve.scheduler.sequence import Sequence


def _kv(prefix_cache: bool = True) -> KVCacheManager:
    allocator = BlockAllocator(32)
    return KVCacheManager(
        allocator, 2, prefix_cache=RadixCache(2, allocator) if prefix_cache else None
    )


def _waiting(kv: KVCacheManager, name: str, prompt: list[int], arrival: float) -> Sequence:
    request = Request.create(name, prompt, SamplingParams(), arrival_time=arrival)
    return Sequence(request, request.samples[0], kv.new_table(), order=int(arrival))


def _cache_prompt(kv: KVCacheManager, prompt: list[int]) -> None:
    """A finished request left `prompt`'s whole blocks in the cache."""
    table = kv.new_table()
    kv.append(table, len(prompt))
    kv.cache_computed(table, prompt, len(prompt))
    kv.free(table)


def test_waiting_requests_are_ranked_by_cached_prefix_then_arrival():
    kv = _kv()
    _cache_prompt(kv, [1, 2, 3, 4, 5, 6])
    now = time.monotonic()
    seqs = [
        _waiting(kv, "cold", [9, 9, 9], now),
        _waiting(kv, "warm", [1, 2, 7, 7], now + 1),
        _waiting(kv, "hot", [1, 2, 3, 4, 5, 6, 8], now + 2),
        _waiting(kv, "hot2", [1, 2, 3, 4, 5, 6, 9], now + 3),
    ]
    policy = LongestPrefixMatch(kv, max_wait_s=60)
    ranked = sorted(seqs, key=policy)
    assert [s.request.request_id for s in ranked] == ["hot", "hot2", "warm", "cold"]
    assert [policy.cached_tokens(s) for s in seqs] == [0, 2, 6, 6]


def test_a_request_waiting_too_long_goes_first():
    kv = _kv()
    _cache_prompt(kv, [1, 2, 3, 4])
    now = time.monotonic()
    old = _waiting(kv, "old", [9, 9, 9], now - 30)  # waited 30 s, shares nothing
    hot = _waiting(kv, "hot", [1, 2, 3, 4, 5], now)
    ranked = sorted([hot, old], key=LongestPrefixMatch(kv, max_wait_s=10))
    assert [s.request.request_id for s in ranked] == ["old", "hot"]
    ranked = sorted([hot, old], key=LongestPrefixMatch(kv, max_wait_s=60))
    assert [s.request.request_id for s in ranked] == ["hot", "old"]


def test_lpm_needs_the_prefix_cache():
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        get_policy("lpm", _kv(prefix_cache=False))


def round_robin_workload() -> tuple[list[list[int]], SamplingParams]:
    """4 system prompts of 16 tokens, 4 questions each, in turn: s0, s1, s2, s3, s0, ..."""
    systems = [list(range(1000 + 100 * s, 1016 + 100 * s)) for s in range(4)]
    prompts = [systems[s] + [50 + q, 60 + s] for q in range(4) for s in range(4)]
    return prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def test_lpm_beats_fcfs_hit_rate_when_the_pool_holds_few_prefixes(tiny_model) -> None:
    """A pool of 12 blocks of 4 holds about two prefixes: FCFS cycles through four and
    LRU evicts each before it comes back; LPM runs each prefix's questions together."""
    prompts, params = round_robin_workload()
    expected = token_ids(
        LLM(tiny_model("llama"), engine="reference").generate(prompts, params, use_tqdm=False)
    )
    rates = {}
    for policy in ("fcfs", "lpm"):
        llm = LLM(
            tiny_model("llama"),
            enable_prefix_caching=True,
            scheduling_policy=policy,
            block_size=4,
            num_blocks=12,
            max_num_seqs=1,
        )
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
        rates[policy] = llm.get_metrics()["prefix_cache_hit_rate"]
    ideal = 12 * 16 / (16 * 18)  # every request but each prefix's first hits its 16 tokens
    assert rates["fcfs"] == 0.0
    assert rates["lpm"] == pytest.approx(ideal)


def test_scheduling_policy_may_be_a_class_built_from_the_kv_manager() -> None:
    kv = _kv()
    policy = get_policy(partial(LongestPrefixMatch, max_wait_s=5.0), kv)
    assert isinstance(policy, LongestPrefixMatch) and policy.max_wait_s == 5.0
    config = SchedulerConfig(scheduling_policy=LongestPrefixMatch)
    assert config.scheduling_policy is LongestPrefixMatch
