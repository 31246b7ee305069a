"""The engine's side of KV events: what the prefix cache's tiers hold, as it changes.

A router that knows which blocks each replica holds routes a prompt to the replica that
has most of it (`router/exact_index.py`). The engine tells it, as vLLM's KV events do:
the prefix cache reports each change to this tracker, which names every block by its
content key (`block_key.py`) and turns the change into events (`kv_events.py`):

    radix tree caches blocks      -> BlockStored(keys, parent, "device")
    eviction frees cached blocks  -> BlockRemoved(keys, "device")
    host tier gains / loses keys  -> BlockStored / BlockRemoved(keys, "host")
    disk writes / evicts files    -> BlockStored / BlockRemoved(keys, "disk")

The tracker only watches: it changes nothing the cache decides, and the engine publishes
what it gathered once per step (`take`).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.block_key import BlockKey, block_keys
from minserve.kvcache.kv_events import BlockRemoved, BlockStored, KVEvent


class BlockEventTracker:
    """Content keys of the blocks each tier holds, and the events since the last `take`."""

    def __init__(
        self,
        root: BlockKey,
        block_size: int,
        keys_fn: Callable[[BlockKey, Sequence[int], int], list[BlockKey]] = block_keys,
    ) -> None:
        """`keys_fn`: how blocks are keyed, `block_key.block_keys` (or chapter 11's)."""
        self.root = root  # the engine's KV fingerprint: keys chain from it
        self.block_size = block_size
        self.keys_fn = keys_fn
        self._device: dict[int, BlockKey] = {}  # block the radix tree holds -> its key
        self._host: set[BlockKey] = set()  # keys with a copy in the host tier
        self._pending: list[KVEvent] = []

    def held(self, medium: str) -> set[BlockKey]:
        """A copy of the keys a medium holds now ("device" or "host")."""
        return set(self._device.values()) if medium == "device" else set(self._host)

    def key_of(self, block: int) -> BlockKey | None:
        """The key of a block the radix tree holds (None: the tree does not hold it)."""
        return self._device.get(block)

    def stored(self, tokens: Sequence[int], blocks: Sequence[int]) -> list[tuple[int, BlockKey]]:
        """The radix tree holds `blocks`, the KV of `tokens` from a prompt's start. The
        blocks it held before lead the list (a tree holds whole prefixes); key the others,
        chaining from the last known key, and report them stored on the device. Returns
        the blocks newly keyed, with their keys."""
        known = 0
        while known < len(blocks) and blocks[known] in self._device:
            known += 1
        if known == len(blocks):
            return []
        parent = self._device[blocks[known - 1]] if known else None
        size, chain = self.block_size, self.root if parent is None else parent
        keys = self.chain(chain, tokens[known * size : len(blocks) * size])
        self._device.update(zip(blocks[known:], keys, strict=True))
        self._pending.append(BlockStored(tuple(keys), parent, "device"))
        return list(zip(blocks[known:], keys, strict=True))

    def chain(self, parent: BlockKey, tokens: Sequence[int]) -> list[BlockKey]:
        """The keys of the full blocks of `tokens`, chained from `parent`."""
        return self.keys_fn(parent, tokens, self.block_size)

    def evicted(self, allocator: BlockAllocator) -> list[BlockKey]:
        """Eviction just ran: the tree's blocks that nothing references any more left the
        device. Reports them removed; returns their keys."""
        gone = [block for block in self._device if allocator.refcount(block) == 0]
        keys = [self._device.pop(block) for block in gone]
        if keys:
            self._pending.append(BlockRemoved(tuple(keys), "device"))
        return keys

    def host_changed(self, contains: Container[BlockKey], candidates: Sequence[BlockKey]) -> None:
        """The host tier demoted or promoted: `contains` answers `key in tier`; `candidates`
        are keys that may have arrived (the blocks just evicted). Reports the difference."""
        now = {key for key in self._host if key in contains}
        now.update(key for key in candidates if key in contains)
        left, arrived = self._host - now, [key for key in candidates if key in now - self._host]
        if left:
            self._pending.append(BlockRemoved(tuple(sorted(left)), "host"))
        if arrived:
            self._pending.append(BlockStored(tuple(dict.fromkeys(arrived)), None, "host"))
        self._host = now

    def disk_changed(self, written: Sequence[BlockKey], evicted: Sequence[BlockKey]) -> None:
        """The disk tier queued `written` and removed `evicted` for room."""
        if written:
            self._pending.append(BlockStored(tuple(written), None, "disk"))
        if evicted:
            self._pending.append(BlockRemoved(tuple(evicted), "disk"))

    def take(self) -> tuple[KVEvent, ...]:
        """The events gathered since the last call, in order."""
        events, self._pending = tuple(self._pending), []
        return events
