"""Load or recompute: how many of a prompt's leading blocks to bring up from lower tiers.

A tiered KV cache (device -> host -> disk, later remote tiers: LMCache, SGLang's HiCache,
vLLM's KV offloading) may hold a prompt's leading blocks in several places. For each block,
the fastest tier holding it is known (`["device", "device", "host", "disk", "disk"]`, up to
the first block no tier holds); everything after the loaded prefix is recomputed by the
prefill. `plan_load` picks the cut point that minimises the predicted time.

The model, kept simple on purpose:

- **Loading** from a tier costs `latency_s + bytes / bytes_per_s` (`TierSpeed`), its latency
  paid once per request and tier (opening files, a round trip), however many blocks it
  sends. Device blocks cost nothing. Loads from different tiers run one after another.
- **Recomputing** is linear in tokens: `tokens / prefill_tokens_per_s` (the prefill
  roofline, as in `TierCosts`). Attention adds a term that grows with each token's position,
  so the last blocks of a long prompt cost more to recompute than the first; the linear model
  leaves it out, which errs toward recomputing. Loads and the prefill are not overlapped.

Why every cut point must be tried: a tier's latency makes the choice non-local. One disk block
may not pay for the disk's latency (recomputing it is faster) while eight in a row do, because
they share it. A block-by-block rule ("load while a block's load beats its recompute", the host
tier's `worth_promoting`) stops at the first disk block and never sees the eight.

The speeds are measured on the machine (`measure_host_speed`, `measure_disk_speed`), and a
tier can be made slower for experiments: `TierSpeed.throttled` for the plan, `BandwidthCap`
for the store's real reads, so a benchmark can sweep bandwidths and check that the plan
switches to recomputing where it should.
"""

from __future__ import annotations

import math
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from minserve.kvcache.block_key import UNSHARED_ROOT, BlockKey, block_keys
from minserve.kvcache.disk_store import DiskBlockStore
from minserve.kvcache.paged_pool import PagedKVPool


@dataclass(frozen=True)
class TierSpeed:
    """How fast a tier delivers blocks to the device pool: one latency per request, then
    `bytes_per_s`."""

    name: str  # the tier's name, as the plan's holder lists spell it: "host", "disk"
    latency_s: float  # paid once per request that loads from this tier
    bytes_per_s: float  # bandwidth into the pool (math.inf: free, the device itself)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(
                f"tier {self.name!r}: latency must be finite and >= 0 s, got {self.latency_s}"
            )
        if not self.bytes_per_s > 0:
            raise ValueError(
                f"tier {self.name!r}: bandwidth must be > 0 B/s, got {self.bytes_per_s}"
            )

    def load_s(self, num_bytes: int) -> float:
        """Seconds to load `num_bytes` in one request."""
        return self.latency_s + num_bytes / self.bytes_per_s

    def throttled(self, bytes_per_s: float) -> TierSpeed:
        """This tier capped at `bytes_per_s` (what `BandwidthCap` does to a store's reads)."""
        return replace(self, bytes_per_s=min(self.bytes_per_s, bytes_per_s))

    def then(self, nxt: TierSpeed) -> TierSpeed:
        """This tier's loads passing on through `nxt` (disk -> host memory -> GPU), one
        after the other: the latencies add, and each byte takes both times."""
        bytes_per_s = 1 / (1 / self.bytes_per_s + 1 / nxt.bytes_per_s)
        return TierSpeed(self.name, self.latency_s + nxt.latency_s, bytes_per_s)


DEVICE = TierSpeed("device", 0.0, math.inf)  # blocks already in the pool cost nothing


@dataclass(frozen=True)
class LoadPlan:
    """Load the first `num_load` blocks, recompute the rest; `seconds` is the prediction."""

    num_load: int
    seconds: float


# >>> exercise 11.2: the k-tier load-or-recompute rule
def plan_load(
    num_blocks: int,
    holders: Sequence[str],
    block_nbytes: int,
    block_size: int,
    prefill_tokens_per_s: float,
    speeds: Sequence[TierSpeed],
) -> LoadPlan:
    """The fastest way to get a prompt's `num_blocks` blocks into the pool: load a prefix of
    them, recompute the rest.

    `holders[i]` names the fastest tier holding block i (`len(holders) <= num_blocks`: the
    list stops at the first block no tier holds); `speeds` gives each tier's `TierSpeed`
    ("device" is `DEVICE` unless given: free). Loading the first k blocks costs, for each
    tier among `holders[:k]`, its latency once plus `block_nbytes / bytes_per_s` per block;
    recomputing the other `num_blocks - k` costs `block_size / prefill_tokens_per_s` each.
    Try every k from 0 to `len(holders)` (a tier's latency lets the cost rise, then fall
    again as k grows: stopping at the first block that does not pay misses a longer prefix
    that does),
    keep the cheapest; on a tie, load more (the prefill's compute is what other requests
    share). Returns `LoadPlan(k, predicted seconds)`.
    """
    by_name = {speed.name: speed for speed in (DEVICE, *speeds)}
    check_plan(num_blocks, holders, block_nbytes, block_size, prefill_tokens_per_s, by_name)
    # >>> solution
    recompute_block_s = block_size / prefill_tokens_per_s
    best = LoadPlan(0, num_blocks * recompute_block_s)  # k = 0: recompute everything
    load_s = 0.0  # loading holders[:k]
    paid_latency: set[str] = set()
    for k, name in enumerate(holders, start=1):
        speed = by_name[name]
        if name not in paid_latency:  # the tier's first block pays its latency
            paid_latency.add(name)
            load_s += speed.latency_s
        load_s += block_nbytes / speed.bytes_per_s
        seconds = load_s + (num_blocks - k) * recompute_block_s
        if seconds <= best.seconds:
            best = LoadPlan(k, seconds)
    return best
    # <<< solution


# <<< exercise


def check_plan(
    num_blocks: int,
    holders: Sequence[str],
    block_nbytes: int,
    block_size: int,
    prefill_tokens_per_s: float,
    by_name: dict[str, TierSpeed],
) -> None:
    """Refuse inputs the cost model cannot price, naming the one at fault."""
    if len(holders) > num_blocks:
        raise ValueError(f"{len(holders)} blocks held for a prompt of {num_blocks} blocks")
    if block_nbytes < 0 or block_size < 1 or not prefill_tokens_per_s > 0:
        raise ValueError(
            f"need block_nbytes >= 0, block_size >= 1 and prefill_tokens_per_s > 0, got "
            f"{block_nbytes}, {block_size} and {prefill_tokens_per_s}"
        )
    unknown = sorted(set(holders) - set(by_name))
    if unknown:
        raise KeyError(f"no TierSpeed for tiers {unknown}; speeds are given for {sorted(by_name)}")


# --- measuring tiers on this machine ---


def measure_host_speed(pool: PagedKVPool, num_blocks: int = 8, repeats: int = 3) -> TierSpeed:
    """The host tier's speed: copies from host memory into `pool` (`write_blocks`, what a
    promotion does), timed for 1 block and for `num_blocks` blocks, fastest of `repeats`;
    `latency + bytes / bandwidth` fitted through the two. The copies write the pool's first
    blocks back into themselves: its contents do not change."""
    num_blocks = min(num_blocks, pool.num_blocks)
    if num_blocks < 2 or repeats < 1:
        raise ValueError(
            f"need a pool of >= 2 blocks and repeats >= 1, got {num_blocks}, {repeats}"
        )
    times = [_fastest_copy_in(pool, list(range(n)), repeats) for n in (1, num_blocks)]
    return _fit("host", (pool.block_nbytes, num_blocks * pool.block_nbytes), times)


def measure_disk_speed(
    directory: str | Path,
    block: torch.Tensor,
    num_blocks: int = 8,
    repeats: int = 3,
    bytes_per_s_cap: float | None = None,
) -> TierSpeed:
    """The disk tier's speed: `num_blocks` copies of `block` written by a `DiskBlockStore`
    into a scratch folder under `directory` (removed after), read back into host memory with
    the page cache dropped first (`drop_page_cache`, so the disk itself answers): 1 block and
    then all of them, fastest of `repeats`, `latency + bytes / bandwidth` fitted through the
    two. `bytes_per_s_cap` reads through a `BandwidthCap`. On a GPU the copy up to the pool
    comes on top: `disk.then(host)`."""
    if num_blocks < 2 or repeats < 1:
        raise ValueError(f"need num_blocks >= 2 and repeats >= 1, got {num_blocks}, {repeats}")
    keys = block_keys(UNSHARED_ROOT, list(range(num_blocks)), 1)  # any distinct keys
    with tempfile.TemporaryDirectory(prefix="minserve-disk-speed-", dir=directory) as scratch:
        store = DiskBlockStore(scratch, capacity_bytes=4 * num_blocks * (block.nbytes + 4096))
        for key in keys:
            store.put(key, block)
        store.close()  # every block on disk
        reader = store if bytes_per_s_cap is None else BandwidthCap(store, bytes_per_s_cap)
        times = [_fastest_cold_read(reader, keys[:n], repeats) for n in (1, num_blocks)]
    return _fit("disk", (block.nbytes, num_blocks * block.nbytes), times)


def _fastest_copy_in(pool: PagedKVPool, blocks: list[int], repeats: int) -> float:
    """The fastest of `repeats` copies of `blocks` from host memory into the pool."""
    data = pool.read_blocks(blocks)  # [layers, 2, len(blocks), bs, Hkv, row], pinned on a GPU
    pool.write_blocks(blocks, data)  # unmeasured: the first copy sets things up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        pool.write_blocks(blocks, data)
        if pool.device.type == "cuda":
            torch.cuda.synchronize(pool.device)  # the copy was only queued
        best = min(best, time.perf_counter() - start)
    return best


def _fastest_cold_read(
    store: DiskBlockStore | BandwidthCap, keys: list[BlockKey], repeats: int
) -> float:
    """The fastest of `repeats` reads of `keys`, each from the disk (page cache dropped)."""
    best = math.inf
    for _ in range(repeats):
        for key in keys:
            store.drop_page_cache(key)
        start = time.perf_counter()
        if any(store.get(key) is None for key in keys):
            raise RuntimeError(f"a block written to {store.directory} could not be read back")
        best = min(best, time.perf_counter() - start)
    return best


def _fit(name: str, nbytes: tuple[int, int], seconds: Sequence[float]) -> TierSpeed:
    """`latency + bytes / bandwidth` through a small and a large timed load; when noise made
    the large one no slower, the large one alone gives the bandwidth."""
    (small, large), (t_small, t_large) = nbytes, seconds
    bandwidth = (large - small) / (t_large - t_small) if t_large > t_small else large / t_large
    return TierSpeed(name, max(t_small - small / bandwidth, 0.0), bandwidth)


# --- making a tier slower, for experiments ---


class BandwidthCap:
    """A `DiskBlockStore` whose reads deliver at most `bytes_per_s` in all: a slower disk, or
    a remote tier, on any machine. The reads share the cap, however many threads make them
    (one link): each reserves its bytes' time after the reads before it and sleeps until
    then; everything else is the wrapped store's."""

    def __init__(self, store: DiskBlockStore, bytes_per_s: float) -> None:
        if not 0 < bytes_per_s < math.inf:
            raise ValueError(f"a bandwidth cap must be finite and > 0 B/s, got {bytes_per_s}")
        self.store = store
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link has delivered every read reserved so far

    def get(self, key: BlockKey) -> torch.Tensor | None:
        """The store's `get`, delivered no sooner than the cap allows after earlier reads."""
        block = self.store.get(key)
        if block is not None:
            with self._lock:
                self._free_at = max(self._free_at, time.perf_counter())
                self._free_at += block.nbytes / self.bytes_per_s
                done = self._free_at
            time.sleep(max(0.0, done - time.perf_counter()))
        return block

    def __contains__(self, key: BlockKey) -> bool:
        return key in self.store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)
