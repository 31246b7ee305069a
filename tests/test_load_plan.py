"""Load or recompute (minserve/kvcache/load_plan.py): the plan is the cheapest cut point,
a faster tier never loads less, a tier's latency is paid once so that a run of blocks can pay
for it where one block cannot, throttled reads really take longer, and the tier speeds
measured on this machine are usable numbers."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve.kvcache.block_key import UNSHARED_ROOT, block_keys
from minserve.kvcache.disk_store import DiskBlockStore
from minserve.kvcache.load_plan import (
    DEVICE,
    BandwidthCap,
    LoadPlan,
    TierSpeed,
    measure_disk_speed,
    measure_host_speed,
    plan_load,
)
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.model_config import ModelConfig

TIERS = ("device", "host", "disk", "remote")
BLOCK = torch.arange(16384, dtype=torch.float32)  # 64 KiB, a small block's worth of KV


def _cost(k: int, case: dict) -> float:
    """Brute force: the predicted seconds of loading the first k blocks, from the model's
    definition (each tier used pays its latency once and its bytes; the rest recomputed)."""
    speeds = {s.name: s for s in (DEVICE, *case["speeds"])}
    loaded = case["holders"][:k]
    load_s = sum(
        speeds[name].latency_s
        + loaded.count(name) * case["block_nbytes"] / speeds[name].bytes_per_s
        for name in set(loaded)
    )
    return load_s + (case["num_blocks"] - k) * case["block_size"] / case["prefill_tokens_per_s"]


def _plan(case: dict) -> LoadPlan:
    return plan_load(**case)


def _speed(name: str) -> st.SearchStrategy[TierSpeed]:
    return st.builds(
        TierSpeed,
        st.just(name),
        st.floats(0.0, 0.05),  # latency: none to a slow round trip
        st.floats(1e6, 1e11),  # bandwidth: 1 MB/s to 100 GB/s
    )


@st.composite
def cases(draw: st.DrawFn) -> dict:
    """A prompt, which tier holds each leading block, and the speeds."""
    holders = draw(st.lists(st.sampled_from(TIERS), max_size=12))
    return {
        "num_blocks": len(holders) + draw(st.integers(0, 4)),
        "holders": holders,
        "block_nbytes": draw(st.integers(1, 1 << 24)),
        "block_size": draw(st.sampled_from([1, 16, 64])),
        "prefill_tokens_per_s": draw(st.floats(1e2, 1e6)),
        "speeds": [draw(_speed(name)) for name in TIERS[1:]],
    }


@settings(max_examples=300, deadline=None)
@given(cases())
def test_the_plan_is_the_cheapest_cut_point(case: dict) -> None:
    plan = _plan(case)
    costs = [_cost(k, case) for k in range(len(case["holders"]) + 1)]
    assert 0 <= plan.num_load <= len(case["holders"])
    assert plan.seconds == pytest.approx(min(costs), rel=1e-9)
    assert plan.seconds == pytest.approx(costs[plan.num_load], rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(cases(), st.sampled_from(TIERS[1:]), st.floats(1.0, 1e3))
def test_a_faster_tier_never_loads_fewer_blocks(case: dict, tier: str, factor: float) -> None:
    faster = [
        TierSpeed(s.name, s.latency_s / factor, s.bytes_per_s * factor) if s.name == tier else s
        for s in case["speeds"]
    ]
    before, after = _plan(case), _plan({**case, "speeds": faster})
    assert after.seconds <= before.seconds * (1 + 1e-9)
    # fewer blocks only where the old cut ties the new best (rounding decides between them)
    old_cut = _cost(before.num_load, {**case, "speeds": faster})
    assert after.num_load >= before.num_load or math.isclose(old_cut, after.seconds, rel_tol=1e-9)


@settings(max_examples=150, deadline=None)
@given(cases(), st.floats(1.0, 1e3))
def test_a_slower_prefill_never_loads_fewer_blocks(case: dict, factor: float) -> None:
    slower = {**case, "prefill_tokens_per_s": case["prefill_tokens_per_s"] / factor}
    before, after = _plan(case), _plan(slower)
    old_cut = _cost(before.num_load, slower)
    assert after.num_load >= before.num_load or math.isclose(old_cut, after.seconds, rel_tol=1e-9)


# a disk with 5 ms latency and 1 ms per 1 MB block; recomputing a block takes 2 ms
DISK = TierSpeed("disk", 5e-3, 1e9)
HOST = TierSpeed("host", 1e-5, 2e10)
SLOW_PREFILL = dict(block_nbytes=10**6, block_size=16, prefill_tokens_per_s=8000.0)


def test_one_disk_block_does_not_pay_for_the_latency_but_eight_do() -> None:
    assert DISK.load_s(10**6) == pytest.approx(6e-3)  # one block alone: 6 ms > 2 ms recompute
    one = plan_load(1, ["disk"], speeds=[DISK], **SLOW_PREFILL)
    assert one == LoadPlan(0, pytest.approx(2e-3))
    eight = plan_load(8, ["disk"] * 8, speeds=[DISK], **SLOW_PREFILL)
    assert eight == LoadPlan(8, pytest.approx(13e-3))  # 5 + 8 x 1 ms < 8 x 2 ms
    # a prompt longer than what is held: the held run still pays, the rest is recomputed
    longer = plan_load(12, ["disk"] * 8, speeds=[DISK], **SLOW_PREFILL)
    assert longer == LoadPlan(8, pytest.approx(13e-3 + 4 * 2e-3))


def test_a_short_tail_on_a_slow_tier_is_recomputed_and_a_long_one_loaded() -> None:
    short = plan_load(5, ["host"] * 4 + ["disk"], speeds=[HOST, DISK], **SLOW_PREFILL)
    assert short.num_load == 4
    long = plan_load(12, ["host"] * 4 + ["disk"] * 8, speeds=[HOST, DISK], **SLOW_PREFILL)
    assert long.num_load == 12


def test_device_blocks_cost_nothing() -> None:
    plan = plan_load(5, ["device"] * 3, speeds=[], **SLOW_PREFILL)
    assert plan == LoadPlan(3, 2 * 2e-3)  # exactly the two blocks recomputed
    # even with no prefill cost to save, a tie loads
    assert plan_load(2, ["device"] * 2, 10**6, 16, math.inf, []).num_load == 2


def test_bad_inputs_name_what_is_wrong() -> None:
    with pytest.raises(KeyError, match=r"no TierSpeed for tiers \['remote'\]"):
        plan_load(2, ["host", "remote"], speeds=[HOST], **SLOW_PREFILL)
    with pytest.raises(ValueError, match="3 blocks held for a prompt of 2 blocks"):
        plan_load(2, ["host"] * 3, speeds=[HOST], **SLOW_PREFILL)
    with pytest.raises(ValueError, match="prefill_tokens_per_s > 0"):
        plan_load(2, [], 10**6, 16, 0.0, [])
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        TierSpeed("disk", 0.0, 0.0)
    with pytest.raises(ValueError, match="latency must be finite and >= 0"):
        TierSpeed("disk", -1e-3, 1e9)


def test_a_tier_read_through_another_pays_both() -> None:
    path = DISK.then(HOST)
    assert path.name == "disk"
    for num_bytes in (1, 10**6, 10**9):
        assert path.load_s(num_bytes) == pytest.approx(
            DISK.load_s(num_bytes) + HOST.load_s(num_bytes)
        )
    assert DISK.then(DEVICE).load_s(10**6) == pytest.approx(DISK.load_s(10**6))  # free


def test_throttling_lowers_the_bandwidth_and_never_raises_it() -> None:
    assert DISK.throttled(1e6) == TierSpeed("disk", 5e-3, 1e6)
    assert DISK.throttled(1e12) == DISK
    # throttled far enough, the eight disk blocks are recomputed after all
    slow = plan_load(8, ["disk"] * 8, speeds=[DISK.throttled(1e8)], **SLOW_PREFILL)
    assert slow.num_load == 0


# --- real reads and copies on this machine ---


@pytest.fixture
def store(tmp_path: Path):
    store = DiskBlockStore(tmp_path / "store", 1 << 24)
    yield store
    store.close()


def test_a_bandwidth_cap_really_delays_reads(store: DiskBlockStore) -> None:
    key, missing = block_keys(UNSHARED_ROOT, [1, 2], 1)
    store.put(key, BLOCK)
    store.flush()
    capped = BandwidthCap(store, 2e6)  # 64 KiB at 2 MB/s: 33 ms
    start = time.perf_counter()
    got = capped.get(key)
    took = time.perf_counter() - start
    assert got is not None and torch.equal(got, BLOCK)
    assert BLOCK.nbytes / 2e6 * 0.99 <= took < 1.0
    start = time.perf_counter()
    assert capped.get(missing) is None  # a miss moves no bytes: no wait
    assert time.perf_counter() - start < 0.02
    assert capped.stats.hits == 1 and key in capped  # the rest is the store's
    with pytest.raises(ValueError, match="finite and > 0"):
        BandwidthCap(store, math.inf)


def _tiny_pool() -> PagedKVPool:
    config = ModelConfig("llama", 256, 64, 128, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                         max_position_embeddings=256, tie_word_embeddings=True)  # fmt: skip
    return PagedKVPool(config, num_blocks=8, block_size=16, dtype=torch.float32, device="cpu")


def _usable(speed: TierSpeed, name: str) -> None:
    assert speed.name == name
    assert math.isfinite(speed.latency_s) and speed.latency_s >= 0
    assert math.isfinite(speed.bytes_per_s) and speed.bytes_per_s > 0


def test_the_host_speed_is_measured_without_changing_the_pool() -> None:
    pool = _tiny_pool()
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(0)))
    before = pool.kv.clone()
    _usable(measure_host_speed(pool), "host")
    assert torch.equal(pool.kv, before)


def test_the_disk_speed_is_measured_from_cold_reads_and_leaves_nothing(tmp_path: Path) -> None:
    _usable(measure_disk_speed(tmp_path, BLOCK, num_blocks=4, repeats=2), "disk")
    assert list(tmp_path.iterdir()) == []  # the scratch store is gone


def test_a_sweep_of_caps_switches_the_plan_from_loading_to_recomputing(tmp_path: Path) -> None:
    """What a benchmark of throttled tiers checks: with recompute 4x slower than this disk,
    the plan loads; capped so that a block takes 64x longer than on this disk, it recomputes,
    and reading the blocks through that cap takes about what the plan predicts."""
    disk = measure_disk_speed(tmp_path, BLOCK, num_blocks=4, repeats=2)
    block_s = disk.load_s(BLOCK.nbytes)  # one block from this disk, latency included
    prompt = dict(num_blocks=8, holders=["disk"] * 8, block_nbytes=BLOCK.nbytes, block_size=16,
                  prefill_tokens_per_s=16 / (4 * block_s))  # fmt: skip
    assert plan_load(**prompt, speeds=[disk]).num_load == 8
    cap = BLOCK.nbytes / (64 * block_s)
    capped = measure_disk_speed(tmp_path, BLOCK, num_blocks=4, repeats=2, bytes_per_s_cap=cap)
    assert capped.bytes_per_s <= cap * 1.5  # the cap binds (1.5: noise in the 1-block read)
    assert plan_load(**prompt, speeds=[capped]).num_load == 0
    keys = block_keys(UNSHARED_ROOT, list(range(8)), 1)
    store = DiskBlockStore(tmp_path / "store", 1 << 24)
    for key in keys:
        store.put(key, BLOCK)
    store.close()
    start = time.perf_counter()
    assert all(BandwidthCap(store, cap).get(key) is not None for key in keys)
    predicted = capped.load_s(8 * BLOCK.nbytes)
    assert 0.5 * predicted <= time.perf_counter() - start <= 3 * predicted
