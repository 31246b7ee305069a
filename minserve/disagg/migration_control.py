"""The proxy's side of live migration: orders, the migrations in flight, their outcomes.

`DisaggregatedEngine.migrate` and `drain` (from any thread: the server's admin routes)
place orders; each round takes them, lists every migration in flight in the commands of
its two decode ranks (one global order), and settles what the two reported. The source's
word decides while it lives: committed moves the request to the destination; aborted
leaves it where it was (and a destination that committed anyway is told to drop it). With
the source dead, the destination's commit decides; with neither, the request is resumed
elsewhere like any other on a dead instance.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minserve.disagg.migration import MigrationOrder, StagePolicy
from minserve.disagg.token_deltas import RemoteRequest

Requests = dict[str, RemoteRequest]  # the proxy's requests in flight, by id

MAX_OUTCOMES = 1024  # the most recent migrations' outcomes kept for inspection


class UnknownRequestError(LookupError):
    """No request with that id is in flight (HTTP 404)."""


class UnknownInstanceError(ValueError):
    """The rank named is not a decode instance of this cluster (HTTP 400)."""


class MigrationConflictError(RuntimeError):
    """The migration or drain cannot start now; the message says why (HTTP 409)."""


@dataclass
class MigrationStats:
    """Counters for `get_metrics()`."""

    started: int = 0
    committed: int = 0
    aborted: int = 0
    blocks_precopied: int = 0  # sent by pre-copy stages, while the source decoded
    blocks_final: int = 0  # sent by final stages, while the request waited
    pause_s_total: float = 0.0  # the final stages' seconds, on the sources
    pause_s_last: float = 0.0

    def as_metrics(self) -> dict[str, float]:
        return {
            "num_migrations_started": self.started,
            "num_migrations_committed": self.committed,
            "num_migrations_aborted": self.aborted,
            "migration_blocks_precopied": self.blocks_precopied,
            "migration_blocks_final": self.blocks_final,
            "migration_pause_seconds_total": self.pause_s_total,
            "migration_pause_seconds_last": self.pause_s_last,
        }


class MigrationControl:
    """Orders placed from any thread; the migrations in flight, settled round by round.

    The proxy's state comes in as arguments (`requests`, `alive`): read, never written,
    so the orders' checks may run beside a round."""

    def __init__(self, decode_ranks: tuple[int, ...]) -> None:
        self.decode_ranks = decode_ranks
        self.active: dict[str, MigrationOrder] = {}
        self.draining: set[int] = set()
        self.stats = MigrationStats()
        self.outcomes: OrderedDict[str, str] = OrderedDict()  # "committed" or "aborted: why"
        self._orders: list[MigrationOrder] = []
        self._lock = threading.Lock()

    # --- orders (any thread) ---

    def order(
        self, requests: Requests, alive: set[int], request_id: str, to_rank: int,
        policy: StagePolicy,
    ) -> int:  # fmt: skip
        """Queue a migration of `request_id` to `to_rank` for the next round; its source."""
        request = requests.get(request_id)
        if request is None:
            raise UnknownRequestError(f"no request {request_id!r} is in flight")
        self._check_rank(to_rank, alive)
        source = request.location
        if source not in self.decode_ranks:
            raise MigrationConflictError(
                f"request {request_id!r} is not decoding yet (it is on prefill rank {source}); "
                f"migrate it once it decodes"
            )
        if source == to_rank:
            raise MigrationConflictError(f"request {request_id!r} is on rank {to_rank} already")
        with self._lock:
            queued = {o.request_id for o in self._orders}
            if request_id in self.active or request_id in queued:
                raise MigrationConflictError(f"request {request_id!r} is migrating already")
            self._orders.append(MigrationOrder(request_id, source, to_rank, policy))
        return source

    def drain(self, requests: Requests, alive: set[int], rank: int) -> list[str]:
        """Mark `rank` draining (each round moves what it holds); the requests it holds."""
        self._check_rank(rank, alive)
        others = [r for r in self.decode_ranks if r in alive and r != rank]
        if all(r in self.draining for r in others):
            raise MigrationConflictError(
                f"decode rank {rank} cannot be drained: no other live decode instance takes "
                f"requests"
            )
        self.draining.add(rank)
        return [r for r, request in dict(requests).items() if request.location == rank]

    def undrain(self, alive: set[int], rank: int) -> None:
        self._check_rank(rank, alive)
        self.draining.discard(rank)

    def _check_rank(self, rank: int, alive: set[int]) -> None:
        if rank not in self.decode_ranks:
            raise UnknownInstanceError(
                f"rank {rank} is not a decode instance; decode ranks: {list(self.decode_ranks)}"
            )
        if rank not in alive:
            raise MigrationConflictError(f"decode rank {rank} is dead")

    # --- the rounds (the thread that steps) ---

    @property
    def busy(self) -> bool:
        """Migrations in flight or ordered: the rounds must go on until they are settled."""
        return bool(self.active or self._orders)

    def start_round(
        self, requests: Requests, alive: set[int], least_loaded: Callable[[list[int]], int]
    ) -> None:
        """Start the orders placed since the last round (those still valid) and a migration
        of every request still on a draining instance (to the least loaded of the others)."""
        self.forget_ranks(set(self.decode_ranks) - alive)
        with self._lock:
            orders, self._orders = self._orders, []
        for order in orders:
            why_not = self._why_not(order, requests, alive)
            if why_not:
                self._remember(order.request_id, f"aborted: {why_not}")  # never started
            else:
                self._start(order)
        live = [r for r in self.decode_ranks if r in alive]
        for rank in sorted(self.draining & alive):
            targets = [r for r in live if r != rank and r not in self.draining]
            staying = [r for r, q in requests.items() if q.location == rank]
            for request_id in staying if targets else []:
                order = MigrationOrder(request_id, rank, least_loaded(targets))
                if not self._why_not(order, requests, alive):
                    self._start(order)

    def _why_not(self, order: MigrationOrder, requests: Requests, alive: set[int]) -> str:
        """Why an order cannot start in this round ("" if it can)."""
        request = requests.get(order.request_id)
        if request is None:
            return "the request finished or was aborted before it moved"
        if request.location != order.source:
            return f"the request left rank {order.source} before it moved"
        if order.target not in alive:
            return f"decode rank {order.target} died"
        return "migrating already" if order.request_id in self.active else ""

    def _start(self, order: MigrationOrder) -> None:
        self.active[order.request_id] = order
        self.stats.started += 1

    def commands(self, rank: int) -> list[dict[str, Any]]:
        """The migrations `rank` sends or receives this round, in the one global order."""
        mine = [o for o in self.active.values() if rank in (o.source, o.target)]
        mine.sort(key=lambda o: (o.source, o.target, o.request_id))
        return [o.to_json() for o in mine]

    def settle(
        self, reports: dict[int, dict[str, Any]]
    ) -> tuple[dict[str, int], list[tuple[int, str]]]:
        """Apply the round's outcomes (`reports`: the live ranks' reports).

        Returns the requests that moved ({request id: destination}) and the (rank, request
        id) pairs to abort: destinations holding a request whose source kept it."""
        seen = {
            rank: {o["id"]: o for o in report.get("migrations", [])}
            for rank, report in reports.items()
        }
        moved: dict[str, int] = {}
        drop: list[tuple[int, str]] = []
        for request_id, order in list(self.active.items()):
            source = seen[order.source].get(request_id) if order.source in seen else None
            target = seen[order.target].get(request_id) if order.target in seen else None
            says, reason = _verdict(order, source, target, order.source in seen)
            if says == "aborted" and target and target["outcome"] == "committed":
                drop.append((order.target, request_id))  # the source kept it: one copy only
            self._record(request_id, says, source or target or {}, reason)
            if says == "committed":
                moved[request_id] = order.target
        return moved, drop

    def _record(self, request_id: str, says: str, outcome: dict[str, Any], reason: str) -> None:
        stats = self.stats
        if says == "stage":
            stats.blocks_precopied += outcome.get("blocks", 0)
            return
        del self.active[request_id]
        if says == "committed":
            stats.committed += 1
            stats.blocks_final += outcome.get("blocks", 0)
            stats.pause_s_last = outcome.get("pause_s", 0.0)
            stats.pause_s_total += stats.pause_s_last
            self._remember(request_id, "committed")
        else:
            stats.aborted += 1
            self._remember(request_id, f"aborted: {reason}")

    def _remember(self, request_id: str, outcome: str) -> None:
        self.outcomes[request_id] = outcome
        self.outcomes.move_to_end(request_id)
        while len(self.outcomes) > MAX_OUTCOMES:
            self.outcomes.popitem(last=False)

    def forget_ranks(self, dead: set[int]) -> None:
        """A migration whose source or destination died before its round: aborted."""
        for request_id, order in list(self.active.items()):
            if order.source in dead or order.target in dead:
                self._record(request_id, "aborted", {}, "an instance died before its stage")


def _verdict(
    order: MigrationOrder, source: dict | None, target: dict | None, source_alive: bool
) -> tuple[str, str]:
    """One migration's round, from what each side reported (None: nothing, it died):
    ("stage" | "committed" | "aborted", why it aborted)."""
    if not source_alive:  # the destination's commit decides
        if target and target["outcome"] == "committed":
            return "committed", ""
        return "aborted", f"the source, decode rank {order.source}, died"
    if source is None:
        return "aborted", f"decode rank {order.source} reported nothing of it"
    if source["outcome"] == "stage" and not (target and target["outcome"] == "stage"):
        why = target["reason"] if target else f"the destination, decode rank {order.target}, died"
        return "aborted", why  # the source forgets it next round: it is no longer listed
    return source["outcome"], source["reason"]
