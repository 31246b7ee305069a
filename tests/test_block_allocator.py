"""The block allocator and block tables: PagedAttention's bookkeeping, as a specification.

Unit tests pin exact behaviour; a Hypothesis state machine then runs random sequences of
allocate / share / free / new table / append / fork / free table against a model of who
holds which block and what each slot contains.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minserve.kvcache import BlockAllocator, BlockTable, NoFreeBlocksError

# --- the allocator ---------------------------------------------------------------------


def _state(allocator: BlockAllocator) -> tuple[int, list[int]]:
    return allocator.num_free, [allocator.refcount(b) for b in range(allocator.num_blocks)]


def test_allocate_hands_out_every_block_once_then_raises():
    allocator = BlockAllocator(3)
    assert sorted(allocator.allocate() for _ in range(3)) == [0, 1, 2]
    with pytest.raises(NoFreeBlocksError, match="all 3 KV cache blocks are in use"):
        allocator.allocate()
    assert _state(allocator) == (0, [1, 1, 1])


def test_can_allocate_compares_with_the_free_count():
    allocator = BlockAllocator(2)
    allocator.allocate()
    assert allocator.can_allocate(1) and not allocator.can_allocate(2)
    assert allocator.can_allocate(0)


def test_freed_blocks_are_reused_after_never_used_ones():
    allocator = BlockAllocator(3)
    first = allocator.allocate()
    allocator.free(first)
    assert [allocator.allocate() for _ in range(3)] == [1, 2, first]


def test_shared_block_returns_to_the_free_list_on_the_last_free():
    allocator = BlockAllocator(2)
    block = allocator.allocate()
    allocator.share(block)
    allocator.free(block)
    assert _state(allocator) == (1, [1, 0])
    allocator.free(block)
    assert _state(allocator) == (2, [0, 0])


def test_double_free_raises_and_changes_nothing():
    allocator = BlockAllocator(2)
    allocator.free(allocator.allocate())
    with pytest.raises(ValueError, match="double free of block 0"):
        allocator.free(0)
    assert _state(allocator) == (2, [0, 0])


def test_sharing_a_free_block_raises():
    allocator = BlockAllocator(2)
    with pytest.raises(ValueError, match="cannot share block 1: it is free"):
        allocator.share(1)
    assert _state(allocator) == (2, [0, 0])


@pytest.mark.parametrize("block", [-1, 4])
@pytest.mark.parametrize("method", ["free", "share", "refcount"])
def test_unknown_block_ids_are_rejected(method, block):
    allocator = BlockAllocator(4)
    with pytest.raises(ValueError, match=rf"unknown block id {block}; ids run from 0 to 3"):
        getattr(allocator, method)(block)


def test_an_allocator_needs_a_block():
    with pytest.raises(ValueError, match="at least 1 block, got 0"):
        BlockAllocator(0)


# --- the block table ----------------------------------------------------------------------


def _table(allocator: BlockAllocator, num_tokens: int, block_size: int = 4) -> BlockTable:
    table = BlockTable(block_size)
    table.append(allocator, num_tokens)
    return table


def test_append_assigns_slots_block_by_block():
    allocator = BlockAllocator(4)
    allocator.allocate()  # block 0 is someone else's, so slots start at block 1
    table = BlockTable(4)
    slots, copies = table.append(allocator, 5)
    assert (table.blocks, table.num_tokens) == ([1, 2], 5)
    assert (slots, copies) == ([4, 5, 6, 7, 8], [])
    assert [table.slot(p) for p in range(5)] == slots


def test_append_fills_the_last_block_before_allocating():
    allocator = BlockAllocator(4)
    table = _table(allocator, 5)
    assert table.append(allocator, 3) == ([5, 6, 7], [])
    assert table.blocks == [0, 1] and allocator.num_free == 2
    assert table.append(allocator, 1) == ([8], [])
    assert table.blocks == [0, 1, 2]


def test_append_of_nothing_changes_nothing():
    allocator = BlockAllocator(2)
    table = BlockTable(4)
    assert table.append(allocator, 0) == ([], [])
    assert (table.blocks, table.num_tokens, allocator.num_free) == ([], 0, 2)


@pytest.mark.parametrize(("new", "needed"), [(0, 0), (1, 0), (3, 0), (4, 1), (7, 1), (8, 2)])
def test_blocks_needed_counts_only_what_the_last_block_cannot_hold(new, needed):
    table = _table(BlockAllocator(8), 5)  # 2 blocks of 4: 3 free slots in the last
    assert table.blocks_needed(new) == needed


def test_slot_outside_the_table_raises():
    table = _table(BlockAllocator(2), 3)
    with pytest.raises(IndexError, match="position 3 has no slot; this table holds 3 tokens"):
        table.slot(3)


def test_fork_shares_every_block():
    allocator = BlockAllocator(4)
    parent = _table(allocator, 6)
    child = parent.fork(allocator)
    assert (child.blocks, child.num_tokens) == (parent.blocks, 6)
    assert child.blocks is not parent.blocks
    assert [allocator.refcount(b) for b in parent.blocks] == [2, 2]


def test_append_to_a_shared_partly_filled_block_copies_it_first():
    allocator = BlockAllocator(4)
    parent = _table(allocator, 6)  # blocks [0, 1]; block 1 holds 2 of 4 tokens
    child = parent.fork(allocator)
    assert parent.blocks_needed(1) == 1  # the copy
    slots, copies = parent.append(allocator, 1)
    assert copies == [(1, 2)]
    assert parent.blocks == [0, 2] and slots == [2 * 4 + 2]
    assert child.blocks == [0, 1]
    assert [allocator.refcount(b) for b in range(4)] == [2, 1, 1, 0]
    assert child.append(allocator, 1) == ([1 * 4 + 2], [])  # block 1 is the child's alone now


def test_append_after_a_shared_full_block_needs_no_copy():
    allocator = BlockAllocator(4)
    parent = _table(allocator, 8)
    parent.fork(allocator)
    assert parent.blocks_needed(1) == 1
    assert parent.append(allocator, 1) == ([2 * 4], [])


def test_blocks_needed_sees_when_the_last_sharer_let_go():
    allocator = BlockAllocator(4)
    parent = _table(allocator, 6)
    child = parent.fork(allocator)
    assert parent.blocks_needed(1) == 1
    child.free(allocator)  # the tail is parent's alone again: no copy needed
    assert parent.blocks_needed(1) == 0
    assert parent.append(allocator, 1) == ([6], [])


def test_a_table_uses_one_allocator():
    table = _table(BlockAllocator(2), 3)
    with pytest.raises(ValueError, match="blocks come from another allocator"):
        table.append(BlockAllocator(2), 1)
    assert (table.blocks, table.num_tokens) == ([0], 3)


def test_append_is_atomic_when_blocks_run_short():
    allocator = BlockAllocator(3)
    table = _table(allocator, 6)  # 2 blocks, 1 free
    with pytest.raises(NoFreeBlocksError, match="appending 7 tokens needs 2 new blocks, but"):
        table.append(allocator, 7)
    assert (table.blocks, table.num_tokens) == ([0, 1], 6)
    assert _state(allocator) == (1, [1, 1, 0])


def test_a_copy_on_write_that_cannot_be_allocated_changes_nothing():
    allocator = BlockAllocator(2)
    parent = _table(allocator, 3)
    child = parent.fork(allocator)
    allocator.allocate()  # the last free block
    with pytest.raises(NoFreeBlocksError, match="appending 1 tokens needs 1 new blocks"):
        parent.append(allocator, 1)
    assert (parent.blocks, child.blocks, parent.num_tokens) == ([0], [0], 3)
    assert _state(allocator) == (0, [2, 1])


def test_freeing_a_table_keeps_blocks_a_fork_still_holds():
    allocator = BlockAllocator(4)
    parent = _table(allocator, 6)
    child = parent.fork(allocator)
    child.append(allocator, 3)  # copies block 1 into 2, then fills block 2 and takes 3
    parent.free(allocator)
    assert (parent.blocks, parent.num_tokens) == ([], 0)
    assert [allocator.refcount(b) for b in range(4)] == [1, 0, 1, 1]


def test_table_arguments_are_checked():
    with pytest.raises(ValueError, match="block_size must be at least 1, got 0"):
        BlockTable(0)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0, got -1"):
        BlockTable(4).blocks_needed(-1)


# --- random sequences of operations -------------------------------------------------------

NUM_BLOCKS = 8


class AllocatorMachine(RuleBasedStateMachine):
    """Tables and loose references over one small allocator, checked against a model.

    The model: every reference is either a loose one (an `allocate` or `share` the test
    holds) or one block of one table, so a block's count must equal the references to it.
    A fake pool of slots holds, for every token, which (table, position) wrote it: a
    copy-on-write bug shows up as a token that reads back another sequence's value.
    """

    @initialize(block_size=st.integers(1, 4))
    def setup(self, block_size: int) -> None:
        self.allocator = BlockAllocator(NUM_BLOCKS)
        self.block_size = block_size
        self.loose: list[int] = []  # references the test holds outside any table
        self.tables: list[tuple[BlockTable, list[object]]] = []  # table, what each token holds
        self.pool: list[object] = [None] * (NUM_BLOCKS * block_size)  # slot -> token written
        self.next_token = 0

    def _held_blocks(self) -> list[int]:
        return self.loose + [b for table, _ in self.tables for b in table.blocks]

    # allocator rules

    @rule()
    def allocate(self) -> None:
        if self.allocator.num_free:
            self.loose.append(self.allocator.allocate())
        else:
            before = _state(self.allocator)
            with pytest.raises(NoFreeBlocksError):
                self.allocator.allocate()
            assert _state(self.allocator) == before

    @precondition(lambda self: self._held_blocks())
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self._held_blocks()))
        self.allocator.share(block)
        self.loose.append(block)

    @precondition(lambda self: self.loose)
    @rule(data=st.data())
    def free_loose(self, data: st.DataObject) -> None:
        self.allocator.free(self.loose.pop(data.draw(st.integers(0, len(self.loose) - 1))))

    @rule(block=st.integers(0, NUM_BLOCKS - 1))
    def free_or_share_when_free_raises(self, block: int) -> None:
        if self.allocator.refcount(block):
            return
        before = _state(self.allocator)
        with pytest.raises(ValueError, match="double free"):
            self.allocator.free(block)
        with pytest.raises(ValueError, match="it is free"):
            self.allocator.share(block)
        assert _state(self.allocator) == before

    # table rules

    @rule()
    def new_table(self) -> None:
        self.tables.append((BlockTable(self.block_size), []))

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), num_new=st.integers(0, 7))
    def append(self, data: st.DataObject, num_new: int) -> None:
        table, tokens = data.draw(st.sampled_from(self.tables))
        needed = table.blocks_needed(num_new)
        tail = table.blocks[-1] if table.blocks else None
        cow = bool(num_new and table.num_tokens % self.block_size)
        cow = cow and self.allocator.refcount(tail) > 1
        before = (list(table.blocks), table.num_tokens, _state(self.allocator))
        if not self.allocator.can_allocate(needed):
            with pytest.raises(NoFreeBlocksError):
                table.append(self.allocator, num_new)
            assert (table.blocks, table.num_tokens, _state(self.allocator)) == before
            return
        slots, copies = table.append(self.allocator, num_new)
        assert self.allocator.num_free == before[2][0] - needed
        assert copies == ([(tail, table.blocks[len(before[0]) - 1])] if cow else [])
        for src, dst in copies:  # what PagedKVPool.copy_blocks does to the real pool
            for offset in range(self.block_size):
                self.pool[dst * self.block_size + offset] = self.pool[
                    src * self.block_size + offset
                ]
        for slot in slots:  # never write into a block someone else still reads
            assert self.allocator.refcount(slot // self.block_size) == 1
        for slot in slots:
            self.pool[slot] = self.next_token
            tokens.append(self.next_token)
            self.next_token += 1

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        table, tokens = data.draw(st.sampled_from(self.tables))
        self.tables.append((table.fork(self.allocator), list(tokens)))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free_table(self, data: st.DataObject) -> None:
        table, _ = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1)))
        table.free(self.allocator)
        assert (table.blocks, table.num_tokens) == ([], 0)

    # invariants

    @invariant()
    def refcounts_equal_references_held(self) -> None:
        held = self._held_blocks()
        expected = [held.count(b) for b in range(NUM_BLOCKS)]
        assert [self.allocator.refcount(b) for b in range(NUM_BLOCKS)] == expected

    @invariant()
    def blocks_are_conserved_and_free_iff_unreferenced(self) -> None:
        free_list = list(self.allocator._free)  # the deque itself: no duplicates allowed
        unreferenced = [b for b in range(NUM_BLOCKS) if self.allocator.refcount(b) == 0]
        assert sorted(free_list) == unreferenced
        assert self.allocator.num_free + len(set(self._held_blocks())) == NUM_BLOCKS

    @invariant()
    def every_token_reads_back_what_its_sequence_wrote(self) -> None:
        for table, tokens in self.tables:
            assert table.num_tokens == len(tokens)
            assert [self.pool[table.slot(p)] for p in range(table.num_tokens)] == tokens

    def teardown(self) -> None:
        for table, _ in self.tables:
            table.free(self.allocator)
        for block in self.loose:
            self.allocator.free(block)
        assert _state(self.allocator) == (NUM_BLOCKS, [0] * NUM_BLOCKS)


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_allocator_state_machine = AllocatorMachine.TestCase
