# Your workspace for chapter 01 (KV cache and the block allocator): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 01` from the repository root.
# Generated from minserve/kvcache/block_allocator.py, minserve/kvcache/block_table.py, minserve/kvcache/paged_pool.py by `python -m minserve.course.generate`.
# stub fingerprint: 71aeb55f6538 (lets the generator tell your edits from a stale stub)
"""Chapter 01, KV cache and the block allocator: free list, reference counts,
block tables and the paged pool.

The paged KV pool is cut into blocks; `BlockAllocator` hands out block ids and
counts who holds each one; a sequence's `BlockTable` maps its logical blocks to
physical ones, shares them on fork and copies a shared last block before writing
into it; `PagedKVPool` is the memory itself: sized in blocks from a byte budget,
one tensor for every layer's K and V, and block copies by index. Plug your
classes into the engine with `LLM(plugins=CoursePlugins(
block_allocator_cls=BlockAllocator, block_table_cls=BlockTable,
kv_pool_cls=PagedKVPool))`.
"""

from __future__ import annotations

from collections import deque

import torch

from minserve.config import DEFAULT_KV_CACHE_BYTES, CacheConfig
from minserve.kvcache import NoFreeBlocksError
from minserve.kvcache.kv_format import KVFormat
from minserve.kvcache.paged_pool import as_format, holds_no_block
from minserve.model_config import ModelConfig


# Exercise 1.1: the block allocator (allocate and free)
class BlockAllocator:
    """vLLM-style block allocator: a free list plus a reference count per block.

    Block ids are 0 .. num_blocks - 1. A block is on the free list exactly when its
    reference count is zero. `allocate` and `free` are O(1): the free list is a deque,
    allocated from the left and refilled on the right, so the most recently freed block
    is reused last.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block allocator needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # ids whose refcount is 0
        self._refcounts: list[int] = [0] * num_blocks  # one count per block id

    @property
    def num_free(self) -> int:
        """How many blocks are on the free list."""
        return len(self._free)

    def can_allocate(self, count: int) -> bool:
        """Whether `count` more blocks can be allocated right now."""
        return count <= len(self._free)

    def allocate(self) -> int:
        """Take a block off the free list and give it a reference count of 1.

        Raises `NoFreeBlocksError` (with a message saying how many blocks there are) when
        the free list is empty. Must be O(1): pop from the deque `self._free`, set the
        block's entry of `self._refcounts`, return the block id.
        """
        raise NotImplementedError("Exercise 1.1: the block allocator (allocate and free)")

    def share(self, block: int) -> None:
        """One more user of an allocated block (a fork, or a prefix-cache hit)."""
        self._check_id(block)
        if self._refcounts[block] == 0:
            raise ValueError(f"cannot share block {block}: it is free (allocate it first)")
        self._refcounts[block] += 1

    def free(self, block: int) -> None:
        """One user fewer: decrement the block's count, and at zero put it back on the free list.

        Freeing a block whose count is already zero is a double free: raise `ValueError`
        naming the block, and change nothing. Must be O(1).
        """
        self._check_id(block)
        raise NotImplementedError("Exercise 1.1: the block allocator (allocate and free)")

    def refcount(self, block: int) -> int:
        """How many users hold this block (0 when it is free)."""
        self._check_id(block)
        return self._refcounts[block]

    def _check_id(self, block: int) -> None:
        """Reject ids outside the pool (a negative id would silently index from the end)."""
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"unknown block id {block}; ids run from 0 to {self.num_blocks - 1}")


# Exercise 1.2: the block table (append with copy-on-write, fork, slot)
class BlockTable:
    """One sequence's logical->physical block map (PagedAttention's block table).

    `blocks[i]` is the physical block of logical block i; `num_tokens` tokens have slots.
    You write `blocks_needed` (how many blocks the next tokens take), `append` (slots for
    new tokens, with copy-on-write of a shared last block), `_copy_on_write`, `fork` (share
    every block) and `slot` (position -> pool slot); the rest is given. Plug it into the
    engine with `LLM(block_table_cls=BlockTable)`.
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.blocks: list[int] = []  # physical block of logical block i
        self.num_tokens = 0  # tokens whose slots are assigned
        # The allocator the blocks come from, remembered by append and fork so that
        # `blocks_needed` can ask whether the last block is shared.
        self._allocator: BlockAllocator | None = None

    @property
    def _tail_partly_filled(self) -> bool:
        return self.num_tokens % self.block_size != 0

    def blocks_needed(self, num_new_tokens: int) -> int:
        """New blocks `append(allocator, num_new_tokens)` would allocate, exactly.

        The scheduler asks this before every step (can this sequence grow?), so it must
        match what `append` takes: the tokens that do not fit in the last block's free
        slots need whole fresh blocks (rounded up), and one more block is counted for the
        copy-on-write of a shared, partly-filled last block (`_needs_copy_on_write`).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_new_tokens == 0:
            return 0
        raise NotImplementedError("Exercise 1.2: the block table (append with copy-on-write, fork, slot)")

    def _needs_copy_on_write(self) -> bool:
        if not self._tail_partly_filled:
            return False  # a full (or no) last block is never written again
        assert self._allocator is not None  # set when the first block was allocated
        return self._allocator.refcount(self.blocks[-1]) > 1

    def _use(self, allocator: BlockAllocator) -> None:
        """Remember `allocator`; a table's blocks must all come from one allocator."""
        if self.blocks and allocator is not self._allocator:
            raise ValueError(
                "this block table's blocks come from another allocator; "
                "use the same allocator for every call on one table"
            )
        self._allocator = allocator

    def append(
        self, allocator: BlockAllocator, num_new_tokens: int
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Assign slots to the next `num_new_tokens` tokens, allocating blocks as needed.

        Returns (slots, copies): one slot per new token, and the (src, dst) block pairs the
        KV pool must copy before the step writes (copy-on-write of a shared last block).
        Atomic: raises `NoFreeBlocksError` and changes nothing if blocks run short.
        """
        self._use(allocator)
        needed = self.blocks_needed(num_new_tokens)
        if not allocator.can_allocate(needed):
            raise NoFreeBlocksError(
                f"appending {num_new_tokens} tokens needs {needed} new blocks, "
                f"but only {allocator.num_free} are free"
            )
        if num_new_tokens == 0:
            return [], []
        raise NotImplementedError("Exercise 1.2: the block table (append with copy-on-write, fork, slot)")

    def _copy_on_write(self, allocator: BlockAllocator) -> tuple[int, int]:
        """Swap the shared last block for a private copy; the pool copies src -> dst."""
        raise NotImplementedError("Exercise 1.2: the block table (append with copy-on-write, fork, slot)")

    def fork(self, allocator: BlockAllocator) -> BlockTable:
        """A copy of this table sharing every block (parallel sampling, beam search)."""
        self._use(allocator)
        raise NotImplementedError("Exercise 1.2: the block table (append with copy-on-write, fork, slot)")

    def adopt_prefix(self, allocator: BlockAllocator, blocks: list[int]) -> None:
        """Make `blocks`, full blocks holding the KV of this table's first tokens, its first
        blocks (a prefix-cache hit on an empty table, or the cached twins of blocks it computed)."""
        self._use(allocator)
        if self.blocks and len(blocks) > len(self.blocks):
            raise ValueError(
                f"cannot adopt {len(blocks)} cached blocks into a table of {len(self.blocks)}"
            )
        for i, block in enumerate(blocks):
            allocator.share(block)  # before freeing ours: they may be the same block
            if i < len(self.blocks):
                allocator.free(self.blocks[i])
                self.blocks[i] = block
            else:
                self.blocks.append(block)
        self.num_tokens = max(self.num_tokens, len(blocks) * self.block_size)

    def free(self, allocator: BlockAllocator) -> None:
        """Release every block and empty the table."""
        self._use(allocator)
        # Last block first: the free list reuses blocks in the order they were freed, so a
        # sequence's first blocks (a prompt others may share) stay untouched the longest.
        for block in reversed(self.blocks):
            allocator.free(block)
        self.blocks = []
        self.num_tokens = 0
        self._allocator = None

    def truncate(self, allocator: BlockAllocator, num_tokens: int) -> None:
        """Keep the slots of the first `num_tokens` tokens; free the blocks past them.

        Speculative decoding rolls back the slots of rejected drafts this way: their K/V in
        the kept last block is overwritten by the next step; blocks holding only rejected
        positions go back to the allocator at once, so none leak.
        """
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate a table of {self.num_tokens} tokens to {num_tokens}")
        keep = -(-num_tokens // self.block_size)  # ceil division
        for block in reversed(self.blocks[keep:]):  # allocated this step: never shared
            allocator.free(block)
        del self.blocks[keep:]
        self.num_tokens = num_tokens

    def slot(self, position: int) -> int:
        """The pool slot holding token `position`'s KV: block * block_size + offset."""
        if not 0 <= position < self.num_tokens:
            raise IndexError(
                f"position {position} has no slot; this table holds {self.num_tokens} tokens"
            )
        raise NotImplementedError("Exercise 1.2: the block table (append with copy-on-write, fork, slot)")


# Exercise 1.3: the paged KV pool (its size in blocks, its tensor, block copies)
class PagedKVPool:
    """The paged KV pool: per layer K and V shaped [num_blocks, block_size, num_kv_heads, row].

    All layers live in one tensor [num_layers, 2 (K, V), num_blocks, block_size, Hkv, row],
    so a block's whole KV (every layer) moves with one indexing operation. `row` is head_dim
    values in the format's storage dtype (int8: head_dim + 2 bytes, see `kv_format.py`).

    You write the pool's size (`bytes_per_block`: what one block costs; `num_blocks_for`:
    how many blocks a byte budget holds), its memory (the tensor `self.kv`, in `__init__`,
    with each layer's K and V views in `self._layers`) and the block moves the engine asks
    of it (`copy_blocks` for copy-on-write, `gather_blocks` and the store of `write_blocks`
    for swapping, through `_index`). Plug it into the engine with
    `LLM(plugins=CoursePlugins(kv_pool_cls=PagedKVPool))`.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | KVFormat,
        device: torch.device | str,
    ) -> None:
        """Allocate the whole pool up front: `self.kv`, zeros of the format's storage dtype
        on `device`, shaped as the class says; then `self._layers[i]`, layer i's (K, V)
        views of it (`kv[i, 0]` and `kv[i, 1]`: views, so the model's writes land in `kv`)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be at least 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.format = as_format(dtype)
        self.dtype = self.format.storage_dtype  # what the pool tensor holds
        self.device = torch.device(device)
        self.block_nbytes = self.bytes_per_block(model_config, block_size, self.format)
        raise NotImplementedError("Exercise 1.3: the paged KV pool (its size in blocks, its tensor, block copies)")

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s keys, [num_blocks, block_size, Hkv, D]; a view, writes go to the pool."""
        return self._layers[layer][0]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s values, [num_blocks, block_size, Hkv, D]; a view into the pool."""
        return self._layers[layer][1]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy block src to block dst in every layer, K and V (copy-on-write after a fork).

        One indexing operation for all the (src, dst) pairs, whatever their number (none:
        nothing to do); every src is read before any dst is written.
        """
        raise NotImplementedError("Exercise 1.3: the paged KV pool (its size in blocks, its tensor, block copies)")

    def gather_blocks(self, blocks: list[int]) -> torch.Tensor:
        """A copy of these blocks' KV in every layer, on the pool's device (for sending).

        Shape [num_layers, 2, len(blocks), block_size, Hkv, row], in the stored format.
        """
        raise NotImplementedError("Exercise 1.3: the paged KV pool (its size in blocks, its tensor, block copies)")

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """`gather_blocks` as a host tensor (for swapping out); pinned on a GPU, so that
        copying it back can overlap other work (`write_blocks`)."""
        data = self.gather_blocks(blocks)
        if self.device.type == "cpu":
            return data  # the gather made a copy already
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        host.copy_(data, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()  # the host reads it next
        return host

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """The inverse of `read_blocks`: put `data` into these blocks (for swapping in),
        moved to the pool's device and dtype (without blocking: from pinned memory the copy
        runs on the stream, ahead of the kernels that read it)."""
        expected = self.kv.shape[:2] + (len(blocks),) + self.kv.shape[3:]
        if data.shape != expected:
            raise ValueError(
                f"data for {len(blocks)} blocks must be shaped {tuple(expected)}, "
                f"got {tuple(data.shape)}"
            )
        if self.format.quantized and data.dtype != self.dtype:
            raise ValueError(
                f"data for a {self.format.name} pool must hold its stored bytes ({self.dtype}), "
                f"got {data.dtype}"
            )
        raise NotImplementedError("Exercise 1.3: the paged KV pool (its size in blocks, its tensor, block copies)")

    @property
    def nbytes(self) -> int:
        """Bytes the pool occupies (every layer, K and V)."""
        return self.kv.numel() * self.kv.element_size()

    @staticmethod
    def bytes_per_block(
        model_config: ModelConfig, block_size: int, dtype: torch.dtype | KVFormat
    ) -> int:
        """Bytes of one block in every layer: layers x (K, V) x block_size x Hkv x bytes per
        token and head (head_dim x itemsize, or the format's row: `bytes_per_token_head`)."""
        raise NotImplementedError("Exercise 1.3: the paged KV pool (its size in blocks, its tensor, block copies)")

    @classmethod
    def num_blocks_for(
        cls, cache_config: CacheConfig, model_config: ModelConfig, dtype: torch.dtype | KVFormat
    ) -> int:
        """`cache_config.num_blocks` if set, else as many whole blocks as the byte budget
        holds: `kv_cache_memory_bytes`, or `DEFAULT_KV_CACHE_BYTES` when that is None. A
        budget too small for one block raises the ValueError `holds_no_block` makes."""
        raise NotImplementedError("Exercise 1.3: the paged KV pool (its size in blocks, its tensor, block copies)")

    def _index(self, blocks: list[int] | tuple[int, ...]) -> torch.Tensor:
        """Block ids as an index tensor (int64) on the pool's device; ids outside the pool
        raise ValueError naming them (before anything is read or written)."""
        raise NotImplementedError("Exercise 1.3: the paged KV pool (its size in blocks, its tensor, block copies)")
