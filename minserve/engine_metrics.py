"""The engine's counters and the metrics it reports (`LLMEngine.get_metrics()`, /metrics).

Counters are totals since the engine started; gauges (running, waiting, KV usage) are read
when asked. Names follow vLLM's where it has one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from minserve.kvcache.disk_tier import DiskTier
from minserve.kvcache.manager import KVCacheManager
from minserve.scheduler.scheduler import Scheduler, SchedulerStats
from minserve.scheduler.step_time import StepTimeScheduler
from minserve.step_timings import StepTimings


@dataclass
class EngineCounters:
    """Totals since the engine started (`get_metrics()`)."""

    num_steps: int = 0
    num_prompt_requests: int = 0
    num_prompt_tokens: int = 0
    num_batched_tokens: int = 0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    kv_usage_peak: float = 0.0


def engine_metrics(
    counters: EngineCounters, scheduler: Scheduler, kv: KVCacheManager, timings: StepTimings
) -> dict[str, float]:
    """Engine counters and gauges: requests, preemptions and swaps, tokens, KV usage, the
    prefix cache, speculative decoding, where step time went and, with a step-time target,
    the step cost model and the prefill rate."""
    stats, swap = scheduler.stats, kv.swap
    return {
        "num_steps": counters.num_steps,
        "num_requests_running": len(scheduler.running),
        "num_requests_waiting": len(scheduler.waiting),
        "num_requests_swapped": len(scheduler.swapped),
        "num_requests_finished": counters.num_requests_finished,
        "num_requests_aborted": counters.num_requests_aborted,
        "num_preemptions": stats.num_preemptions,
        "num_swapped_out": stats.num_swapped_out,
        "num_swapped_in": stats.num_swapped_in,
        "swap_bytes_out": swap.bytes_out if swap else 0,
        "swap_bytes_in": swap.bytes_in if swap else 0,
        "prompt_tokens": counters.num_prompt_tokens,
        "generation_tokens": stats.num_generation_tokens,
        "batched_tokens": counters.num_batched_tokens,
        "kv_cache_usage": kv.usage,
        "kv_cache_usage_peak": counters.kv_usage_peak,
        "num_blocks": kv.allocator.num_blocks,
        "num_free_blocks": kv.allocator.num_free,
        "block_size": kv.block_size,
        **prefix_cache_metrics(stats, kv),
        **(scheduler.drafts.metrics() if scheduler.drafts is not None else {}),
        **(scheduler.step_time_metrics() if isinstance(scheduler, StepTimeScheduler) else {}),
        **{f"step_seconds_{name}": value for name, value in asdict(timings).items()},
    }


def prefix_cache_metrics(stats: SchedulerStats, kv: KVCacheManager) -> dict[str, float]:
    """vLLM's prefix_cache_queries / _hits (prompt tokens), the hit rate, and our upkeep."""
    queries, hits = stats.num_prefix_cache_queries, stats.num_prefix_cache_hits
    cache, prefix = kv.prefix_cache, kv.prefix
    upkeep = prefix.stats if prefix else None
    host = prefix.host if prefix else None
    return {
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefix_cache_preempted_queries": stats.num_preempted_cache_queries,
        "prefix_cache_preempted_hits": stats.num_preempted_cache_hits,
        "prefix_cache_blocks": cache.num_cached_blocks if cache else 0,
        "prefix_cache_evictable_blocks": prefix.num_evictable_blocks if prefix else 0,
        "prefix_cache_evicted_blocks": upkeep.evicted_blocks if upkeep else 0,
        "prefix_cache_upkeep_seconds": upkeep.upkeep_seconds if upkeep else 0.0,
        "prefix_cache_promoted_blocks": upkeep.promoted_blocks if upkeep else 0,
        "host_tier_bytes_out": host.bytes_demoted if host else 0,
        "host_tier_bytes_in": host.bytes_promoted if host else 0,
        **disk_tier_metrics(prefix.disk if prefix else None),
    }


def disk_tier_metrics(disk: DiskTier | None) -> dict[str, float]:
    """The disk tier: blocks written through and loaded back, bytes, time spent loading."""
    stats = disk.stats if disk else None
    return {
        "disk_tier_blocks_written": stats.blocks_written if stats else 0,
        "disk_tier_blocks_loaded": stats.blocks_loaded if stats else 0,
        "disk_tier_bytes_in": stats.bytes_loaded if stats else 0,
        "disk_tier_bytes_out": disk.store.stats.bytes_written if disk else 0,
        "disk_tier_load_seconds": stats.load_seconds if stats else 0.0,
        "disk_tier_bytes": disk.store.nbytes if disk else 0,
    }
