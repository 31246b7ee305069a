"""One set of metrics for a disaggregated cluster: the instances' stats, added up.

Each instance reports its engine's `get_metrics()` every round. Pools and queues add up
(blocks, free blocks, running, waiting, preemptions); ratios are recomputed from the
sums; request and token counts come from the proxy, which sees each request once
(an instance would count a request twice: once prefilled, once decoded).
"""

from __future__ import annotations

from collections import Counter

FROM_PROXY = ("prompt_tokens", "generation_tokens", "num_requests_finished",
              "num_requests_aborted", "num_requests_resumed", "num_steps")  # fmt: skip
HIGHEST = ("kv_cache_usage_peak", "block_size")


def merge_stats(
    instances: dict[int, dict[str, float]], proxy: Counter[str], queued: int, num_alive: int
) -> dict[str, float]:
    """Sums over `instances` (rank -> stats), the proxy's counters, `queued` adds not sent."""
    total: dict[str, float] = {}
    for stats in instances.values():
        for key, value in stats.items():
            total[key] = total.get(key, 0) + value
    for key in HIGHEST:
        total[key] = max((stats.get(key, 0) for stats in instances.values()), default=0)
    blocks, free = total.get("num_blocks", 0), total.get("num_free_blocks", 0)
    total["kv_cache_usage"] = 1 - free / blocks if blocks else 0.0
    queries = total.get("prefix_cache_queries", 0)
    total["prefix_cache_hit_rate"] = total.get("prefix_cache_hits", 0) / queries if queries else 0.0
    total["num_requests_waiting"] = total.get("num_requests_waiting", 0) + queued
    total.update({key: proxy[key] for key in FROM_PROXY})
    total["num_instances_alive"] = num_alive
    return total
