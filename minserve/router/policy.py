"""Routing policies: which replica gets the next request.

    round_robin   replicas in turn; the baseline, blind to caches and load
    cache_aware   SGLang's cache-aware routing: the replica expected to hold the longest
                  prefix of the prompt, unless it is busier than the least-loaded replica
                  by more than `balance_threshold` requests; then the least-loaded one

Load is requests in flight through the router. A policy sees only the replicas that are up
(`candidates`) and is told, by `record`, where each request went.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from minserve.router.prefix_index import Key, PrefixIndex

POLICIES = ("round_robin", "cache_aware")


@dataclass(frozen=True)
class Decision:
    """Where a request goes, why, and how much of its prompt that replica should hold."""

    replica: int
    reason: str  # "round_robin", "prefix", "least_loaded" (no prefix known) or "balance"
    matched: int = 0  # leading prompt units (characters or tokens) expected cached there


class Policy(Protocol):
    name: str

    def choose(self, key: Key | None, loads: Sequence[int], candidates: Sequence[int]) -> Decision:
        """Pick one of `candidates` (indices of replicas that are up); `loads[i]` is in flight."""
        ...

    def record(self, key: Key | None, replica: int) -> None:
        """`key` was sent to `replica`."""
        ...


class _Turns:
    """A rotating start, so ties (equal loads, round-robin) spread over the replicas."""

    def __init__(self) -> None:
        self._next = 0

    def order(self, candidates: Sequence[int]) -> list[int]:
        start = self._next % len(candidates)
        self._next += 1
        return [*candidates[start:], *candidates[:start]]


class RoundRobin:
    """Each replica in turn (skipping those that are down)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, key: Key | None, loads: Sequence[int], candidates: Sequence[int]) -> Decision:
        return Decision(self._turns.order(candidates)[0], "round_robin")

    def record(self, key: Key | None, replica: int) -> None:
        pass


# >>> exercise 9.3: cache-aware routing
class CacheAware:
    """Longest expected prefix match, balanced against load (SGLang's cache-aware router)."""

    name = "cache_aware"

    def __init__(self, index: PrefixIndex, balance_threshold: int = 4) -> None:
        if balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0, got {balance_threshold}")
        self.index, self.balance_threshold = index, balance_threshold
        self._turns = _Turns()

    def choose(self, key: Key | None, loads: Sequence[int], candidates: Sequence[int]) -> Decision:
        """The replica for a request with prompt `key`, among `candidates` (those up).

        `self.index.match(key)` says, per replica, how many leading prompt units it is
        expected to hold. Send the request to the candidate with the longest match (ties:
        the less loaded), reason "prefix", unless it is busier than the least-loaded
        candidate by more than `balance_threshold` requests: then to that least-loaded one,
        reason "balance", with the match it has. Nothing matched anywhere (or no key): the
        least-loaded, reason "least_loaded". Break ties in load by `self._turns.order`
        (a rotating start, so that equal replicas take turns).
        """
        # >>> solution
        least = min(self._turns.order(candidates), key=lambda r: loads[r])
        matched = self.index.match(key) if key is not None else [0] * len(loads)
        # longest match; among equal matches, the less loaded
        best = max(candidates, key=lambda r: (matched[r], -loads[r]))
        if matched[best] == 0:
            return Decision(least, "least_loaded")
        if loads[best] - loads[least] > self.balance_threshold:
            return Decision(least, "balance", matched[least])
        return Decision(best, "prefix", matched[best])
        # <<< solution

    def record(self, key: Key | None, replica: int) -> None:
        if key is not None:
            self.index.insert(key, replica)


# <<< exercise


def make_policy(
    name: str, num_replicas: int, balance_threshold: int = 4, chunk_size: int = 16,
    capacity: int = 65536,
) -> Policy:  # fmt: skip
    """A policy by name (see POLICIES)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "cache_aware":
        return CacheAware(PrefixIndex(num_replicas, chunk_size, capacity), balance_threshold)
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
