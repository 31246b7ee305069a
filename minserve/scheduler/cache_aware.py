"""Cache-aware scheduling: serve first the waiting requests whose prompt is cached the most.

SGLang's longest-prefix-match policy (Zheng et al., 2024). Under FCFS, requests that share
a system prompt arrive mixed with others; by the time the last of them runs, the prompt's
blocks may have been evicted to make room, and it is computed again. Ranking the queue by
cached prefix length runs the requests that hit the cache while their blocks are there,
which raises the hit rate when the pool cannot hold every prefix at once.

Taken alone, the rule starves a request that shares nothing with anyone: new arrivals
that hit the cache keep jumping ahead of it. The guard: a request that has waited longer
than `max_wait_s` goes ahead of every other, in arrival order.
"""

from __future__ import annotations

import time

from minserve.kvcache.manager import KVCacheManager
from minserve.scheduler.sequence import SeqStatus, Sequence

DEFAULT_MAX_WAIT_S = 10.0


# >>> exercise 5.1: longest-prefix-match scheduling
class LongestPrefixMatch:
    """A policy key (lower is served first): starved requests, then longest cached prefix,
    then first come, first served. Running and swapped sequences are ranked FCFS.

    Built from the KV cache manager: `LLM(enable_prefix_caching=True,
    scheduling_policy=LongestPrefixMatch)`. The scheduler sorts by `policy(seq)`.
    """

    def __init__(self, kv: KVCacheManager, max_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
        if kv.prefix_cache is None:
            raise ValueError(
                "scheduling_policy='lpm' ranks requests by their cached prefix; "
                "it needs enable_prefix_caching=True"
            )
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.kv = kv
        self.max_wait_s = max_wait_s

    def __call__(self, seq: Sequence) -> tuple:
        """The sort key of `seq`: (group, -cached tokens, seq.arrival_time, seq.order).

        Group 0 holds sequences that are not waiting (running, swapped: ranked FCFS, so
        put 0 for their cached tokens) and waiting ones that starved; group 1 the other
        waiting ones, the longest cached prefix first. Tuples compare left to right.
        """
        # >>> solution
        fcfs = (seq.arrival_time, seq.order)
        if seq.status is not SeqStatus.WAITING or self._starved(seq):
            return (0, 0, *fcfs)
        return (1, -self.cached_tokens(seq), *fcfs)
        # <<< solution

    def cached_tokens(self, seq: Sequence) -> int:
        """How many of the sequence's tokens the prefix cache holds now (whole blocks).

        A sequence that already holds blocks (a preempted one coming back) has picked up
        its prefix: count its computed tokens. Otherwise ask `self.kv.cached_tokens`.
        """
        # >>> solution
        if seq.block_table.blocks:  # it picked up its cached prefix already
            return seq.num_computed_tokens
        return self.kv.cached_tokens(seq.token_ids)
        # <<< solution

    def _starved(self, seq: Sequence) -> bool:
        """Waited longer than `max_wait_s` since it arrived (`time.monotonic()` seconds)."""
        # >>> solution
        return time.monotonic() - seq.arrival_time > self.max_wait_s
        # <<< solution


# <<< exercise
