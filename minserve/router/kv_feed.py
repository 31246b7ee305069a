"""The feed: follows every replica's KV events into the router's `KVBlocks`, a thread each.

    ask GET /v1/kv_events ──► 404: no events (the policy guesses for it); ask again later
         │ down: ask again later
         ▼ a source
    subscribe (PUB) ──► replay from the index's next batch number (batches, or a snapshot)
         ▼
    receive batches ──► a gap (a number skipped) ──► replay from the first missed one
         │ every check_s: ask GET /v1/kv_events again; another answer (new instance or
         │ ports: a restart), or none: back to the top. Else replay the tail (PUB/SUB may
         ▼ drop a last batch that no later batch reveals)

A replica whose batch numbers start again at 0 restarted on the same sockets: `KVBlocks`
starts its blocks over. Nothing here blocks the router: it reads `KVBlocks` under its lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import httpx
import zmq

from minserve.kvcache.kv_event_socket import KVEventSubscriber
from minserve.router.kv_blocks import KVBlocks
from minserve.router.kv_source import KVEventSource, fetch_source

_RECEIVE_MS = 50  # how long one wait for a batch lasts: the thread's reaction to stop


class KVFeed:
    """One thread per replica URL, each keeping that replica's entry in `blocks` current."""

    def __init__(
        self, urls: Sequence[str], blocks: KVBlocks, check_s: float = 1.0,
        replay_timeout_s: float = 2.0,
    ) -> None:  # fmt: skip
        if len(urls) != blocks.num_replicas:
            raise ValueError(f"{len(urls)} replica URLs for a KVBlocks of {blocks.num_replicas}")
        if check_s <= 0 or replay_timeout_s <= 0:
            raise ValueError(f"check_s and replay_timeout_s must be > 0, got "
                             f"{check_s}, {replay_timeout_s}")  # fmt: skip
        self.urls, self.blocks = list(urls), blocks
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=_ReplicaFeed(url, i, blocks, self._stop, check_s,
                                                 replay_timeout_s).run,
                             name=f"kv-feed-{i}", daemon=True)
            for i, url in enumerate(urls)
        ]  # fmt: skip

    def instances(self) -> dict[str, str | None]:
        """Replica URL -> the instance name its events carry (None: not followed now)."""
        sources = [self.blocks.source(i) for i in range(len(self.urls))]
        return {url: s.instance if s else None for url, s in zip(self.urls, sources, strict=True)}

    def start(self) -> KVFeed:
        for thread in self._threads:
            thread.start()
        return self

    def close(self) -> None:
        """Stop every thread and wait for it (each closes its sockets on the way out)."""
        self._stop.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join()


class _ReplicaFeed:
    """The loop of one replica's thread."""

    def __init__(self, url: str, replica: int, blocks: KVBlocks, stop: threading.Event,
                 check_s: float, replay_timeout_s: float) -> None:  # fmt: skip
        self.url, self.replica, self.blocks, self.stop = url, replica, blocks, stop
        self.check_s, self.replay_timeout_ms = check_s, int(replay_timeout_s * 1000)

    def run(self) -> None:
        with httpx.Client(timeout=self.check_s + 1.0) as http:
            while not self.stop.is_set():
                source = self._discover(http)
                if source is not None and self.blocks.attach(self.replica, source):
                    self._follow(http, source)
                else:  # down, restarting, no events, or an instance name already taken
                    self.stop.wait(self.check_s)

    def _discover(self, http: httpx.Client) -> KVEventSource | None:
        try:
            source = fetch_source(http, self.url)
        except (httpx.HTTPError, ValueError):  # down or restarting: ask again later
            return None
        if source is None:  # answered 404: publishes no KV events
            self.blocks.detach(self.replica)
        return source

    def _follow(self, http: httpx.Client, source: KVEventSource) -> None:
        """Subscribe and keep the replica's entry current until the stop, a restart or an
        unanswered replay (the publisher is gone)."""
        subscriber = None
        try:
            subscriber = KVEventSubscriber(source.host, source.port, source.replay_port)
            self._catch_up(subscriber)
            next_check = time.monotonic() + self.check_s
            while not self.stop.is_set():
                batch = subscriber.receive(_RECEIVE_MS)
                if batch is not None and not self.blocks.apply(self.replica, batch):
                    self._catch_up(subscriber)  # a gap
                if time.monotonic() >= next_check:
                    if self._discover(http) != source:
                        return
                    self._catch_up(subscriber)
                    next_check = time.monotonic() + self.check_s
        except (TimeoutError, ValueError, zmq.ZMQError):  # no replay answer, a bad address,
            self.stop.wait(self.check_s)  # or another publisher's batches: ask again later
        finally:
            if subscriber is not None:
                subscriber.close()

    def _catch_up(self, subscriber: KVEventSubscriber) -> None:
        since = self.blocks.next_seq(self.replica)
        kind, batches = subscriber.replay(since, self.replay_timeout_ms)
        self.blocks.catch_up(self.replica, kind, batches)
