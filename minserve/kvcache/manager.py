"""The engine's view of the state plane: allocator + paged pool + optional host swap space
+ optional radix prefix cache.

The scheduler talks only to this object: can a sequence grow by n tokens, grow it (with
copy-on-write applied to the pool at once), fork it, free it, swap it out and back in.
With a prefix cache, a new sequence starts from the cached blocks of its prompt's longest
cached prefix, computed blocks are cached as they fill, and a shortage of free blocks is
met by evicting cached blocks nobody holds before the scheduler has to preempt.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.block_table import BlockTable
from minserve.kvcache.host_tier import HostPrefixTier
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.kvcache.prefix_caching import PrefixCaching
from minserve.kvcache.radix_cache import RadixCache
from minserve.kvcache.swap import HostSwapSpace


class KVCacheManager:
    """Blocks for sequences: allocation, sharing, copy-on-write and swapping."""

    def __init__(
        self,
        allocator: BlockAllocator,
        pool: PagedKVPool,
        swap: HostSwapSpace | None = None,
        prefix_cache: RadixCache | None = None,
        host_tier: HostPrefixTier | None = None,
    ) -> None:
        self.allocator = allocator
        self.pool = pool
        self.swap = swap
        self.prefix_cache = prefix_cache
        self.prefix = PrefixCaching(prefix_cache, allocator, host_tier) if prefix_cache else None
        self._swapped_tokens: dict[Hashable, int] = {}

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use (cached blocks nobody holds count as free)."""
        return 1 - self._num_available / self.allocator.num_blocks

    @property
    def _num_available(self) -> int:
        """Free blocks, plus the cached blocks eviction could free."""
        return self.allocator.num_free + (self.prefix.num_evictable_blocks if self.prefix else 0)

    def new_table(self) -> BlockTable:
        return BlockTable(self.block_size)

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        return table.blocks_needed(num_new_tokens) <= self._num_available

    def append(self, table: BlockTable, num_new_tokens: int) -> None:
        """Assign slots for the next tokens; copy shared partly-filled blocks first."""
        if self.prefix is not None:
            self.prefix.make_room(table.blocks_needed(num_new_tokens))
        first = table.num_tokens
        _, copies = table.append(self.allocator, num_new_tokens)
        if copies:
            self.pool.copy_blocks(copies)
        if self.prefix is not None:
            self.prefix.scheduled(table, first)

    def fork(self, table: BlockTable) -> BlockTable:
        child = table.fork(self.allocator)
        if self.prefix is not None:
            self.prefix.fork(table, child)
        return child

    def free(self, table: BlockTable) -> None:
        if self.prefix is not None:
            self.prefix.release(table)
        table.free(self.allocator)

    def reuse_prefix(self, table: BlockTable, token_ids: list[int]) -> int:
        """Start an empty table with its prompt's cached prefix; tokens reused (0: no cache)."""
        if self.prefix is None or table.blocks:
            return 0
        return self.prefix.reuse(table, token_ids)

    def cached_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the prefix cache holds (whole blocks)."""
        return self.prefix.cached_tokens(token_ids) if self.prefix else 0

    def cache_computed(self, table: BlockTable, token_ids: list[int], num_computed: int) -> None:
        """After a step: cache the full blocks among the table's computed tokens."""
        if self.prefix is not None:
            self.prefix.cache_full_blocks(table, token_ids, num_computed)

    def can_swap_out(self, table: BlockTable) -> bool:
        if self.swap is None or not table.blocks:
            return False
        return self.swap.can_swap_out(len(table.blocks), self.pool.block_nbytes)

    def swap_out(self, key: Hashable, table: BlockTable) -> None:
        """Copy the blocks to host memory and give them back to the pool."""
        assert self.swap is not None
        self.swap.swap_out(key, self.pool, table.blocks)
        self._swapped_tokens[key] = table.num_tokens
        self.free(table)

    def can_swap_in(self, key: Hashable, headroom: int = 0) -> bool:
        blocks = math.ceil(self._swapped_tokens[key] / self.block_size)
        return blocks + headroom <= self._num_available

    def swap_in(self, key: Hashable, table: BlockTable) -> None:
        """Allocate fresh blocks for the swapped tokens and copy them back from host memory."""
        assert self.swap is not None
        self.append(table, self._swapped_tokens.pop(key))
        self.swap.swap_in(key, self.pool, table.blocks)

    def discard_swapped(self, key: Hashable) -> None:
        if self.swap is not None and key in self._swapped_tokens:
            del self._swapped_tokens[key]
            self.swap.discard(key)
