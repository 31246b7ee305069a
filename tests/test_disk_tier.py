"""The disk tier beneath the prefix cache: write-through, load-or-recompute, restarts.

Oracles: the reference path's greedy tokens (a block loaded from disk must hold exactly
the KV the model computes), the pool's own blocks (what is on disk equals what the tree
holds, byte for byte), and a subscriber's index of the KV events (the disk medium).
Workload: four system prompts taking turns in a pool that holds about two
(tests/test_prefix_policy.py), so each prefix is evicted from the device before it comes
back; without a host tier it can only come back from disk.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_engine import token_ids
from test_engine_kv_events import EVENTS, receive_all
from test_prefix_policy import round_robin_workload

from minserve import LLM, SamplingParams
from minserve.kvcache.kv_event_socket import KVEventSubscriber
from minserve.kvcache.load_plan import TierSpeed
from minserve.messages import DiskWrite
from minserve.router.exact_index import ExactIndex

FAST = TierSpeed("disk", 0.0, math.inf)  # loading always wins
SLOW = TierSpeed("disk", 10.0, 1.0)  # recomputing always wins


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[list[int]]:
    prompts, params = round_robin_workload()
    return token_ids(LLM(tiny_model("llama"), engine="reference").generate(prompts, params))


def _llm(tiny_model, path: Path, speed: TierSpeed = FAST, **options) -> LLM:
    llm = LLM(tiny_model("llama"), enable_prefix_caching=True, block_size=4, num_blocks=12,
              max_num_seqs=1, kv_disk_path=path, **options)  # fmt: skip
    llm.engine.kv.prefix.disk.speed = speed  # the rule's input, fixed for the test
    return llm


def _run(llm: LLM) -> list[list[int]]:
    prompts, params = round_robin_workload()
    return token_ids(llm.generate(prompts, params, use_tqdm=False))


def test_evicted_prefixes_come_back_from_disk(tiny_model, expected, tmp_path) -> None:
    llm = _llm(tiny_model, tmp_path)
    assert _run(llm) == expected
    metrics = llm.get_metrics()
    ideal = 12 * 16 / (16 * 18)  # every request but each prefix's first reuses 16 tokens
    assert metrics["prefix_cache_hit_rate"] == pytest.approx(ideal)  # 0 without a lower tier
    assert metrics["disk_tier_blocks_loaded"] >= 12 * 4 - 2 * 4  # most prefixes from disk
    block_bytes = llm.engine.worker.pool.block_nbytes
    assert metrics["disk_tier_bytes_in"] == metrics["disk_tier_blocks_loaded"] * block_bytes
    llm.engine.shutdown()


def test_what_is_on_disk_is_what_the_pool_computed(tiny_model, tmp_path) -> None:
    llm = _llm(tiny_model, tmp_path)
    _run(llm)
    llm.engine.shutdown()  # carries out the last step's writes and waits for them
    store = llm.engine.worker.disk_store
    prefix, pool = llm.engine.kv.prefix, llm.engine.worker.pool
    held = [(block, prefix.events.key_of(block)) for block in range(pool.num_blocks)]
    held = [(block, key) for block, key in held if key is not None]
    assert held
    for block, key in held:
        assert torch.equal(store.get(key), pool.read_blocks([block]))


def test_when_recomputing_is_faster_nothing_is_loaded(tiny_model, expected, tmp_path) -> None:
    llm = _llm(tiny_model, tmp_path, SLOW)
    assert _run(llm) == expected
    metrics = llm.get_metrics()
    assert metrics["disk_tier_blocks_written"] > 0 and metrics["disk_tier_blocks_loaded"] == 0
    llm.engine.shutdown()


def test_a_restarted_engine_reads_what_the_last_one_wrote(tiny_model, expected, tmp_path) -> None:
    first = _llm(tiny_model, tmp_path)
    prompts, params = round_robin_workload()
    first.generate(prompts[:4], params, use_tqdm=False)  # each system prompt once
    first.engine.shutdown()  # the queued writes reach the disk
    second = _llm(tiny_model, tmp_path)
    assert _run(second) == expected
    metrics = second.get_metrics()
    assert metrics["prefix_cache_hit_rate"] == pytest.approx(16 / 18)  # even the first turns
    second.engine.shutdown()


def test_a_corrupt_block_is_recomputed(tiny_model, expected, tmp_path) -> None:
    first = _llm(tiny_model, tmp_path)
    prompts, params = round_robin_workload()
    first.generate(prompts[:4], params, use_tqdm=False)
    first.engine.shutdown()
    for path in sorted(tmp_path.glob("*/*.kvb"))[::2]:
        path.write_bytes(path.read_bytes()[:-7])  # cut short
    second = _llm(tiny_model, tmp_path)
    assert _run(second) == expected
    assert second.engine.worker.disk_store.stats.corrupt > 0
    second.engine.shutdown()


def test_disk_events_match_the_store(tiny_model, tmp_path) -> None:
    llm = _llm(tiny_model, tmp_path, kv_events_config=EVENTS)
    store = llm.engine.worker.disk_store
    store.capacity_bytes = 20 * (llm.engine.worker.pool.block_nbytes + 100)  # evicts
    info = llm.engine.kv_events_info()
    subscriber = KVEventSubscriber(info["host"], info["port"], info["replay_port"])
    try:
        index = ExactIndex([info["instance"]])
        index.replay(info["instance"], subscriber.replay(0)[1])
        _run(llm)
        receive_all(subscriber, index, info["instance"])
        store.flush()
        assert store.stats.evicted > 0
        # on disk, or decided and written first thing in the next step
        queued = {op.key for op in llm.engine.kv._ops if isinstance(op, DiskWrite)}
        assert queued or store._index
        assert index.blocks(info["instance"], "disk") == set(store._index) | queued
    finally:
        subscriber.close()
        llm.engine.shutdown()


def test_disk_options_are_checked(tiny_model, tmp_path) -> None:
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        LLM(tiny_model("llama"), kv_disk_path=tmp_path)
    with pytest.raises(ValueError, match="kv_disk_size"):
        LLM(tiny_model("llama"), enable_prefix_caching=True, kv_disk_path=tmp_path,
            kv_disk_size=0)  # fmt: skip


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_8_bit_blocks_round_trip(tiny_model, tmp_path, kv_cache_dtype) -> None:
    """Blocks stored in 8 bits (with their scales) load back to the same tokens as the
    same engine computing them."""
    prompts, params = round_robin_workload()
    plain = LLM(tiny_model("llama"), enable_prefix_caching=True, block_size=4, num_blocks=12,
                max_num_seqs=1, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    first = _llm(tiny_model, tmp_path, kv_cache_dtype=kv_cache_dtype)
    first.generate(prompts[:4], params, use_tqdm=False)
    first.engine.shutdown()
    second = _llm(tiny_model, tmp_path, kv_cache_dtype=kv_cache_dtype)
    assert token_ids(second.generate(prompts, params, use_tqdm=False)) == want
    assert second.get_metrics()["disk_tier_blocks_loaded"] > 0
    second.engine.shutdown()


def test_a_restarted_engine_announces_what_its_disk_holds(tiny_model, tmp_path) -> None:
    first = _llm(tiny_model, tmp_path)
    _run(first)
    first.engine.shutdown()
    second = _llm(tiny_model, tmp_path, kv_events_config=EVENTS)
    info = second.engine.kv_events_info()
    subscriber = KVEventSubscriber(info["host"], info["port"], info["replay_port"])
    try:
        index = ExactIndex([info["instance"]])
        index.replay(info["instance"], subscriber.replay(0)[1])
        on_disk = set(second.engine.worker.disk_store.keys())
        assert on_disk and index.blocks(info["instance"], "disk") == on_disk
    finally:
        subscriber.close()
        second.engine.shutdown()


def test_preempted_requests_read_back_their_own_blocks_once(tiny_model, tmp_path) -> None:
    """Requests outgrowing the pool while they decode are preempted and come back through
    the disk; a request is loaded for only when the pool has room for all of it, so the
    blocks read back stay within what the preempted requests held (a waiting request that
    was loaded for and then not admitted lost its blocks to eviction and read them again)."""
    prompts = [[3 + i, 40 + i, 7, 9 + i, 11, 60 + i, 13, 17 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = LLM(tiny_model("llama"), engine="reference").generate(prompts, params)
    llm = LLM(tiny_model("llama"), enable_prefix_caching=True, block_size=4, num_blocks=24,
              max_num_seqs=4, kv_disk_path=tmp_path)  # fmt: skip
    llm.engine.kv.prefix.disk.speed = FAST
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == token_ids(reference)
    metrics = llm.get_metrics()
    per_request = math.ceil((8 + 40) / 4)
    assert metrics["num_preemptions"] >= 2  # the pool holds half of the batch at full length
    assert 0 < metrics["disk_tier_blocks_loaded"] <= metrics["num_preemptions"] * per_request
    # the preempted requests' returns are counted apart (vLLM's preempted_*): the requests'
    # first admissions are all the ordinary counters see, and what the disk gave back is hits
    assert metrics["prefix_cache_queries"] == 4 * 8
    hits, queries = (
        metrics["prefix_cache_preempted_hits"],
        metrics["prefix_cache_preempted_queries"],
    )
    assert 4 * metrics["disk_tier_blocks_loaded"] <= hits < queries
    llm.engine.shutdown()
