"""Routing policies: which replica gets the next request.

    round_robin   replicas in turn; the baseline, blind to caches and load
    cache_aware   SGLang's cache-aware routing: the replica expected to hold the longest
                  prefix of the prompt, unless it is busier than the least-loaded replica
                  by more than `balance_threshold` requests; then the least-loaded one
    kv_aware      the lowest estimated time to first token, from the blocks each replica
                  says it caches (its KV events; `kv_aware.py`), with sticky sessions

Load is requests in flight through the router. A policy sees only the replicas that are up
(`candidates`) and is told, by `record`, where each request went. A key policy reads the
prompt's key alone (`choose`, `record`); a request policy reads the whole `RouteRequest`
(`choose_request`, `record_request`: token ids, session, block keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from minserve.router.prefix_index import Key, PrefixIndex
from minserve.router.route_request import RouteRequest

if TYPE_CHECKING:
    from minserve.router.kv_aware import KVAwareConfig
    from minserve.router.kv_blocks import KVBlocks

POLICIES = ("round_robin", "cache_aware", "kv_aware")


@dataclass(frozen=True)
class Decision:
    """Where a request goes, why, and how much of its prompt that replica should hold."""

    replica: int
    reason: str  # "round_robin", "prefix", "least_loaded" (no prefix known), "balance",
    # and kv_aware's "kv" and "session"
    matched: int = 0  # leading prompt units (characters or tokens) expected cached there
    blocks: dict[str, int] = field(default_factory=dict)  # kv_aware: blocks expected, by medium


class Policy(Protocol):
    name: str

    def choose(self, key: Key | None, loads: Sequence[int], candidates: Sequence[int]) -> Decision:
        """Pick one of `candidates` (indices of replicas that are up); `loads[i]` is in flight."""
        ...

    def record(self, key: Key | None, replica: int) -> None:
        """`key` was sent to `replica`."""
        ...


@runtime_checkable
class RequestPolicy(Protocol):
    """A policy that reads more of a request than its key (kv_aware)."""

    name: str

    def choose_request(
        self, request: RouteRequest, loads: Sequence[int], candidates: Sequence[int]
    ) -> Decision:
        """`choose`, from the whole request."""
        ...

    def record_request(self, request: RouteRequest, replica: int) -> None:
        """`request` was sent to `replica`."""
        ...


class ByKey:
    """A key policy seen as a request policy: it is handed the request's key alone."""

    def __init__(self, policy: Policy) -> None:
        self.policy, self.name = policy, policy.name

    def choose_request(
        self, request: RouteRequest, loads: Sequence[int], candidates: Sequence[int]
    ) -> Decision:
        return self.policy.choose(request.key, loads, candidates)

    def record_request(self, request: RouteRequest, replica: int) -> None:
        self.policy.record(request.key, replica)


def as_request_policy(policy: Policy | RequestPolicy) -> RequestPolicy:
    """The one interface the router calls: request policies as they are, key policies wrapped."""
    return policy if isinstance(policy, RequestPolicy) else ByKey(policy)


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
    capacity: int = 65536, blocks: KVBlocks | None = None, kv_config: KVAwareConfig | None = None,
) -> Policy | RequestPolicy:  # fmt: skip
    """A policy by name (see POLICIES). kv_aware reads `blocks`, which a `KVFeed` fills."""
    if name == "round_robin":
        return RoundRobin()
    if name == "cache_aware":
        return CacheAware(PrefixIndex(num_replicas, chunk_size, capacity), balance_threshold)
    if name == "kv_aware":
        from minserve.router.kv_aware import KVAware, KVAwareConfig  # it builds on this module

        if blocks is None:
            raise ValueError("kv_aware routes from the replicas' KV events: give make_policy the "
                             "KVBlocks a KVFeed fills (build_router does)")  # fmt: skip
        guesses = PrefixIndex(num_replicas, chunk_size, capacity)
        return KVAware(blocks, kv_config or KVAwareConfig(), guesses)
    raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
