"""The router's shared view of its replicas' KV blocks: written by the feed's threads, read
by the `kv_aware` policy, one lock around both.

Replicas are named by their place in the router's list (as policies name them); each one
that publishes KV events is followed as the `KVEventSource` its `/v1/kv_events` named, and
its blocks live in an `ExactIndex` under that source's instance name. A replica that
publishes nothing has no source: the policy falls back to guessing for it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from minserve.kvcache.block_key import BlockKey
from minserve.kvcache.kv_events import EventBatch
from minserve.router.exact_index import ExactIndex
from minserve.router.kv_source import KVEventSource

CATCHUPS = ("replay", "resync", "reset")  # batches replayed, snapshot taken, started over


@dataclass(frozen=True)
class HeldPrefix:
    """How much of one prompt a replica holds, by its events: leading blocks per medium
    ("device", "host", "disk"; each count includes the faster media's blocks)."""

    block_size: int
    blocks: dict[str, int]


class KVBlocks:
    """Thread-safe: each replica's event source, its blocks by medium, its catch-up counts."""

    def __init__(self, num_replicas: int, index_cls: type = ExactIndex) -> None:
        """`index_cls`: a class shaped like `ExactIndex` (chapter 11's, say)."""
        self._lock = threading.Lock()
        self._index = index_cls([])
        self._sources: list[KVEventSource | None] = [None] * num_replicas
        self._first_ts: list[float | None] = [None] * num_replicas  # batch 0's: to spot a restart
        self._catchups = [Counter[str]() for _ in range(num_replicas)]

    @property
    def num_replicas(self) -> int:
        return len(self._sources)

    def attach(self, replica: int, source: KVEventSource) -> bool:
        """Follow `replica` as `source`. A source other than the one followed (the replica
        restarted) starts its blocks over. False when another replica already publishes
        under that instance name (the two could not be told apart)."""
        with self._lock:
            if source == self._sources[replica]:
                return True
            if any(s is not None and s.instance == source.instance
                   for i, s in enumerate(self._sources) if i != replica):  # fmt: skip
                return False
            if self._sources[replica] is not None:
                self._drop(replica)
                self._catchups[replica]["reset"] += 1
            self._sources[replica] = source
            self._index.reset(source.instance)
            return True

    def detach(self, replica: int) -> None:
        """`replica` publishes no KV events (any more): forget its blocks."""
        with self._lock:
            self._drop(replica)

    def apply(self, replica: int, batch: EventBatch) -> bool:
        """One published batch, in order; False on a gap (the feed then asks for a replay).
        Batch 0 again, not the one applied, means the replica's log restarted: start over."""
        with self._lock:
            instance = self._instance(replica)
            restarted = batch.seq == 0 and batch.ts != self._first_ts[replica]
            if restarted and self._index.replicas[instance].next_seq > 0:
                self._check(instance, batch)
                self._index.reset(instance)
                self._catchups[replica]["reset"] += 1
            return self._apply(replica, instance, batch)

    def catch_up(self, replica: int, kind: str, batches: Sequence[EventBatch]) -> None:
        """A replay's answer: the missed batches, or a snapshot of everything held now."""
        with self._lock:
            instance = self._instance(replica)
            if kind == "snapshot":
                self._check(instance, batches[0])
                self._index.resync(batches[0])
                self._catchups[replica]["resync"] += 1
                return
            before = self._index.replicas[instance].next_seq
            for batch in batches:
                self._apply(replica, instance, batch)
            if self._index.replicas[instance].next_seq > before:
                self._catchups[replica]["replay"] += 1

    def catchup_counts(self) -> list[Counter[str]]:
        """Per replica, how often its feed caught up, by kind (see CATCHUPS)."""
        with self._lock:
            return [Counter(c) for c in self._catchups]

    def next_seq(self, replica: int) -> int:
        """The batch number the index expects next from `replica`."""
        with self._lock:
            return self._index.replicas[self._instance(replica)].next_seq

    def source(self, replica: int) -> KVEventSource | None:
        with self._lock:
            return self._sources[replica]

    def roots(self) -> dict[BlockKey, int]:
        """Each followed replica's key root and its block size (a root fixes the size)."""
        with self._lock:
            return {s.root: s.block_size for s in self._sources if s is not None}

    def match(
        self, replica: int, block_keys: Mapping[BlockKey, Sequence[BlockKey]]
    ) -> HeldPrefix | None:
        """How much of a prompt `replica` holds, given the prompt's block keys per root;
        None when it publishes no events (nothing is known)."""
        with self._lock:
            source = self._sources[replica]
            if source is None:
                return None
            keys = block_keys.get(source.root, ())
            return HeldPrefix(source.block_size, self._index.match_one(source.instance, keys))

    def held(self, replica: int, medium: str) -> set[BlockKey]:
        """A copy of the blocks `replica` holds in `medium`, as far as its events said."""
        with self._lock:
            return self._index.blocks(self._instance(replica), medium)

    def _instance(self, replica: int) -> str:
        source = self._sources[replica]
        if source is None:
            raise KeyError(f"replica {replica} is not followed: it has no KV event source")
        return source.instance

    def _apply(self, replica: int, instance: str, batch: EventBatch) -> bool:
        self._check(instance, batch)
        if batch.seq == 0:
            self._first_ts[replica] = batch.ts
        return self._index.apply(batch)

    @staticmethod
    def _check(instance: str, batch: EventBatch) -> None:
        if batch.instance != instance:
            raise ValueError(
                f"a batch of {batch.instance!r} came from the publisher of {instance!r}: "
                "another publisher took its place"
            )

    def _drop(self, replica: int) -> None:
        source = self._sources[replica]
        if source is not None:
            self._index.forget(source.instance)
        self._sources[replica], self._first_ts[replica] = None, None
