# Generated from minserve/kvcache/block_allocator.py by `python -m minserve.course.generate`;
# edit the marked regions there, not here.
"""Chapter 01, KV cache and the block allocator: free list and reference counts.

The paged KV pool is cut into blocks; `BlockAllocator` hands out block ids and
counts who holds each one. Plug your class into the engine with
`LLM(block_allocator_cls=BlockAllocator)`.
"""

from collections import deque

from minserve.kvcache import NoFreeBlocksError


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
        if not self._free:
            raise NoFreeBlocksError(
                f"all {self.num_blocks} KV cache blocks are in use; "
                "free a sequence's blocks (or preempt one) before allocating"
            )
        block = self._free.popleft()
        self._refcounts[block] = 1
        return block

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
        if self._refcounts[block] == 0:
            raise ValueError(f"double free of block {block}: it is already on the free list")
        self._refcounts[block] -= 1
        if self._refcounts[block] == 0:
            self._free.append(block)

    def refcount(self, block: int) -> int:
        """How many users hold this block (0 when it is free)."""
        self._check_id(block)
        return self._refcounts[block]

    def _check_id(self, block: int) -> None:
        """Reject ids outside the pool (a negative id would silently index from the end)."""
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"unknown block id {block}; ids run from 0 to {self.num_blocks - 1}")
