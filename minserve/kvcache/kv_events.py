"""KV events: what an engine tells a router about the blocks it holds, tier by tier.

vLLM's KV events, small: an engine publishes a batch of events after each change to what
it caches, each batch with the next sequence number, so a subscriber that missed some can
ask for them again (`EventLog.since`). A block is named by its content key
(`block_key.py`), the same in the engine and the router, so the router's index of "who
holds what" is exact rather than guessed:

- `BlockStored(keys, parent, medium)`: blocks now held in `medium` ("device", "host",
  "disk"), in chain order; `parent` is the key before the first (None at a root);
- `BlockRemoved(keys, medium)`: blocks no longer held there;
- `AllBlocksCleared(medium)`: nothing is held there any more (a restart, a reset).

On the wire a batch is one JSON object (keys in hex): no pickle, any language can read it.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from minserve.kvcache.block_key import KEY_BYTES, BlockKey

MEDIA = ("device", "host", "disk")


@dataclass(frozen=True)
class BlockStored:
    keys: tuple[BlockKey, ...]
    parent: BlockKey | None
    medium: str


@dataclass(frozen=True)
class BlockRemoved:
    keys: tuple[BlockKey, ...]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    medium: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    """The events of one change, numbered: `seq` is one more than the batch before."""

    seq: int
    instance: str  # who published it
    events: tuple[KVEvent, ...]
    ts: float = field(default_factory=time.time)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "seq": self.seq,
                "instance": self.instance,
                "ts": self.ts,
                "events": [_event_json(e) for e in self.events],
            }
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> EventBatch:
        """A batch from its wire bytes; a ValueError names what is wrong."""
        try:
            raw = json.loads(data)
            events = tuple(_event_of(e) for e in raw["events"])
            return cls(int(raw["seq"]), str(raw["instance"]), events, float(raw["ts"]))
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"not a KV event batch: {error!r}") from None


def apply_event(held: dict[str, set[BlockKey]], event: KVEvent) -> None:
    """What a medium holds after `event` (the publisher's log and a router's index both
    keep their state this way)."""
    if isinstance(event, BlockStored):
        held[event.medium].update(event.keys)
    elif isinstance(event, BlockRemoved):
        held[event.medium].difference_update(event.keys)
    elif isinstance(event, AllBlocksCleared):
        held[event.medium].clear()


def _event_json(event: KVEvent) -> dict:
    if isinstance(event, BlockStored):
        parent = event.parent.hex() if event.parent is not None else None
        return {"type": "stored", "keys": [k.hex() for k in event.keys], "parent": parent,
                "medium": event.medium}  # fmt: skip
    if isinstance(event, BlockRemoved):
        return {"type": "removed", "keys": [k.hex() for k in event.keys], "medium": event.medium}
    return {"type": "cleared", "medium": event.medium}


def _event_of(raw: dict) -> KVEvent:
    medium = raw["medium"]
    if medium not in MEDIA:
        raise ValueError(f"an event's medium is one of {MEDIA}, got {medium!r}")
    if raw["type"] == "cleared":
        return AllBlocksCleared(medium)
    keys = tuple(_key(k) for k in raw["keys"])
    if raw["type"] == "stored":
        parent = _key(raw["parent"]) if raw["parent"] is not None else None
        return BlockStored(keys, parent, medium)
    if raw["type"] == "removed":
        return BlockRemoved(keys, medium)
    raise ValueError(f"an event's type is stored, removed or cleared, got {raw['type']!r}")


def _key(text: str) -> BlockKey:
    key = bytes.fromhex(text)
    if len(key) != KEY_BYTES:
        raise ValueError(f"a block key has {KEY_BYTES} bytes, got {len(key)}")
    return key


class EventLog:
    """The publisher's side: numbers each batch, keeps the last `capacity` for replay, and
    the state they add up to (`held`, per medium), for a snapshot."""

    def __init__(self, instance: str, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError(f"an event log keeps at least 1 batch, got {capacity}")
        self.instance = instance
        self.next_seq = 0
        self.held: dict[str, set[BlockKey]] = {medium: set() for medium in MEDIA}
        self._kept: deque[EventBatch] = deque(maxlen=capacity)

    def append(self, events: tuple[KVEvent, ...]) -> EventBatch:
        batch = EventBatch(self.next_seq, self.instance, events)
        self.next_seq += 1
        self._kept.append(batch)
        for event in events:
            apply_event(self.held, event)
        return batch

    def since(self, seq: int) -> list[EventBatch] | None:
        """The batches from `seq` on, or None when the log no longer holds `seq` (the
        subscriber must start over from a snapshot: `AllBlocksCleared` then a full state)."""
        if seq >= self.next_seq:
            return []
        if not self._kept or seq < self._kept[0].seq:
            return None
        return [b for b in self._kept if b.seq >= seq]

    def snapshot(self, held: dict[str, Iterable[BlockKey]] | None = None) -> EventBatch:
        """A batch that states everything held now, medium by medium (for a subscriber the
        log can no longer catch up): each medium cleared, then its blocks stored. `held`
        defaults to what the log's own batches add up to."""
        if held is None:
            held = {medium: sorted(keys) for medium, keys in self.held.items()}
        events: list[KVEvent] = []
        for medium in MEDIA:
            events.append(AllBlocksCleared(medium))
            keys = tuple(held.get(medium, ()))
            if keys:
                events.append(BlockStored(keys, None, medium))
        return self.append(tuple(events))
