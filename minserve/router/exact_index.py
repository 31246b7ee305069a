"""The router's exact index of the replicas' KV blocks, kept from their KV events.

Where `prefix_index.PrefixIndex` guesses a replica's cache from the prompts the router sent,
this index holds what each replica said it stores, per medium (device, host, disk), from
its numbered event batches (`kvcache/kv_events.py`). A batch applies only in order: one
that skips a number leaves the replica marked `behind` with the first missing number, and
the router asks the replica's log for the batches since then (`EventLog.since`); until
they arrive, the index keeps what it had and says so. A replica whose log no longer holds
the missing batches sends a snapshot instead (`EventLog.snapshot`): the index drops what
it had for that replica and takes the snapshot's state and number.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from minserve.kvcache.block_key import BlockKey
from minserve.kvcache.kv_events import MEDIA, EventBatch, apply_event


@dataclass
class ReplicaBlocks:
    """One replica's blocks by medium, and the next batch number the index expects."""

    held: dict[str, set[BlockKey]] = field(default_factory=lambda: {m: set() for m in MEDIA})
    next_seq: int = 0
    behind: int | None = None  # the first batch number missed, until it is replayed


# >>> exercise 11.3: an index kept from an event stream with gaps
class ExactIndex:
    """Per replica, per medium: the block keys it holds, exactly as its events said.

    `self.replicas[name]` is a `ReplicaBlocks`: `held[medium]` (a set of keys per medium of
    `MEDIA`), `next_seq` (the batch number expected next) and `behind` (the first number
    missed, until a replay fills the gap). `apply_event(held, event)` applies one event.
    Plug yours into the router with `build_router(config, KVAware(KVBlocks(n,
    index_cls=ExactIndex)))`.
    """

    def __init__(self, replicas: Sequence[str]) -> None:
        self.replicas = {name: ReplicaBlocks() for name in replicas}

    def apply(self, batch: EventBatch) -> bool:
        """Apply one batch in order; False (and the replica marked behind) on a gap. A batch
        already applied (a replay overlapping what arrived) is skipped (True). A gap keeps the
        *first* number missed in `behind`, however many batches arrive past it; a batch in
        order applies its events, moves `next_seq` on and clears `behind`."""
        # >>> solution
        replica = self.replicas[batch.instance]
        if batch.seq < replica.next_seq:
            return True
        if batch.seq > replica.next_seq:
            if replica.behind is None:
                replica.behind = replica.next_seq
            return False
        for event in batch.events:
            apply_event(replica.held, event)
        replica.next_seq = batch.seq + 1
        replica.behind = None
        return True
        # <<< solution

    def replay(self, instance: str, batches: Iterable[EventBatch]) -> None:
        """Catch up a replica with the batches since its gap (`EventLog.since`)."""
        for batch in batches:
            self.apply(batch)

    def resync(self, snapshot: EventBatch) -> None:
        """Start a replica over from its snapshot (its log lost the batches it missed): drop
        what the index held for it, then take the snapshot as the next batch in order."""
        # >>> solution
        fresh = ReplicaBlocks(next_seq=snapshot.seq)
        self.replicas[snapshot.instance] = fresh
        self.apply(snapshot)
        # <<< solution

    def reset(self, instance: str) -> None:
        """Start a replica over with nothing held, expecting batch 0 (it restarted, or the
        router begins to follow it)."""
        self.replicas[instance] = ReplicaBlocks()

    def forget(self, instance: str) -> None:
        """Stop indexing a replica (it publishes no events any more)."""
        self.replicas.pop(instance, None)

    def match(self, keys: Sequence[BlockKey]) -> dict[str, dict[str, int]]:
        """For each replica and medium, how many leading blocks of a prompt's `keys` it holds
        there (a prefix counts only while every block before it is held in that medium or
        a faster one: device, then host, then disk)."""
        return {name: self.match_one(name, keys) for name in self.replicas}

    def match_one(self, instance: str, keys: Sequence[BlockKey]) -> dict[str, int]:
        """For one replica, per medium of `MEDIA` (fastest first), how many leading `keys`
        it holds in that medium or a faster one: {"device": 2, "host": 3, "disk": 5} means
        blocks 0-1 are on the device, block 2 is on the host (or the device), blocks 3-4
        somewhere. A block held nowhere ends the prefix in every medium."""
        # >>> solution
        held, counts, reach, media = self.replicas[instance].held, {}, 0, []
        for medium in MEDIA:  # fastest first; a slower medium extends the faster ones
            media.append(held[medium])
            while reach < len(keys) and any(keys[reach] in blocks for blocks in media):
                reach += 1
            counts[medium] = reach
        return counts
        # <<< solution

    def blocks(self, instance: str, medium: str) -> set[BlockKey]:
        """A copy of what the index holds for one replica and medium."""
        return set(self.replicas[instance].held[medium])


# <<< exercise
