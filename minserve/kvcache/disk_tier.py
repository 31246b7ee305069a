"""The disk tier beneath the host tier: the scheduler's side.

Every block the prefix cache holds is written through to disk once a step has computed it
(`DiskWrite`, carried out by the worker, whose store writes in a background thread), so
the disk holds every prefix this engine computed: after the device and host tiers have
evicted it, after a restart on the same directory, and for another instance sharing the
directory. A prompt whose cached prefix continues into blocks on disk gets them read back
(`DiskLoad`) when the load-or-recompute rule (`load_plan.plan_load`, with the disk's
measured latency and bandwidth) says loading is faster.

The store (`disk_store.py`) is the account: a key is on disk when its file is there (or
queued for writing), whoever wrote it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from minserve.kvcache.block_key import BlockKey
from minserve.kvcache.disk_store import DiskBlockStore
from minserve.kvcache.load_plan import LoadPlan, TierSpeed, plan_load
from minserve.messages import DiskWrite

READERS = 4  # reads in flight at once
MIN_PREFILL_TOKENS = 128  # a step with fewer tokens says little about the prefill speed


@dataclass
class DiskTierStats:
    """What the disk tier did (`get_metrics()`: disk_tier_*)."""

    blocks_written: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0  # reading blocks for requests (on their critical path)


class DiskTier:
    """Which blocks to write through and which to load back, and what that cost."""

    def __init__(
        self,
        store: DiskBlockStore,
        block_size: int,
        block_nbytes: int,
        speed: TierSpeed,
        prefill_tokens_per_s: float,
        plan: Callable[..., LoadPlan] = plan_load,  # the rule (chapter 11's, say)
    ) -> None:
        self.store = store
        self.plan = plan
        self.block_size, self.block_nbytes = block_size, block_nbytes
        self.speed = speed  # measured at start: latency per request, bandwidth
        self.prefill_tokens_per_s = prefill_tokens_per_s  # a roofline guess, until measured
        self._prefill_seen = False
        self.stats = DiskTierStats()
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="kv-disk-read")

    def write_through(self, keyed: list[tuple[int, BlockKey]]) -> list[DiskWrite]:
        """Writes for the computed blocks whose keys the disk does not hold yet."""
        writes = [DiskWrite(block, key) for block, key in keyed if key not in self.store]
        self.stats.blocks_written += len(writes)
        return writes

    def observe_step(self, num_tokens: int, forward_s: float) -> None:
        """A step that ran `num_tokens` tokens (mostly a prompt's) in `forward_s` seconds: the
        prefill speed the rule prices recomputing with, as this engine really computes (a
        moving average; the first one replaces the roofline guess)."""
        if num_tokens < MIN_PREFILL_TOKENS or forward_s <= 0:
            return
        speed = num_tokens / forward_s
        old = self.prefill_tokens_per_s if self._prefill_seen else speed
        self.prefill_tokens_per_s = 0.8 * old + 0.2 * speed
        self._prefill_seen = True

    def num_to_load(self, keys: list[BlockKey], num_blocks: int) -> int:
        """How many of `keys` (the blocks after a prompt's cached prefix, in order) to load
        from disk, of the prompt's `num_blocks` uncached blocks: the leading run on disk,
        cut where loading stops paying (`plan_load`)."""
        on_disk = 0
        while on_disk < len(keys) and keys[on_disk] in self.store:
            on_disk += 1
        if on_disk == 0:
            return 0
        plan = self.plan(num_blocks, ["disk"] * on_disk, self.block_nbytes, self.block_size,
                         self.prefill_tokens_per_s, [self.speed])  # fmt: skip
        return plan.num_load

    def read(self, keys: list[BlockKey]) -> list[torch.Tensor]:
        """The blocks' KV from disk, in order, read by `READERS` threads at once (a disk
        answers several reads faster than one after another); the list stops before the
        first block gone or corrupt since it was seen (recompute from there)."""
        start = time.perf_counter()
        blocks = []
        for data in self._readers.map(self.store.get, keys):
            if data is None:
                break
            blocks.append(data)
        self.stats.load_seconds += time.perf_counter() - start
        self.stats.blocks_loaded += len(blocks)
        self.stats.bytes_loaded += sum(b.numel() * b.element_size() for b in blocks)
        return blocks
