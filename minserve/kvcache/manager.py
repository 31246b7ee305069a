"""The scheduler's view of the state plane: allocator + block tables + optional host swap
space + optional radix prefix cache (and its host tier).

The scheduler talks only to this object: can a sequence grow by n tokens, grow it, fork
it, free it, swap it out and back in. With a prefix cache, a new sequence starts from the
cached blocks of its prompt's longest cached prefix, computed blocks are cached as they
fill, and a shortage of free blocks is met by evicting cached blocks nobody holds before
the scheduler has to preempt.

It never touches KV memory. Every copy it decides (copy-on-write after a fork, swap out
and in, host-tier demotions and promotions) is queued as a block operation, in the order
decided; the scheduler hands the queue to the worker with the step (`take_block_ops`).
"""

from __future__ import annotations

import math

from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.block_events import BlockEventTracker
from minserve.kvcache.block_table import BlockTable
from minserve.kvcache.disk_tier import DiskTier
from minserve.kvcache.host_tier import HostPrefixTier
from minserve.kvcache.prefix_caching import PrefixCaching
from minserve.kvcache.radix_cache import RadixCache
from minserve.kvcache.swap import HostSwapSpace
from minserve.messages import BlockOp, CopyBlocks


class KVCacheManager:
    """Blocks for sequences: allocation, sharing, copy-on-write and swapping."""

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        swap: HostSwapSpace | None = None,
        prefix_cache: RadixCache | None = None,
        host_tier: HostPrefixTier | None = None,
        table_cls: type = BlockTable,  # a class shaped like BlockTable (chapter 01)
        events: BlockEventTracker | None = None,  # block keys and KV events
        disk: DiskTier | None = None,  # beneath the host tier (needs `events`)
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self.table_cls = table_cls
        self.swap = swap
        self.prefix_cache = prefix_cache
        self._ops: list[BlockOp] = []  # decided, not yet handed to the worker
        self.prefix = (
            PrefixCaching(prefix_cache, allocator, host_tier, self._ops, events, disk)
            if prefix_cache
            else None
        )
        self._swapped_tokens: dict[int, int] = {}

    def take_block_ops(self) -> tuple[BlockOp, ...]:
        """The block operations decided since the last call, in order (for the worker)."""
        ops = tuple(self._ops)
        self._ops.clear()
        return ops

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use (cached blocks nobody holds count as free)."""
        return 1 - self._num_available / self.allocator.num_blocks

    @property
    def _num_available(self) -> int:
        """Free blocks, plus the cached blocks eviction could free."""
        return self.allocator.num_free + (self.prefix.num_evictable_blocks if self.prefix else 0)

    def new_table(self) -> BlockTable:
        return self.table_cls(self.block_size)

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        return table.blocks_needed(num_new_tokens) <= self._num_available

    def append(self, table: BlockTable, num_new_tokens: int) -> None:
        """Assign slots for the next tokens; copy shared partly-filled blocks first."""
        if self.prefix is not None:
            self.prefix.make_room(table.blocks_needed(num_new_tokens))
        first = table.num_tokens
        _, copies = table.append(self.allocator, num_new_tokens)
        self._ops += [CopyBlocks(src, dst) for src, dst in copies]
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

    def step_ran(self) -> None:
        """A step's forward ran: the blocks cached so far hold their KV (disk write-through)."""
        if self.prefix is not None:
            self.prefix.step_ran()

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Keep the slots of the first `num_tokens` tokens; free the blocks past them
        (speculative decoding: the slots of rejected drafts)."""
        table.truncate(self.allocator, num_tokens)

    def swap_room(self) -> tuple[int, int]:
        """(bytes per block, free bytes) of the host swap space; (0, 0) without one."""
        if self.swap is None:
            return 0, 0
        return self.swap.block_nbytes, self.swap.capacity_bytes - self.swap.used_bytes

    def swap_out(self, key: int, table: BlockTable) -> None:
        """The blocks go to host memory (a block operation) and back to the allocator."""
        assert self.swap is not None
        self._ops.append(self.swap.swap_out(key, table.blocks))
        self._swapped_tokens[key] = table.num_tokens
        self.free(table)

    def can_swap_in(self, key: int, headroom: int = 0) -> bool:
        blocks = math.ceil(self._swapped_tokens[key] / self.block_size)
        return blocks + headroom <= self._num_available

    def swap_in(self, key: int, table: BlockTable) -> None:
        """Allocate fresh blocks for the swapped tokens; the host copy comes back into them."""
        assert self.swap is not None
        self.append(table, self._swapped_tokens.pop(key))
        self._ops.append(self.swap.swap_in(key, table.blocks))

    def discard_swapped(self, key: int) -> None:
        if self.swap is not None and key in self._swapped_tokens:
            del self._swapped_tokens[key]
            self._ops.append(self.swap.discard(key))
