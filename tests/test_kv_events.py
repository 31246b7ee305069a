"""KV events and the router's exact index: batches survive the wire, a subscriber that misses
batches catches up from the publisher's log (or its snapshot), and the index then equals
what the publisher holds, block for block and medium by medium."""

from __future__ import annotations

import random

import pytest

from minserve.kvcache.block_key import UNSHARED_ROOT, block_keys
from minserve.kvcache.kv_events import (
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventLog,
)
from minserve.router.exact_index import ExactIndex

KEYS = block_keys(UNSHARED_ROOT, list(range(400)), 4)  # 100 chained keys


def test_a_batch_survives_the_wire() -> None:
    batch = EventBatch(
        7,
        "replica-0",
        (
            BlockStored(tuple(KEYS[:3]), None, "device"),
            BlockStored((KEYS[3],), KEYS[2], "host"),
            BlockRemoved((KEYS[0],), "device"),
            AllBlocksCleared("disk"),
        ),
    )
    assert EventBatch.decode(batch.encode()) == batch


@pytest.mark.parametrize(
    "payload",
    [
        b'{"seq": 1, "instance": "r", "ts": 0, "events": [{"type": "stored", "keys": ["ab"], '
        b'"parent": null, "medium": "device"}]}',  # a key of one byte
        b'{"seq": 1, "instance": "r", "ts": 0, "events": [{"type": "cleared", "medium": "tape"}]}',
        b'{"seq": 1, "instance": "r", "ts": 0, "events": [{"type": "moved", "medium": "disk"}]}',
        b'{"instance": "r", "events": []}',
        b"[1, 2]",
    ],
    ids=["short key", "unknown medium", "unknown type", "no seq", "not an object"],
)
def test_a_malformed_batch_is_refused(payload: bytes) -> None:
    with pytest.raises(ValueError):
        EventBatch.decode(payload)


def test_the_log_replays_what_it_still_holds() -> None:
    log = EventLog("r", capacity=3)
    batches = [log.append((AllBlocksCleared("disk"),)) for _ in range(5)]
    assert [b.seq for b in batches] == [0, 1, 2, 3, 4]
    assert log.since(3) == batches[3:] and log.since(5) == [] and log.since(1) is None


class Replica:
    """A publisher standing in for an engine: what it holds per medium, and its log."""

    def __init__(self, name: str, capacity: int) -> None:
        self.held = {m: set() for m in MEDIA}
        self.log = EventLog(name, capacity)

    def change(self, rng: random.Random) -> EventBatch:
        medium = rng.choice(MEDIA)
        held = self.held[medium]
        if held and rng.random() < 0.4:
            gone = tuple(rng.sample(sorted(held), rng.randint(1, len(held))))
            held.difference_update(gone)
            return self.log.append((BlockRemoved(gone, medium),))
        if rng.random() < 0.05:
            held.clear()
            return self.log.append((AllBlocksCleared(medium),))
        start = rng.randrange(len(KEYS) - 5)
        new = tuple(KEYS[start : start + rng.randint(1, 5)])
        held.update(new)
        parent = KEYS[start - 1] if start else None
        return self.log.append((BlockStored(new, parent, medium),))


@pytest.mark.parametrize("seed", range(5))
def test_the_index_equals_the_replicas_blocks_after_lost_batches(seed: int) -> None:
    rng = random.Random(seed)
    replicas = {"a": Replica("a", capacity=30), "b": Replica("b", capacity=4)}
    index = ExactIndex(list(replicas))
    caught_up = {"replay": 0, "resync": 0}
    for _ in range(600):
        replica = replicas[rng.choice("ab")]
        batch = replica.change(rng)
        if rng.random() < 0.15:
            continue  # lost on the way
        if not index.apply(batch) and rng.random() < 0.2:  # a gap, noticed now or later
            behind = index.replicas[batch.instance].behind
            assert behind is not None
            replay = replica.log.since(behind)
            if replay is None:  # the log let them go: the replica sends its state
                index.resync(replica.log.snapshot(replica.held))
                caught_up["resync"] += 1
            else:
                index.replay(batch.instance, replay)
                caught_up["replay"] += 1
            assert index.replicas[batch.instance].behind is None
    assert caught_up["replay"] > 0 and caught_up["resync"] > 0, caught_up
    for name, replica in replicas.items():  # a last catch-up
        missed = replica.log.since(index.replicas[name].next_seq)
        if missed is None:
            index.resync(replica.log.snapshot(replica.held))
        else:
            index.replay(name, missed)
        for medium in MEDIA:
            assert index.blocks(name, medium) == replica.held[medium], (seed, name, medium)


def test_a_snapshot_rebuilds_a_restarted_replica() -> None:
    replica = Replica("a", capacity=2)
    index = ExactIndex(["a"])
    for batch in (replica.change(random.Random(i)) for i in range(10)):
        index.apply(batch)
    replica.held = {"device": set(KEYS[:2]), "host": set(), "disk": set()}  # after a restart
    index.resync(replica.log.snapshot(replica.held))
    assert index.blocks("a", "device") == set(KEYS[:2]) and index.blocks("a", "disk") == set()


def test_match_counts_leading_blocks_through_the_faster_media() -> None:
    index = ExactIndex(["a", "b"])
    log_a, log_b = EventLog("a"), EventLog("b")
    index.apply(log_a.append((BlockStored(tuple(KEYS[:2]), None, "device"),)))
    index.apply(log_a.append((BlockStored(tuple(KEYS[2:4]), KEYS[1], "host"),)))
    index.apply(log_a.append((BlockStored((KEYS[5],), KEYS[4], "disk"),)))  # a hole at 4
    index.apply(log_b.append((BlockStored(tuple(KEYS[:6]), None, "disk"),)))
    got = index.match(KEYS[:6])
    assert got["a"] == {"device": 2, "host": 4, "disk": 4}
    assert got["b"] == {"device": 0, "host": 0, "disk": 6}


def test_over_zmq_a_late_subscriber_catches_up_by_replay_and_by_snapshot() -> None:
    """PUB/SUB drops what a subscriber was not there for; the replay socket fills the gap."""
    from minserve.kvcache.kv_event_socket import KVEventPublisher, KVEventSubscriber

    held = {"device": set(KEYS[:3]), "host": set(), "disk": set()}
    publisher = KVEventPublisher(EventLog("a", capacity=4), lambda: held)
    first = publisher.publish((BlockStored(tuple(KEYS[:3]), None, "device"),))  # nobody hears
    subscriber = KVEventSubscriber("127.0.0.1", publisher.port, publisher.replay_port)
    index = ExactIndex(["a"])
    try:
        received = None
        for i in range(200):  # a SUB socket joins after a moment: publish until one arrives
            received = subscriber.receive(timeout_ms=20)
            if received is not None:
                break
            held["host"].add(KEYS[10 + i % 50])
            publisher.publish((BlockStored((KEYS[10 + i % 50],), None, "host"),))
        assert received is not None and received.seq > first.seq
        assert not index.apply(received)  # batch 0 was never heard: a gap
        kind, batches = subscriber.replay(index.replicas["a"].behind)
        if kind == "snapshot":
            index.resync(batches[0])
        else:
            index.replay("a", batches)
        while (more := subscriber.receive(timeout_ms=50)) is not None:
            index.apply(more)
        for medium in MEDIA:
            assert index.blocks("a", medium) == held[medium]
        assert subscriber.replay(publisher.log.next_seq) == ("batches", [])  # nothing new
        for key in KEYS[60:65]:  # more batches than the log keeps: batch 0 is gone
            held["disk"].add(key)
            publisher.publish((BlockStored((key,), None, "disk"),))
        kind, (snapshot,) = subscriber.replay(0)
        fresh = ExactIndex(["a"])
        fresh.resync(snapshot)
        assert kind == "snapshot" and all(fresh.blocks("a", m) == held[m] for m in MEDIA)
        subscriber._replay.send(b"{}")  # a request without "since"
        assert subscriber._replay.poll(5000) and subscriber._replay.recv_multipart()[0] == b"error"
    finally:
        subscriber.close()
        publisher.close()
