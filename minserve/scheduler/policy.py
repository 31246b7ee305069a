"""Scheduling policies, chosen by name: who is served first and who is preempted first.

A policy is a sort key. Sequences sorted by it are served front to back and preempted
back to front. A preempted sequence keeps its arrival time, so under FCFS it returns to
the front of the queue without any special case. "lpm" (longest prefix match,
`cache_aware.py`) ranks waiting requests by how much of their prompt is cached.
"""

from __future__ import annotations

from collections.abc import Callable

from minserve.kvcache.manager import KVCacheManager
from minserve.scheduler.cache_aware import LongestPrefixMatch
from minserve.scheduler.sequence import Sequence

# Three request classes, as vLLM-style priorities (lower is served first).
SLO_CLASSES = {"interactive": 0, "standard": 1, "batch": 2}

PolicyKey = Callable[[Sequence], tuple]


def fcfs(seq: Sequence) -> tuple:
    """First come, first served."""
    return (seq.arrival_time, seq.order)


def priority(seq: Sequence) -> tuple:
    """Lower `priority` first (SLO class), then first come, first served."""
    return (seq.priority, seq.arrival_time, seq.order)


POLICIES: dict[str, PolicyKey] = {"fcfs": fcfs, "priority": priority}


def get_policy(
    name: str | Callable[[KVCacheManager], PolicyKey], kv: KVCacheManager | None = None
) -> PolicyKey:
    """The policy called `name`; "lpm" needs the KV cache manager, whose prefix cache it reads.

    `name` may also be a class (or any callable) built from the KV cache manager, such as
    chapter 05's `LongestPrefixMatch` or `partial(LongestPrefixMatch, max_wait_s=60)`.
    """
    if callable(name):
        if kv is None:
            raise ValueError("a scheduling_policy class is built from the KV manager: pass it")
        return name(kv)
    if name == "lpm":
        if kv is None:
            raise ValueError("scheduling_policy 'lpm' reads the prefix cache: pass the KV manager")
        return LongestPrefixMatch(kv)
    if name not in POLICIES:
        names = ", ".join([*POLICIES, "lpm"])
        raise ValueError(f"unknown scheduling_policy {name!r}; choose one of {names}")
    return POLICIES[name]


def priority_value(value: int | str) -> int:
    """An int priority, or an SLO class name (interactive / standard / batch)."""
    if isinstance(value, str):
        if value not in SLO_CLASSES:
            raise ValueError(
                f"unknown SLO class {value!r}; choose one of {', '.join(SLO_CLASSES)} "
                "or give an integer priority (lower runs first)"
            )
        return SLO_CLASSES[value]
    return int(value)
