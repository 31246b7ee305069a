"""Checks for chapter 05 (sharing prefixes), run against any module that defines
`RadixCache`: minserve's own, the solutions, or a student's exercise file.

Every check uses blocks of 2 tokens and minserve's real `BlockAllocator`, so the tree's
references show in the allocator's counts. Tokens are small ints; a "request" allocates
blocks for its prompt, inserts them, and lets go of its own references, the way the
engine does when a request finishes. Trees are shown as nested (edge tokens, children).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from minserve.kvcache import BlockAllocator

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


CHECKS = [
    check_match_returns_the_inserted_blocks,
    check_match_counts_whole_blocks_only,
    check_insert_takes_one_reference_per_new_block,
    check_insert_keeps_the_blocks_it_already_has,
    check_prompts_parting_mid_edge_split_it,
    check_evict_takes_the_least_recently_used_leaf,
    check_evict_frees_from_the_tail_of_a_leaf,
    check_evict_never_touches_a_locked_path,
]
