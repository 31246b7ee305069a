"""Checks for chapter 05 (sharing prefixes), run against any module that defines
`RadixCache` and `LongestPrefixMatch`: minserve's own, the solutions, or a student's
exercise file.

Every check uses blocks of 2 tokens and minserve's real `BlockAllocator`, so the tree's
references show in the allocator's counts. Tokens are small ints; a "request" allocates
blocks for its prompt, inserts them, and lets go of its own references, the way the
engine does when a request finishes. Trees are shown as nested (edge tokens, children).
The checks of exercise 5.3, the host tier, are in `checks_ch05_host_tier.py`.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from minserve.course.checks_ch05_host_tier import (
    HOST_TIER_CHECKS,
    HOST_TIER_HINTS,
    HOST_TIER_PROGRESS,
)
from minserve.kvcache import BlockAllocator
from minserve.kvcache.manager import KVCacheManager
from minserve.kvcache.radix_cache import RadixCache
from minserve.request import Request
from minserve.sampling_params import SamplingParams
from minserve.scheduler.cache_aware import LongestPrefixMatch
from minserve.scheduler.sequence import SeqStatus, Sequence

BS = 2


def _cache(impl: ModuleType, num_blocks: int = 32) -> Any:
    return impl.RadixCache(BS, BlockAllocator(num_blocks))


def _finished_request(cache: Any, tokens: list[int]) -> list[int]:
    """Blocks computed for `tokens`, inserted, then released by the request: the tree's blocks."""
    blocks = [cache.allocator.allocate() for _ in range(len(tokens) // BS)]
    kept = cache.insert(tokens, blocks).blocks
    for block in blocks:
        cache.allocator.free(block)
    return kept


def edges(node: Any) -> list:
    """The tree under `node` as nested (edge tokens, children) pairs, children sorted."""
    return sorted((list(child.key), edges(child)) for child in node.children.values())


def _assert_tree(cache: Any, expected: list, what: str) -> None:
    got = edges(cache.root)
    assert got == expected, f"{what}: expected the tree {expected}, got {got}"


def _assert_counts(cache: Any, what: str, cached: int, evictable: int) -> None:
    got = (cache.num_cached_blocks, cache.num_evictable_blocks)
    assert got == (cached, evictable), (
        f"{what}: expected (num_cached_blocks, num_evictable_blocks) == {(cached, evictable)}, "
        f"got {got}"
    )


def check_match_returns_the_inserted_blocks(impl: ModuleType) -> None:
    """After inserting [1..6], match_prefix gives its 3 blocks, 2 of them for [1, 2, 3, 4, 9, 9]."""
    cache = _cache(impl)
    blocks = _finished_request(cache, [1, 2, 3, 4, 5, 6])
    for prompt, want in [([1, 2, 3, 4, 5, 6], blocks), ([1, 2, 3, 4, 9, 9], blocks[:2])]:
        got = cache.match_prefix(prompt).blocks
        assert got == want, f"match_prefix({prompt}) after [1..6]: expected {want}, got {got}"
    got = cache.match_prefix([7, 7]).blocks
    assert got == [], f"match_prefix([7, 7]) shares nothing: expected [], got {got}"


def check_match_counts_whole_blocks_only(impl: ModuleType) -> None:
    """[1, 2, 3] shares 3 tokens with the cached [1, 2, 3, 4], but only one whole block."""
    cache = _cache(impl)
    blocks = _finished_request(cache, [1, 2, 3, 4])
    for prompt in ([1, 2, 3], [1, 2, 3, 5]):
        got = cache.match_prefix(prompt).blocks
        assert got == blocks[:1], f"match_prefix({prompt}): expected {blocks[:1]}, got {got}"


def check_insert_takes_one_reference_per_new_block(impl: ModuleType) -> None:
    """insert shares each new block once (refcount 1 after the request lets go) and counts it."""
    cache = _cache(impl, num_blocks=8)
    blocks = _finished_request(cache, [1, 2, 3, 4])
    got = [cache.allocator.refcount(b) for b in blocks]
    assert got == [1, 1], f"the tree's references on {blocks}: expected [1, 1], got {got}"
    _assert_counts(cache, "after caching 2 blocks", cached=2, evictable=2)


def check_insert_keeps_the_blocks_it_already_has(impl: ModuleType) -> None:
    """Two requests computed [1, 2, 3, 4]: insert returns the first one's blocks, not the twins."""
    cache = _cache(impl, num_blocks=8)
    first = _finished_request(cache, [1, 2, 3, 4])
    twins = [cache.allocator.allocate() for _ in range(2)]
    got = cache.insert([1, 2, 3, 4], twins).blocks
    assert got == first, f"insert of a cached prompt: expected the cached blocks {first}, got {got}"
    counts = [cache.allocator.refcount(b) for b in twins]
    assert counts == [1, 1], f"the twins {twins} must not be shared by the tree; counts {counts}"
    _assert_counts(cache, "after inserting a cached prompt again", cached=2, evictable=2)


def check_prompts_parting_mid_edge_split_it(impl: ModuleType) -> None:
    """[1..6] then [1, 2, 3, 4, 7, 8, 9, 10]: the edge splits after [1, 2, 3, 4]."""
    cache = _cache(impl)
    _finished_request(cache, [1, 2, 3, 4, 5, 6])
    _finished_request(cache, [1, 2, 3, 4, 7, 8, 9, 10])
    _assert_tree(cache, [([1, 2, 3, 4], [([5, 6], []), ([7, 8, 9, 10], [])])], "after the split")
    _assert_counts(cache, "3 + 2 blocks cached", cached=5, evictable=5)


def check_evict_takes_the_least_recently_used_leaf(impl: ModuleType) -> None:
    """Leaves [1, 1], [2, 2], [3, 3]; [1, 1] matched again: evict(1) drops [2, 2]."""
    cache = _cache(impl)
    for tokens in ([1, 1], [2, 2], [3, 3]):
        _finished_request(cache, tokens)
    cache.match_prefix([1, 1])
    freed = cache.evict(1)
    assert freed == 1, f"evict(1): expected 1 block freed, got {freed}"
    _assert_tree(cache, [([1, 1], []), ([3, 3], [])], "after evict(1)")
    _assert_counts(cache, "after evict(1)", cached=2, evictable=2)


def check_evict_frees_from_the_tail_of_a_leaf(impl: ModuleType) -> None:
    """evict(2) on the leaf [1..6] frees its last two blocks and keeps [1, 2]."""
    cache = _cache(impl)
    blocks = _finished_request(cache, [1, 2, 3, 4, 5, 6])
    freed = cache.evict(2)
    assert freed == 2, f"evict(2): expected 2 blocks freed, got {freed}"
    _assert_tree(cache, [([1, 2], [])], "after evict(2)")
    got = [cache.allocator.refcount(b) for b in blocks]
    assert got == [1, 0, 0], f"counts of {blocks} after evict(2): expected [1, 0, 0], got {got}"


def check_evict_never_touches_a_locked_path(impl: ModuleType) -> None:
    """With [1, 2, 3, 4] locked, evict(10) frees only the sibling [5, 6], then stops."""
    cache = _cache(impl)
    _finished_request(cache, [1, 2, 3, 4])
    _finished_request(cache, [1, 2, 5, 6])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    freed = cache.evict(10)
    assert freed == 1, f"evict(10) with [1, 2, 3, 4] locked: expected 1 block freed, got {freed}"
    _assert_tree(cache, [([1, 2], [([3, 4], [])])], "after evict(10) with a lock")
    cache.unlock(node)
    freed = cache.evict(10)
    assert freed == 2, f"evict(10) once unlocked: expected the last 2 blocks, got {freed}"
    _assert_counts(cache, "after evicting everything", cached=0, evictable=0)
    free = cache.allocator.num_free
    assert free == 32, f"every block back in the pool: expected 32 free, got {free}"


# Random operations on two trees in lockstep: the implementation's and minserve's own.
_SETTINGS = settings(
    max_examples=100, deadline=None, database=None, derandomize=True, report_multiple_bugs=False
)
_prompts = st.lists(st.integers(1, 2), min_size=2, max_size=8)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), _prompts),
        st.tuples(st.just("match"), _prompts),
        st.tuples(st.just("lock"), _prompts),
        st.tuples(st.just("unlock"), st.just([])),
        st.tuples(st.just("evict"), st.integers(1, 8)),
    ),
    max_size=8,
)


def _state(cache: Any) -> tuple:
    """Everything a step may change: the tree, its counters, every block's count."""
    counts = [cache.allocator.refcount(b) for b in range(cache.allocator.num_blocks)]
    return edges(cache.root), cache.num_cached_blocks, cache.num_evictable_blocks, counts


def _apply(cache: Any, op: tuple, locked: list) -> object:
    """One operation; what it returns (blocks matched or kept, blocks evicted)."""
    name, arg = op
    if name == "insert":
        return _finished_request(cache, arg[: len(arg) // BS * BS])
    if name == "match":
        return cache.match_prefix(arg).blocks
    if name == "lock":
        match = cache.match_prefix(arg)
        cache.lock(match.node)
        locked.append(match.node)
        return match.blocks
    if name == "unlock":
        if locked:
            cache.unlock(locked.pop())
        return None
    return cache.evict(arg)


def check_random_operations_agree_with_minserves_tree(impl: ModuleType) -> None:
    """Random insert / match / lock / unlock / evict runs: same results, tree and refcounts."""

    @_SETTINGS
    @given(_ops)
    def run(ops: list[tuple]) -> None:
        yours, ours = _cache(impl, 64), RadixCache(BS, BlockAllocator(64))
        yours_locked: list = []
        ours_locked: list = []
        for step, op in enumerate(ops):
            got, expected = _apply(yours, op, yours_locked), _apply(ours, op, ours_locked)
            what = f"operations {ops[: step + 1]} (blocks of {BS} tokens, a pool of 64)"
            assert got == expected, f"{what}: the last one should return {expected}, got {got}"
            got_state, expected_state = _state(yours), _state(ours)
            for label, g, e in zip(
                ("tree", "num_cached_blocks", "num_evictable_blocks", "refcounts by block"),
                got_state,
                expected_state,
            ):
                assert g == e, f"{what}: expected {label} {e}, got {g}"

    run()


# Exercise 5.1: the longest-prefix-match policy, on hand-made queues.
def _kv(cached_prompts: list[list[int]]) -> KVCacheManager:
    """A KV manager whose prefix cache holds the whole blocks of `cached_prompts`."""
    allocator = BlockAllocator(64)
    kv = KVCacheManager(allocator, BS, prefix_cache=RadixCache(BS, allocator))
    for prompt in cached_prompts:
        table = kv.new_table()
        kv.append(table, len(prompt))
        kv.cache_computed(table, prompt, len(prompt))
        kv.free(table)
    return kv


def _seq(kv: KVCacheManager, name: str, prompt: list[int], arrival: float, order: int) -> Sequence:
    request = Request.create(name, prompt, SamplingParams(), arrival_time=arrival)
    return Sequence(request, request.samples[0], kv.new_table(), order=order)


def _names(seqs: list[Sequence]) -> list[str]:
    return [s.request.request_id for s in seqs]


def _assert_order(impl: ModuleType, kv: KVCacheManager, seqs: list, max_wait_s: float, what: str):
    got = _names(sorted(seqs, key=impl.LongestPrefixMatch(kv, max_wait_s=max_wait_s)))
    expected = _names(sorted(seqs, key=LongestPrefixMatch(kv, max_wait_s=max_wait_s)))
    assert got == expected, f"{what}: expected the order {expected}, got {got}"


def check_lpm_serves_the_longest_cached_prefix_first(impl: ModuleType) -> None:
    """[1..6] cached: hot (6 cached), hot2 (6, later), warm (2), cold (0), arrival aside."""
    kv = _kv([[1, 2, 3, 4, 5, 6]])
    now = time.monotonic()
    seqs = [
        _seq(kv, "cold", [9, 9, 9], now, 0),
        _seq(kv, "warm", [1, 2, 7, 7], now + 1, 1),
        _seq(kv, "hot", [1, 2, 3, 4, 5, 6, 8], now + 2, 2),
        _seq(kv, "hot2", [1, 2, 3, 4, 5, 6, 9], now + 3, 3),
    ]
    policy = impl.LongestPrefixMatch(kv, max_wait_s=3600)
    got = [policy.cached_tokens(s) for s in seqs]
    assert got == [0, 2, 6, 6], (
        f"cached_tokens of cold, warm, hot, hot2: expected [0, 2, 6, 6], got {got}"
    )
    _assert_order(impl, kv, seqs, 3600, "four waiting requests, [1..6] cached")


def check_lpm_breaks_ties_first_come_first_served(impl: ModuleType) -> None:
    """Equal cached prefixes: earlier arrival first; equal arrivals: lower order first."""
    kv = _kv([[1, 2, 3, 4]])
    now = time.monotonic()
    seqs = [
        _seq(kv, "c", [1, 2, 3, 4, 9], now + 2, 2),
        _seq(kv, "b", [1, 2, 3, 4, 8], now + 1, 5),
        _seq(kv, "a", [1, 2, 3, 4, 7], now + 1, 4),
    ]
    _assert_order(impl, kv, seqs, 3600, "three requests with 4 cached tokens each")


def check_a_starved_request_goes_first(impl: ModuleType) -> None:
    """'old' waited 30 s and shares nothing: first under max_wait_s=10, last under 60."""
    kv = _kv([[1, 2, 3, 4]])
    now = time.monotonic()
    seqs = [_seq(kv, "hot", [1, 2, 3, 4, 5], now, 1), _seq(kv, "old", [9, 9, 9], now - 30, 0)]
    for max_wait_s, expected in ((10, ["old", "hot"]), (60, ["hot", "old"])):
        got = _names(sorted(seqs, key=impl.LongestPrefixMatch(kv, max_wait_s=max_wait_s)))
        assert got == expected, (
            f"'old' waited 30 s, 'hot' has 4 cached tokens, max_wait_s={max_wait_s}: "
            f"expected {expected}, got {got}"
        )


def check_running_sequences_rank_fcfs_ahead_of_waiting_ones(impl: ModuleType) -> None:
    """Running and swapped sequences are ranked by arrival alone, ahead of waiting ones."""
    kv = _kv([[1, 2, 3, 4]])
    now = time.monotonic()
    seqs = [
        _seq(kv, "waiting hot", [1, 2, 3, 4, 5], now, 0),
        _seq(kv, "running cold", [9, 9, 9], now + 2, 2),
        _seq(kv, "swapped", [9, 8, 7], now + 3, 3),
        _seq(kv, "running hot", [1, 2, 3, 4, 6], now + 1, 1),
    ]
    seqs[1].status = seqs[3].status = SeqStatus.RUNNING
    seqs[2].status = SeqStatus.SWAPPED
    kv.append(seqs[1].block_table, 3)
    seqs[1].num_computed_tokens = 3
    policy = impl.LongestPrefixMatch(kv, max_wait_s=3600)
    got = _names(sorted(seqs, key=policy))
    expected = ["running hot", "running cold", "swapped", "waiting hot"]
    assert got == expected, f"two running, one swapped, one waiting: expected {expected}, got {got}"


def check_a_sequence_holding_blocks_counts_its_computed_tokens(impl: ModuleType) -> None:
    """A preempted sequence back in the queue with 4 tokens computed: cached_tokens is 4."""
    kv = _kv([])
    seq = _seq(kv, "back", [5, 6, 7, 8, 9], time.monotonic(), 0)
    kv.append(seq.block_table, 4)
    seq.num_computed_tokens = 4
    got = impl.LongestPrefixMatch(kv, max_wait_s=3600).cached_tokens(seq)
    assert got == 4, f"a waiting sequence holding 2 blocks, 4 computed: expected 4, got {got}"


_queue = st.lists(
    st.tuples(
        st.lists(st.integers(1, 2), min_size=1, max_size=7),  # prompt
        st.integers(0, 40),  # seconds waited so far
        st.sampled_from([SeqStatus.WAITING, SeqStatus.WAITING, SeqStatus.RUNNING]),
    ),
    min_size=1,
    max_size=6,
)


def check_random_queues_are_ordered_as_minserve_orders_them(impl: ModuleType) -> None:
    """Random queues over a cache of [1, 1, 2, 2] and [2, 1]: the order minserve's policy gives."""

    @_SETTINGS
    @given(_queue)
    def run(queue: list[tuple]) -> None:
        kv = _kv([[1, 1, 2, 2], [2, 1]])
        now = time.monotonic()
        seqs = []
        for i, (prompt, waited, status) in enumerate(queue):
            seq = _seq(kv, f"r{i}", prompt, now - waited, i)
            seq.status = status
            seqs.append(seq)
        shown = [(f"r{i}", p, f"waited {w} s", s.value) for i, (p, w, s) in enumerate(queue)]
        _assert_order(impl, kv, seqs, 20, f"queue {shown}, max_wait_s=20")

    run()


CHECKS = [
    check_match_returns_the_inserted_blocks,
    check_match_counts_whole_blocks_only,
    check_insert_takes_one_reference_per_new_block,
    check_insert_keeps_the_blocks_it_already_has,
    check_prompts_parting_mid_edge_split_it,
    check_evict_takes_the_least_recently_used_leaf,
    check_evict_frees_from_the_tail_of_a_leaf,
    check_evict_never_touches_a_locked_path,
    check_random_operations_agree_with_minserves_tree,
    check_lpm_serves_the_longest_cached_prefix_first,
    check_lpm_breaks_ties_first_come_first_served,
    check_a_starved_request_goes_first,
    check_running_sequences_rank_fcfs_ahead_of_waiting_ones,
    check_a_sequence_holding_blocks_counts_its_computed_tokens,
    check_random_queues_are_ordered_as_minserve_orders_them,
    *HOST_TIER_CHECKS,  # exercise 5.3: checks_ch05_host_tier.py
]

PROGRESS = {"5.3": HOST_TIER_PROGRESS}

HINTS: dict[str, tuple[str, str, str]] = {
    "5.2": (
        "The tree stores whole blocks only: an edge's tokens are a multiple of block_size, "
        "and a node's blocks hold the KV of its edge. The tree owns one allocator reference "
        "per cached block; eviction gives that reference back.",
        "match_prefix: from the root, pick the child by the next block's tokens, count the "
        "whole blocks that agree, split the edge if the prompt leaves it midway, touch the "
        "node. insert: match first, then hang the rest as one leaf and share its blocks. "
        "evict: a heap of unlocked leaves by last_access; pop, free from the tail, remove "
        "empty leaves, push a parent that became an unlocked leaf.",
        "In match_prefix: look the child up in node.children by self._child_key(...) at "
        "pos; count the agreeing blocks with self._shared_blocks(...); self._split the "
        "child when fewer than all its blocks agree. In evict: build the heap from "
        "self._evictable_leaves() as (last_access, id, leaf) triples (the id breaks ties), "
        "and free the tail of leaf.blocks before trimming leaf.key.",
    ),
    "5.1": (
        "A policy is a sort key: lower tuples run first. Longest prefix match ranks waiting "
        "requests by how many of their tokens the cache already holds, and a guard lets any "
        "request that waited longer than max_wait_s jump ahead of everyone.",
        "Three small methods. _starved compares time.monotonic() - arrival_time with "
        "max_wait_s. cached_tokens: a sequence that already holds blocks counts its computed "
        "tokens; otherwise ask the KV manager. __call__: group 0 for sequences not WAITING "
        "and starved ones, group 1 for the rest; then minus the cached tokens; then FCFS.",
        "FCFS is the pair (arrival time, order); a group-0 key looks like `(0, 0, *that "
        "pair)`, a group-1 key like `(1, -cached, *that pair)`; `cached_tokens` reads "
        "`self.kv.cached_tokens(seq.token_ids)` when `seq.block_table.blocks` is empty.",
    ),
}
HINTS["5.3"] = HOST_TIER_HINTS
