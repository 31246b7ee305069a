"""The radix prefix cache: what chapter 05's checks do not already pin down.

Matching, insertion, splits, LRU and tail eviction and locks are specified by the checks
in `minserve/course/checks_ch05.py`, which tests/test_course.py runs on minserve's own
`RadixCache`. Here: the root, counters under locks, climbing eviction, and bad input.
"""

from __future__ import annotations

import pytest

from minserve.course.checks_ch05 import _finished_request, edges
from minserve.kvcache import BlockAllocator
from minserve.kvcache.radix_cache import RadixCache


def _cache(num_blocks: int = 32) -> RadixCache:
    return RadixCache(2, BlockAllocator(num_blocks))


def test_empty_cache_matches_nothing_and_ends_at_the_root():
    cache = _cache()
    match = cache.match_prefix([1, 2, 3, 4])
    assert match.blocks == [] and match.node is cache.root


def test_a_lock_makes_the_whole_path_unevictable_until_unlocked():
    cache = _cache()
    _finished_request(cache, [1, 2, 3, 4])
    _finished_request(cache, [1, 2, 5, 6])  # [1, 2] -> {[3, 4], [5, 6]}
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    cache.lock(node)  # two requests hold it
    assert cache.num_evictable_blocks == 1  # only [5, 6]
    cache.unlock(node)
    assert cache.num_evictable_blocks == 1
    cache.unlock(node)
    assert cache.num_evictable_blocks == cache.num_cached_blocks == 3


def test_eviction_climbs_to_parents_that_become_leaves():
    cache = _cache()
    _finished_request(cache, [1, 2, 3, 4])
    _finished_request(cache, [1, 2, 5, 6])
    assert cache.evict(3) == 3
    assert edges(cache.root) == [] and cache.num_cached_blocks == 0
    assert cache.allocator.num_free == 32


def test_a_match_ending_inside_an_edge_splits_it_there():
    cache = _cache()
    _finished_request(cache, [1, 2, 3, 4, 5, 6])
    match = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert edges(cache.root) == [([1, 2, 3, 4], [([5, 6], [])])]
    assert match.node.key == (1, 2, 3, 4) and len(match.blocks) == 2


def test_insert_rejects_tokens_that_do_not_fill_the_blocks():
    with pytest.raises(ValueError, match="insert needs 4 token ids for 2 blocks of 2, got 3"):
        _cache().insert([1, 2, 3], [0, 1])


def test_unbalanced_unlock_is_refused():
    cache = _cache()
    _finished_request(cache, [1, 2])
    with pytest.raises(ValueError, match="unlock of a node that is not locked"):
        cache.unlock(cache.match_prefix([1, 2]).node)


def test_block_size_must_be_positive():
    with pytest.raises(ValueError, match="block_size must be at least 1, got 0"):
        RadixCache(0, BlockAllocator(4))
