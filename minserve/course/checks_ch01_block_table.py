"""Chapter 01's checks of the block table (exercise 1.2) and a randomized check of the
allocator (exercise 1.1); `checks_ch01` lists them after the allocator's worked examples.

The block-table checks run the student's `BlockTable` on minserve's own `BlockAllocator`
(so they do not depend on exercise 1.1) with blocks of 4 tokens, and compare block lists,
slots, copies and reference counts with what PagedAttention says they must be.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from minserve.kvcache.block_allocator import BlockAllocator, NoFreeBlocksError

BLOCK_SIZE = 4


def _table_with(impl: ModuleType, allocator: BlockAllocator, num_tokens: int) -> Any:
    table = impl.BlockTable(BLOCK_SIZE)
    table.append(allocator, num_tokens)
    return table


def _refcounts(allocator: BlockAllocator, blocks: list[int]) -> dict[int, int]:
    return {block: allocator.refcount(block) for block in blocks}


def check_append_maps_slots_through_the_table(impl: ModuleType) -> None:
    """6 tokens after 3 blocks went elsewhere: blocks [3, 4], slots 12..17 (block * 4 + offset)."""
    allocator = BlockAllocator(8)
    for _ in range(3):
        allocator.allocate()  # another sequence holds blocks 0, 1, 2
    table = impl.BlockTable(BLOCK_SIZE)
    slots, copies = table.append(allocator, 6)
    got = (table.blocks, slots, copies, table.num_tokens)
    expected = ([3, 4], [12, 13, 14, 15, 16, 17], [], 6)
    assert got == expected, (
        "append(allocator, 6) on an empty table, blocks of 4, blocks 0-2 taken: expected "
        f"(blocks, slots, copies, num_tokens) = {expected}, got {got}"
    )
    got_slots = [table.slot(p) for p in range(6)]
    assert got_slots == expected[1], f"slot(0..5): expected {expected[1]}, got {got_slots}"


def check_blocks_needed_counts_fresh_blocks_and_the_copy(impl: ModuleType) -> None:
    """blocks_needed(n) at 6 tokens in blocks of 4: 2 free slots, then whole blocks, +1 if shared.

    One more block is counted once a fork shares the partly-filled last block."""
    allocator = BlockAllocator(16)
    table = _table_with(impl, allocator, 6)  # blocks of 4: the last holds 2 tokens, 2 free
    cases = {0: 0, 1: 0, 2: 0, 3: 1, 6: 1, 7: 2}
    got = {n: table.blocks_needed(n) for n in cases}
    assert got == cases, (
        f"blocks_needed(n) for n in {list(cases)}, a private table of 6 tokens, blocks of 4: "
        f"expected {cases}, got {got}"
    )
    table.fork(allocator)  # the child shares every block: writing the tail copies it first
    shared = {n: cases[n] + (n > 0) for n in cases}
    got = {n: table.blocks_needed(n) for n in cases}
    assert got == shared, (
        f"blocks_needed(n) for n in {list(cases)} after a fork shares the partly-filled last "
        f"block: expected {shared} (one more for its copy), got {got}"
    )
    before = allocator.num_free
    table.append(allocator, 3)
    assert before - allocator.num_free == shared[3], (
        f"append(allocator, 3) after the fork: blocks_needed said {shared[3]}, "
        f"append took {before - allocator.num_free}"
    )


def check_append_fills_the_last_block_first(impl: ModuleType) -> None:
    """3 tokens, then 1 (same block), then 1 more (a new block): only when the last is full."""
    allocator = BlockAllocator(8)
    table = impl.BlockTable(BLOCK_SIZE)
    steps = []
    for n in (3, 1, 1):
        slots, _ = table.append(allocator, n)
        steps.append((n, list(table.blocks), slots))
    expected = [(3, [0], [0, 1, 2]), (1, [0], [3]), (1, [0, 1], [4])]
    assert steps == expected, (
        f"appending 3, 1, 1 tokens, blocks of 4: expected (tokens, blocks, slots) per call "
        f"{expected}, got {steps}"
    )


def check_fork_shares_every_block(impl: ModuleType) -> None:
    """fork() of a 6-token table: the child lists the same blocks, each now counted twice."""
    allocator = BlockAllocator(8)
    parent = _table_with(impl, allocator, 6)
    child = parent.fork(allocator)
    assert child is not parent and child.blocks is not parent.blocks, (
        "fork() must return a new table with its own list of blocks (the child appends alone)"
    )
    got = (child.blocks, child.num_tokens, _refcounts(allocator, parent.blocks), allocator.num_free)
    expected = ([0, 1], 6, {0: 2, 1: 2}, 6)
    assert got == expected, (
        "fork() of a table holding blocks [0, 1] and 6 tokens: expected (child blocks, child "
        f"num_tokens, refcounts, num_free) = {expected}, got {got}"
    )


def check_write_to_a_shared_last_block_copies_it(impl: ModuleType) -> None:
    """After a fork at 6 tokens, the child's next token copies block 1 to a fresh block."""
    allocator = BlockAllocator(8)
    parent = _table_with(impl, allocator, 6)
    child = parent.fork(allocator)
    slots, copies = child.append(allocator, 1)
    got = (child.blocks, slots, copies, _refcounts(allocator, [0, 1, 2]), parent.blocks)
    expected = ([0, 2], [10], [(1, 2)], {0: 2, 1: 1, 2: 1}, [0, 1])
    assert got == expected, (
        "fork at 6 tokens (blocks [0, 1], block 1 half full), then child.append(1): expected "
        "(child blocks, slots, copies (src, dst), refcounts of 0-2, parent blocks) = "
        f"{expected}, got {got}; the shared block is copied, never written"
    )
    slots, copies = parent.append(allocator, 1)
    assert (slots, copies) == ([6], []), (
        "then parent.append(1), block 1 now the parent's alone: expected slots [6] and no "
        f"copies, got slots {slots}, copies {copies}"
    )


def check_full_shared_blocks_are_not_copied(impl: ModuleType) -> None:
    """A fork at 8 tokens (two full blocks): the next token goes to a new block, no copy."""
    allocator = BlockAllocator(8)
    parent = _table_with(impl, allocator, 8)
    child = parent.fork(allocator)
    slots, copies = child.append(allocator, 1)
    got = (child.blocks, slots, copies, _refcounts(allocator, [0, 1]))
    expected = ([0, 1, 2], [8], [], {0: 2, 1: 2})
    assert got == expected, (
        "fork at 8 tokens (blocks [0, 1] full), then child.append(1): expected (child blocks, "
        f"slots, copies, refcounts) = {expected}, got {got}; a full block is never written again"
    )


def check_forks_free_back_to_an_empty_pool(impl: ModuleType) -> None:
    """A table, two forks, a copy-on-write and frees in any order leave every block free."""
    allocator = BlockAllocator(8)
    parent = _table_with(impl, allocator, 5)
    children = [parent.fork(allocator), parent.fork(allocator)]
    children[0].append(allocator, 2)
    for table in (children[0], parent, children[1]):
        table.free(allocator)
    assert allocator.num_free == 8, (
        "after a 5-token table, two forks, 2 tokens appended to one fork and freeing all three: "
        f"expected 8 free blocks of 8, got {allocator.num_free} (a reference was lost or doubled)"
    )


# --- the allocator, against a reference model -------------------------------------------

NUM_BLOCKS = 4
OPERATIONS = st.lists(
    st.one_of(
        st.just(("allocate",)),
        st.tuples(st.just("free"), st.integers(0, 7)),
        st.tuples(st.just("share"), st.integers(0, 7)),
    ),
    max_size=30,
)


def _run_against_model(impl: ModuleType, operations: list[tuple]) -> None:
    """Apply `operations` to the student's allocator and to a dict of reference counts.

    free and share pick the i-th held block (i modulo how many are held), so every
    operation is legal except allocate on a full pool, which must raise NoFreeBlocksError.
    """
    allocator = impl.BlockAllocator(NUM_BLOCKS)
    counts = [0] * NUM_BLOCKS  # the reference model
    done: list[str] = []
    for op in operations:
        held = [b for b in range(NUM_BLOCKS) if counts[b] > 0]
        if op[0] == "allocate":
            step = _allocate_step(allocator, counts, done)
        elif not held:
            continue  # nothing to free or share yet
        else:
            block = held[op[1] % len(held)]
            getattr(allocator, op[0])(block)
            counts[block] += 1 if op[0] == "share" else -1
            step = f"{op[0]}({block})"
        done.append(step)
        expected = (counts.count(0), counts)
        got = (allocator.num_free, [allocator.refcount(b) for b in range(NUM_BLOCKS)])
        assert got == expected, (
            f"pool of {NUM_BLOCKS} blocks, after {'; '.join(done)}: expected (num_free, "
            f"refcounts of blocks 0-3) = {expected}, got {got}"
        )


def _allocate_step(allocator: Any, counts: list[int], done: list[str]) -> str:
    """One allocate(): a free block when there is one (then counted), else NoFreeBlocksError."""
    if 0 not in counts:
        try:
            block = allocator.allocate()
        except NoFreeBlocksError:
            return "allocate() -> NoFreeBlocksError"
        raise AssertionError(
            f"pool of {NUM_BLOCKS} blocks, after {'; '.join(done)}: every block is held, so "
            f"allocate() must raise NoFreeBlocksError; got block {block}"
        )
    block = allocator.allocate()
    assert 0 <= block < NUM_BLOCKS and counts[block] == 0, (
        f"pool of {NUM_BLOCKS} blocks, after {'; '.join(done) or 'nothing'}: allocate() returned "
        f"block {block}, but the free blocks are {[b for b in range(NUM_BLOCKS) if counts[b] == 0]}"
    )
    counts[block] = 1
    return f"allocate() -> {block}"


def check_allocator_matches_a_reference_model(impl: ModuleType) -> None:
    """300 random runs of allocate / free / share keep num_free and every refcount right
    (hypothesis; a failure shows the shortest sequence of operations it found)."""

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              report_multiple_bugs=False, print_blob=False)  # fmt: skip
    @given(OPERATIONS)
    def run(operations: list[tuple]) -> None:
        _run_against_model(impl, operations)

    run()
