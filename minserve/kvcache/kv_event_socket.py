"""KV events over ZMQ: a publisher with a replay socket, and a subscriber that uses it.

The publisher sends each batch (`kv_events.EventBatch`) on a PUB socket as two frames,
the topic "kv" and the batch's JSON, and answers replay requests on a ROUTER socket from
its `EventLog`: a request names the first batch number wanted, the answer is every batch
from there (or a snapshot, when the log no longer holds it). PUB/SUB drops messages when a
subscriber is slow or joins late; the numbers show the gap, and the replay fills it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterable

import zmq

from minserve.config import KVEventsConfig
from minserve.kvcache.block_key import BlockKey
from minserve.kvcache.kv_events import MEDIA, AllBlocksCleared, EventBatch, EventLog, KVEvent

TOPIC = b"kv"
_POLL_MS = 50


class KVEventPublisher:
    """Publishes an engine's event batches and serves replays of its log."""

    def __init__(
        self,
        log: EventLog,
        snapshot: Callable[[], dict[str, Iterable[BlockKey]]] | None = None,
        host: str = "127.0.0.1",
        ports: tuple[int, int] = (0, 0),
    ) -> None:
        """`snapshot()` returns what is held now, per medium, for a subscriber the log can
        no longer catch up (default: what the log's batches add up to). `ports`: the PUB
        and replay ports to bind on `host` (0: any free port)."""
        self.log, self._snapshot = log, snapshot
        self.host = host
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self.port = _bind(self._pub, host, ports[0])
        self._replay = self._context.socket(zmq.ROUTER)
        self.replay_port = _bind(self._replay, host, ports[1])
        self._lock = threading.Lock()  # the log and the PUB socket: publish and replay
        self._stop = threading.Event()
        self._server = threading.Thread(target=self._serve, name="kv-replay", daemon=True)
        self._server.start()

    def publish(self, events: tuple[KVEvent, ...]) -> EventBatch:
        """Number `events` as the next batch, keep it for replay, and send it."""
        with self._lock:
            batch = self.log.append(events)
            self._pub.send_multipart([TOPIC, batch.encode()])
        return batch

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            client, request = self._replay.recv_multipart()
            with self._lock:
                answer = self._answer(request)
            self._replay.send_multipart([client, *answer])

    def _answer(self, request: bytes) -> list[bytes]:
        try:
            since = int(json.loads(request)["since"])
        except (ValueError, KeyError, TypeError):
            return [b"error", b'a replay request is {"since": N}']
        batches = self.log.since(since)
        if batches is None:
            held = self._snapshot() if self._snapshot is not None else None
            return [b"snapshot", self.log.snapshot(held).encode()]
        return [b"batches", *(b.encode() for b in batches)]

    def close(self) -> None:
        self._stop.set()
        self._server.join()
        self._context.destroy(linger=0)


def kv_event_publisher(config: KVEventsConfig | None) -> KVEventPublisher | None:
    """An engine's publisher, as `kv_events_config` says (None: events off). Its log opens
    with every medium cleared, so a subscriber of a restarted engine starts over."""
    if config is None:
        return None
    instance = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    host, ports = config.address()
    publisher = KVEventPublisher(EventLog(instance, config.buffer_steps), None, host, ports)
    publisher.publish(tuple(AllBlocksCleared(medium) for medium in MEDIA))
    return publisher


def _bind(sock: zmq.Socket, host: str, port: int) -> int:
    """Bind `sock` on `host`, at `port` or (0) any free one; the port bound."""
    if port == 0:
        return sock.bind_to_random_port(f"tcp://{host}")
    sock.bind(f"tcp://{host}:{port}")
    return port


class KVEventSubscriber:
    """Receives one publisher's batches, and asks its replay socket for what it missed."""

    def __init__(self, host: str, port: int, replay_port: int) -> None:
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._sub.connect(f"tcp://{host}:{port}")
        self._replay = self._context.socket(zmq.DEALER)
        self._replay.connect(f"tcp://{host}:{replay_port}")

    def receive(self, timeout_ms: int) -> EventBatch | None:
        """The next published batch, or None after `timeout_ms`."""
        if not self._sub.poll(timeout_ms):
            return None
        _, data = self._sub.recv_multipart()
        return EventBatch.decode(data)

    def replay(self, since: int, timeout_ms: int = 5000) -> tuple[str, list[EventBatch]]:
        """("batches", every batch from `since`) or ("snapshot", [the state now])."""
        self._replay.send(json.dumps({"since": since}).encode())
        if not self._replay.poll(timeout_ms):
            raise TimeoutError(f"no replay answer in {timeout_ms} ms")
        kind, *frames = self._replay.recv_multipart()
        if kind == b"error":
            raise ValueError(frames[0].decode())
        return kind.decode(), [EventBatch.decode(f) for f in frames]

    def close(self) -> None:
        self._context.destroy(linger=0)
