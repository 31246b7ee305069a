"""Prefix caching for block tables: the glue between sequences' blocks and the radix tree.

A sequence about to start asks for its prompt's longest cached prefix and begins with
those blocks (shared, locked). Blocks are cached as soon as they are scheduled to be full,
as vLLM does: the step that fills them writes every token's keys and values before any
attention reads them, so a request admitted later in the same step already reuses them.
Blocks that decodes fill are cached after the step. When the pool runs short, cached
blocks no sequence holds are evicted before anyone is preempted; with a host tier they
are demoted to host memory, and a later prompt that continues into them promotes them
(block operations the worker carries out before the step's forward). Beneath the host
tier, a disk tier (`disk_tier.py`) gets every cached block written through once a step has
computed it, and gives back the blocks that continue a match when loading beats
recomputing. Every change is reported to a `BlockEventTracker` (`block_events.py`), which
keys the blocks by content, for the disk tier and for a router's KV events.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.block_events import BlockEventTracker
from minserve.kvcache.block_key import BlockKey
from minserve.kvcache.block_table import BlockTable
from minserve.kvcache.disk_tier import DiskTier
from minserve.kvcache.host_tier import HostPrefixTier
from minserve.kvcache.radix_cache import PrefixMatch, RadixCache, RadixNode
from minserve.messages import BlockOp, DiskLoad

T = TypeVar("T")


@dataclass(frozen=True)
class _HeldPrefix:
    """The cached prefix a block table uses: the node it locks and how many blocks."""

    node: RadixNode
    num_blocks: int


@dataclass
class PrefixCacheStats:
    """What the prefix cache did (`get_metrics()`)."""

    evicted_blocks: int = 0
    promoted_blocks: int = 0  # brought back from the host tier
    disk_loaded_blocks: int = 0  # read back from the disk tier
    # time spent keeping the cache: the radix tree's match, insert, lock and evict, and
    # promotions from the host tier
    upkeep_seconds: float = 0.0


class PrefixCaching:
    """Which block tables use which cached prefix, and the tree's upkeep time."""

    def __init__(
        self,
        cache: RadixCache,
        allocator: BlockAllocator,
        host: HostPrefixTier | None = None,
        ops: list[BlockOp] | None = None,
        events: BlockEventTracker | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        if disk is not None and events is None:
            raise ValueError("a disk tier names blocks by their keys: give the block tracker")
        self.cache = cache
        self.allocator = allocator
        self.host = host  # chapter 05's exercise 5.3: demotes evicted blocks, promotes them
        self.ops = ops if ops is not None else []  # host-tier copies for the worker, in order
        self.events = events  # KV events: what each tier holds, for a router
        self.disk = disk
        self._unwritten: list[tuple[int, BlockKey]] = []  # cached, computed after this step
        self.block_size = cache.block_size
        self.stats = PrefixCacheStats()
        self._timing = False  # inside a timed call: a nested one is counted already
        self._held: dict[BlockTable, _HeldPrefix] = {}  # tables using cached blocks
        self._tokens: dict[BlockTable, list[int]] = {}  # tokens of tables that started here

    @property
    def num_evictable_blocks(self) -> int:
        return self.cache.num_evictable_blocks

    def held_node(self, table: BlockTable) -> RadixNode | None:
        """The node whose prefix `table` holds locked (None: it holds no cached blocks)."""
        held = self._held.get(table)
        return held.node if held else None

    def reuse(self, table: BlockTable, token_ids: list[int]) -> int:
        """Start an empty table with the cached blocks of `token_ids`' longest cached prefix.

        At most all tokens but the last are reused, so that one is computed and gives the
        logits to sample from. Returns the number of tokens reused.
        """
        self._tokens[table] = token_ids
        usable = (len(token_ids) - 1) // self.block_size * self.block_size
        match = self._timed(self.cache.match_prefix, token_ids[:usable])
        if self.host is not None:
            match = self._promote(token_ids[:usable], match)
        if self.disk is not None:
            match = self._timed(self._load_from_disk, token_ids[:usable], match, len(token_ids))
        if not match.blocks:
            return 0
        self._timed(self.cache.lock, match.node)
        table.adopt_prefix(self.allocator, match.blocks)
        self._held[table] = _HeldPrefix(match.node, match.num_blocks)
        return table.num_tokens

    def cached_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the cache holds (whole blocks)."""
        return self._timed(self.cache.match_prefix, token_ids).num_blocks * self.block_size

    def scheduled(self, table: BlockTable, first: int) -> None:
        """The table just got slots for its tokens from position `first` on: cache the blocks
        they fill (this step writes them before any attention reads them)."""
        tokens = self._tokens.get(table)
        if tokens is not None:
            end = min(table.num_tokens, len(tokens))
            self.cache_full_blocks(table, tokens, end, computed=first)

    def cache_full_blocks(
        self, table: BlockTable, token_ids: list[int], num_tokens: int, computed: int | None = None
    ) -> None:
        """Insert the table's full blocks among its first `num_tokens` tokens, and hold them.

        Blocks the cache already had (another request computed the same tokens) are
        swapped for the cached ones, so the duplicates go back to the pool; but only among
        the first `computed` tokens (default: all): a block this step is about to write
        stays the table's own, never a block that others read.
        """
        full = num_tokens // self.block_size
        held = self._held.get(table)
        if full <= (held.num_blocks if held else 0):
            return
        tokens = token_ids[: full * self.block_size]
        match = self._timed(self.cache.insert, tokens, table.blocks[:full])
        if self.host is not None:  # to demote them under their keys later
            self.host.remember(tokens, match.blocks)
        self._keyed(tokens, match.blocks)
        written = full if computed is None else computed // self.block_size
        table.adopt_prefix(self.allocator, match.blocks[:written])
        self._timed(self.cache.lock, match.node)
        self._unlock(table)
        self._held[table] = _HeldPrefix(match.node, full)

    def fork(self, parent: BlockTable, child: BlockTable) -> None:
        """The child shares the parent's blocks, so it holds the same cached prefix."""
        held = self._held.get(parent)
        if held is not None:
            self._timed(self.cache.lock, held.node)
            self._held[child] = held

    def release(self, table: BlockTable) -> None:
        """The table no longer uses its cached prefix: unlock it (the blocks stay cached)."""
        self._tokens.pop(table, None)
        self._unlock(table)

    def _unlock(self, table: BlockTable) -> None:
        held = self._held.pop(table, None)
        if held is not None:
            self._timed(self.cache.unlock, held.node)

    def make_room(self, num_blocks: int) -> None:
        """Evict unheld cached blocks until `num_blocks` blocks are free (when possible)."""
        short = num_blocks - self.allocator.num_free
        if short > 0:
            self.stats.evicted_blocks += self._timed(self.cache.evict, short)
            evicted = self.events.evicted(self.allocator) if self.events is not None else []
            self._demote_evicted(evicted)

    # --- the host tier ---

    def _demote_evicted(self, evicted: list[BlockKey]) -> None:
        """Blocks just evicted (keyed `evicted` when events are on) are free but still hold
        their KV: copy them to the host."""
        if self.host is not None:
            self.ops += self.host.demote_evicted(self.allocator)
            if self.events is not None:
                self.events.host_changed(self.host, evicted)

    def _promote(self, token_ids: list[int], match: PrefixMatch) -> PrefixMatch:
        """Extend a device match with the blocks that follow it on the host, copied back
        into fresh device blocks and cached again, while copying beats recomputing."""
        assert self.host is not None
        args = (match, token_ids, self.cache, self.allocator, self.make_room, self.ops)
        extended = self._timed(self.host.extend, *args)
        self.stats.promoted_blocks += extended.num_blocks - match.num_blocks
        if self.events is not None and extended is not match:  # promoted: host -> device
            self._keyed(token_ids[: extended.num_blocks * self.block_size], extended.blocks)
            self.events.host_changed(self.host, [])
        return extended

    # --- block keys and the disk tier ---

    def _keyed(self, tokens: list[int], blocks: list[int]) -> None:
        """The tree holds `blocks` (the KV of `tokens`): key the new ones; with a disk tier,
        write them through once the step that computes them has run (`step_ran`)."""
        if self.events is not None:
            keyed = self.events.stored(tokens, blocks)
            if self.disk is not None:
                self._unwritten += keyed

    def step_ran(self) -> None:
        """The step computed every block cached so far: queue their disk writes, first in
        the next step's block operations (before anything reuses those blocks)."""
        if self.disk is None or self.events is None:
            return
        keyed = [(b, k) for b, k in self._unwritten if self.events.key_of(b) == k]
        self._unwritten = []
        writes = self.disk.write_through(keyed)
        self.ops += writes
        self.events.disk_changed([w.key for w in writes], self.disk.store.take_evicted())

    def _load_from_disk(
        self, token_ids: list[int], match: PrefixMatch, num_tokens: int
    ) -> PrefixMatch:
        """Extend a match with the blocks that follow it on disk, read back into fresh
        device blocks and cached again, as many as the load-or-recompute rule says.

        Only when the pool has room for the whole sequence (`num_tokens`, past the match):
        a sequence that is then not admitted would leave its loaded blocks unheld, to be
        evicted again before its next try (under preemption, every step read the same
        blocks back)."""
        assert self.disk is not None and self.events is not None
        size = self.block_size
        parent = self.events.key_of(match.blocks[-1]) if match.blocks else self.events.root
        if parent is None:  # a matched block the tracker has not keyed: cannot name the rest
            return match
        self.cache.lock(match.node)  # held while room is made: the match stays cached
        needed = -(-num_tokens // size) - match.num_blocks
        if needed > self.allocator.num_free + self.cache.num_evictable_blocks:
            self.cache.unlock(match.node)
            return match
        keys = self.events.chain(parent, token_ids[match.num_blocks * size :])
        count = self.disk.num_to_load(keys, len(token_ids) // size - match.num_blocks)
        loaded: list[int] = []
        for data in self.disk.read(keys[:count]) if count else []:
            self.make_room(1)
            if not self.allocator.can_allocate(1):
                break
            loaded.append(self.allocator.allocate())
            self.ops.append(DiskLoad(loaded[-1], data))
        self.cache.unlock(match.node)
        if not loaded:
            return match
        tokens = token_ids[: (match.num_blocks + len(loaded)) * size]
        extended = self.cache.insert(tokens, match.blocks + loaded)
        if self.host is not None:
            self.host.remember(tokens, extended.blocks)
        self._keyed(tokens, extended.blocks)
        for block in loaded:  # the tree holds them now
            self.allocator.free(block)
        self.stats.disk_loaded_blocks += len(loaded)
        return extended

    def _timed(self, method: Callable[..., T], *args: object) -> T:
        """Call a method of the radix tree (or the host tier's promotion, which calls the
        tree and makes room), adding its time to the upkeep counter once."""
        if self._timing:  # nested: the outer call's time includes it
            return method(*args)
        self._timing = True
        start = time.perf_counter()
        try:
            return method(*args)
        finally:
            self.stats.upkeep_seconds += time.perf_counter() - start
            self._timing = False
