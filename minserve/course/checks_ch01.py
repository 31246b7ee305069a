"""Checks for chapter 01 (the block allocator, the block table and the paged pool), run
against any module that defines `BlockAllocator`, `BlockTable` and `PagedKVPool`: the
solutions, or a student's exercise file (the pool's checks are in `checks_ch01_pool`).

Each check builds a small allocator, works it through a few allocations, shares and
frees whose outcome can be worked out on paper, and asserts with a message that shows
expected against got. Exhaustion must raise minserve's `NoFreeBlocksError` (the engine
catches it to preempt); misuse (a double free, an unknown id) raises `ValueError`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from minserve.course.check import passes  # noqa: F401  (the notebook imports it from here)
from minserve.course.checks_ch01_block_table import (
    check_allocator_matches_a_reference_model,
    check_append_fills_the_last_block_first,
    check_append_maps_slots_through_the_table,
    check_blocks_needed_counts_fresh_blocks_and_the_copy,
    check_fork_shares_every_block,
    check_forks_free_back_to_an_empty_pool,
    check_full_shared_blocks_are_not_copied,
    check_write_to_a_shared_last_block_copies_it,
)
from minserve.course.checks_ch01_pool import POOL_CHECKS
from minserve.kvcache import NoFreeBlocksError


def _allocate_all(allocator: Any, count: int) -> list[int]:
    return [allocator.allocate() for _ in range(count)]


def _assert_raises(
    action: Callable[[], object], error: type[Exception], what: str, hint: str
) -> Exception:
    """Run `action`; it must raise `error` (a stub's NotImplementedError passes through)."""
    try:
        result = action()
    except error as caught:
        return caught
    raise AssertionError(f"{what}: expected {error.__name__}, got {result!r} ({hint})")


def _assert_state(allocator: Any, what: str, num_free: int, refcounts: dict[int, int]) -> None:
    """Compare num_free and some blocks' reference counts with what they should be."""
    assert allocator.num_free == num_free, (
        f"{what}: expected num_free == {num_free}, got {allocator.num_free}"
    )
    got = {block: allocator.refcount(block) for block in refcounts}
    assert got == refcounts, f"{what}: expected reference counts {refcounts}, got {got}"


def check_allocate_hands_out_distinct_blocks(impl: ModuleType) -> None:
    """allocate() on a pool of 4 returns 4 distinct ids in 0..3, each with a count of 1."""
    allocator = impl.BlockAllocator(4)
    blocks = _allocate_all(allocator, 4)
    assert sorted(blocks) == [0, 1, 2, 3], (
        f"4 allocations from a pool of 4: expected the ids 0, 1, 2, 3 in some order, got {blocks}"
    )
    _assert_state(allocator, "after 4 allocations", 0, {b: 1 for b in range(4)})


def check_allocate_when_exhausted_raises(impl: ModuleType) -> None:
    """A fifth allocate() on a pool of 4 raises NoFreeBlocksError and changes nothing."""
    allocator = impl.BlockAllocator(4)
    _allocate_all(allocator, 4)
    _assert_raises(
        allocator.allocate,
        NoFreeBlocksError,
        "allocate() with every block in use",
        "raise NoFreeBlocksError so the scheduler knows to wait or preempt",
    )
    _assert_state(allocator, "after the failed allocate()", 0, {b: 1 for b in range(4)})


def check_free_returns_the_block_for_reuse(impl: ModuleType) -> None:
    """Freeing block b of a full pool makes the next allocate() return b."""
    allocator = impl.BlockAllocator(3)
    blocks = _allocate_all(allocator, 3)
    allocator.free(blocks[1])
    _assert_state(allocator, f"after freeing block {blocks[1]}", 1, {blocks[1]: 0})
    again = allocator.allocate()
    assert again == blocks[1], (
        f"allocate() after freeing block {blocks[1]} of a full pool: "
        f"expected {blocks[1]}, the only free block, got {again}"
    )


def check_shared_block_stays_until_last_free(impl: ModuleType) -> None:
    """A block shared twice (count 3) survives two frees and returns on the third."""
    allocator = impl.BlockAllocator(2)
    block = allocator.allocate()
    allocator.share(block)
    allocator.share(block)
    for count in (2, 1):
        allocator.free(block)
        _assert_state(allocator, f"a shared block freed down to {count} users", 1, {block: count})
    allocator.free(block)
    _assert_state(allocator, "the last user freed the shared block", 2, {block: 0})


def check_double_free_raises(impl: ModuleType) -> None:
    """Freeing a block twice raises ValueError the second time and changes nothing."""
    allocator = impl.BlockAllocator(2)
    block = allocator.allocate()
    allocator.free(block)
    _assert_raises(
        lambda: allocator.free(block),
        ValueError,
        f"free({block}) of a block already free",
        "a double free would put the block on the free list twice",
    )
    _assert_state(allocator, "after the rejected double free", 2, {block: 0})


def check_free_of_a_never_allocated_block_raises(impl: ModuleType) -> None:
    """free() of a block nobody allocated raises ValueError; the pool is unchanged."""
    allocator = impl.BlockAllocator(3)
    held = allocator.allocate()
    never = next(b for b in range(3) if b != held)
    _assert_raises(
        lambda: allocator.free(never),
        ValueError,
        f"free({never}) of a block that was never allocated",
        "its reference count is already zero",
    )
    _assert_state(allocator, "after the rejected free", 2, {held: 1, never: 0})


def check_many_cycles_keep_the_books(impl: ModuleType) -> None:
    """10,000 rounds of allocate-all then free-all leave every block free, none lost."""
    allocator = impl.BlockAllocator(8)
    for _ in range(10_000 // 8):
        for block in _allocate_all(allocator, 8):
            allocator.free(block)
    _assert_state(allocator, "after 10,000 allocate/free cycles", 8, {b: 0 for b in range(8)})
    blocks = _allocate_all(allocator, 8)
    assert sorted(blocks) == list(range(8)), (
        f"allocating the whole pool after the cycles: expected ids 0..7, got {sorted(blocks)}"
    )


ALLOCATOR_CHECKS = [
    check_allocate_hands_out_distinct_blocks,
    check_allocate_when_exhausted_raises,
    check_free_returns_the_block_for_reuse,
    check_shared_block_stays_until_last_free,
    check_double_free_raises,
    check_free_of_a_never_allocated_block_raises,
    check_many_cycles_keep_the_books,
    check_allocator_matches_a_reference_model,
]
TABLE_CHECKS = [
    check_append_maps_slots_through_the_table,
    check_append_fills_the_last_block_first,
    check_blocks_needed_counts_fresh_blocks_and_the_copy,
    check_fork_shares_every_block,
    check_write_to_a_shared_last_block_copies_it,
    check_full_shared_blocks_are_not_copied,
    check_forks_free_back_to_an_empty_pool,
]
CHECKS = ALLOCATOR_CHECKS + TABLE_CHECKS + POOL_CHECKS


HINTS: dict[str, tuple[str, str, str]] = {
    "1.1": (
        "A block is free exactly when nobody holds it: keep a free list of ids and a "
        "reference count per id, and keep the two in step.",
        "allocate: fail with NoFreeBlocksError when the free list is empty, else take an id "
        "from it and set its count to 1. free: check the id, refuse a count already at 0, "
        "decrement, and put the id back on the free list when the count reaches 0.",
        "allocate: if not self._free: raise NoFreeBlocksError(...); b = self._free.popleft(); "
        "self._refcounts[b] = 1. free: self._check(b); a zero count raises ValueError; "
        "self._refcounts[b] -= 1; at zero, self._free.append(b).",
    ),
    "1.2": (
        "A token at position p lives in logical block p // block_size at offset "
        "p % block_size; the table maps logical blocks to physical ones. Forks share blocks "
        "(one more reference each); a shared block that would be written is copied first.",
        "slot: look up the physical block, times block_size, plus the offset. append: if the "
        "last block is shared and partly filled, copy it (_copy_on_write); allocate blocks "
        "until they cover num_tokens + n; advance num_tokens; return the new tokens' slots "
        "and the copies. fork: a new table with a copy of the list, sharing each block. "
        "blocks_needed: the free slots of the last block absorb the first new tokens; the "
        "rest need whole blocks; add one for a copy-on-write.",
        "_copy_on_write: new = allocator.allocate(); allocator.free(old) (your reference "
        "only); self.blocks[-1] = new; return (old, new). fork: child = BlockTable(size); "
        "child.blocks = self.blocks[:]; same num_tokens and _allocator; allocator.share(b) "
        "for each b. blocks_needed: free = len(self.blocks) * block_size - num_tokens; "
        "ceil((n - free) / block_size) when positive, plus 1 if _needs_copy_on_write().",
    ),
    "1.3": (
        "The pool is one tensor [layers, 2 (K, V), num_blocks, block_size, Hkv, row]: a block "
        "is the slice kv[:, :, b], so sizing it, copying it and moving it are all about that "
        "third axis. The format says what a row holds (row_size) and costs "
        "(bytes_per_token_head).",
        "bytes_per_block multiplies block_size, 2, layers, KV heads and the bytes of one row. "
        "num_blocks_for floors the budget (kv_cache_memory_bytes, or DEFAULT_KV_CACHE_BYTES) "
        "by it, after the given count and before the too-small error. In __init__, "
        "torch.zeros of the shape, then views kv[i, 0] and kv[i, 1] per layer. _index checks "
        "0 <= b < num_blocks (torch would read -1 as the last block) and makes a long tensor; "
        "the moves index kv[:, :, ids] on both sides.",
        "copy_blocks: return on an empty list; src, dst = the two columns of the pairs, each "
        "through _index; then one assignment kv[:, :, dst] = kv[:, :, src] (the right side is "
        "read whole first). gather_blocks returns kv[:, :, _index(blocks)]; write_blocks "
        "assigns data moved with .to(device, dtype, non_blocking=True) to that slice. "
        "num_blocks_for: per_block from cls.bytes_per_block; raise holds_no_block(budget, "
        "per_block, block_size, model_config, dtype) when budget < per_block; else "
        "budget // per_block.",
    ),
}
