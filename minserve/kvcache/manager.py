"""The engine's view of the state plane: allocator + paged pool + optional host swap space.

The scheduler talks only to this object: can a sequence grow by n tokens, grow it (with
copy-on-write applied to the pool at once), fork it, free it, swap it out and back in.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.block_table import BlockTable
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.kvcache.swap import HostSwapSpace


class KVCacheManager:
    """Blocks for sequences: allocation, sharing, copy-on-write and swapping."""

    def __init__(
        self, allocator: BlockAllocator, pool: PagedKVPool, swap: HostSwapSpace | None = None
    ) -> None:
        self.allocator = allocator
        self.pool = pool
        self.swap = swap
        self._swapped_tokens: dict[Hashable, int] = {}

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks in use."""
        return 1 - self.allocator.num_free / self.allocator.num_blocks

    def new_table(self) -> BlockTable:
        return BlockTable(self.block_size)

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        return self.allocator.can_allocate(table.blocks_needed(num_new_tokens))

    def append(self, table: BlockTable, num_new_tokens: int) -> None:
        """Assign slots for the next tokens; copy shared partly-filled blocks first."""
        _, copies = table.append(self.allocator, num_new_tokens)
        if copies:
            self.pool.copy_blocks(copies)

    def fork(self, table: BlockTable) -> BlockTable:
        return table.fork(self.allocator)

    def free(self, table: BlockTable) -> None:
        table.free(self.allocator)

    def can_swap_out(self, table: BlockTable) -> bool:
        if self.swap is None or not table.blocks:
            return False
        return self.swap.can_swap_out(len(table.blocks), self.pool.block_nbytes)

    def swap_out(self, key: Hashable, table: BlockTable) -> None:
        """Copy the blocks to host memory and give them back to the pool."""
        assert self.swap is not None
        self.swap.swap_out(key, self.pool, table.blocks)
        self._swapped_tokens[key] = table.num_tokens
        table.free(self.allocator)

    def can_swap_in(self, key: Hashable, headroom: int = 0) -> bool:
        blocks = math.ceil(self._swapped_tokens[key] / self.block_size)
        return self.allocator.can_allocate(blocks + headroom)

    def swap_in(self, key: Hashable, table: BlockTable) -> None:
        """Allocate fresh blocks for the swapped tokens and copy them back from host memory."""
        assert self.swap is not None
        table.append(self.allocator, self._swapped_tokens.pop(key))
        self.swap.swap_in(key, self.pool, table.blocks)

    def discard_swapped(self, key: Hashable) -> None:
        if self.swap is not None and key in self._swapped_tokens:
            del self._swapped_tokens[key]
            self.swap.discard(key)
