"""Where a request goes next: the least-loaded live instance of the phase it needs.

Load is the number of requests an instance holds (as the proxy counts them), ties broken
by the free KV blocks it last reported, then by rank. A cache-aware rule (the longest
prefix an instance holds, weighed against its load) would plug in here.
"""

from __future__ import annotations

from collections import Counter


def least_loaded(ranks: list[int], held: Counter[int], free_blocks: dict[int, float]) -> int:
    """Fewest requests held, then most free KV blocks, then the lowest rank."""
    return min(ranks, key=lambda rank: (held[rank], -free_blocks.get(rank, 0), rank))
