"""Streams read at once, as their clients see them: each chunk's arrival, text, token ids.

One thread per stream reads its server-sent events (`EventCutter`) and notifies a shared
condition on every chunk, so the caller can act when the streams reach a point (kill a
replica once each has so many tokens) and measure afterwards: the longest gap between a
stream's chunks is the stall its client saw.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from minserve.router.app import REPLICA_HEADER
from minserve.router.sse import DONE, EventCutter, event_data

T = TypeVar("T")


@dataclass
class StreamRead:
    """One stream as its client saw it: the replica that opened it, each chunk's arrival
    time and token count, the text and the token ids."""

    replica: str = ""
    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # token ids in each chunk
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    done: bool = False  # [DONE] came
    error: str | None = None

    def read(self, client: httpx.Client, body: dict[str, Any], news: threading.Condition) -> None:
        """POST the request and take its events until [DONE]; every chunk notifies `news`."""
        try:
            with client.stream("POST", "/v1/completions", json=body) as response:
                self.replica = response.headers.get(REPLICA_HEADER, "")
                if response.status_code != 200:
                    self.error = f"{response.status_code}: {response.read()[:300]!r}"
                    return
                cutter = EventCutter()
                for data in response.iter_bytes():
                    for event in cutter.feed(data):
                        self._take(event_data(event))
                    with news:
                        news.notify_all()
        except httpx.HTTPError as error:
            self.error = f"{type(error).__name__}: {error}"
        finally:
            with news:
                news.notify_all()

    def _take(self, data: str | None) -> None:
        if data == DONE:
            self.done = True
            return
        chunk = json.loads(data) if data else {}
        if "error" in chunk:
            self.error = str(chunk["error"].get("message"))
        for choice in chunk.get("choices", []):
            ids = choice.get("token_ids") or []
            self.text += choice.get("text") or ""
            self.token_ids += ids
            self.times.append(time.monotonic())
            self.counts.append(len(ids))

    @property
    def ended(self) -> bool:
        return self.done or self.error is not None

    @property
    def longest_gap_s(self) -> float:
        """The longest wait between two chunks."""
        return self.longest_gap_after(float("-inf"))

    def longest_gap_after(self, moment: float) -> float:
        """The longest wait for a chunk that came after `moment` (time.monotonic())."""
        pairs = zip(self.times, self.times[1:])
        return max((b - a for a, b in pairs if b > moment), default=0.0)

    def time_of(self, tokens: int) -> float:
        """When the stream had `tokens` token ids (inf: it never had)."""
        total = 0
        for t, n in zip(self.times, self.counts):
            total += n
            if total >= tokens:
                return t
        return float("inf")

    def gap_across(self, moment: float) -> float:
        """The gap between the last chunk by `moment` and the next one."""
        later = [i for i, t in enumerate(self.times) if t > moment]
        return self.times[later[0]] - self.times[later[0] - 1] if later and later[0] else 0.0

    def tokens_by(self, moment: float) -> int:
        """Token ids that had arrived by `moment` (time.monotonic())."""
        return sum(n for t, n in zip(self.times, self.counts) if t <= moment)


def stream_all(
    url: str, bodies: list[dict[str, Any]], timeout_s: float, kill_at: int,
    kill: Callable[[list[StreamRead]], T] | None = None,
) -> tuple[list[StreamRead], T | None]:  # fmt: skip
    """Every request at once to `url`'s /v1/completions, each read to its end within
    `timeout_s` in all; `kill(reads)` once every stream has `kill_at` tokens."""
    reads, news = [StreamRead() for _ in bodies], threading.Condition()
    deadline = time.monotonic() + timeout_s
    killed = None
    with httpx.Client(base_url=url, timeout=httpx.Timeout(120.0, connect=10.0)) as client:
        threads = [threading.Thread(target=r.read, args=(client, b, news), daemon=True)
                   for r, b in zip(reads, bodies)]  # fmt: skip
        for thread in threads:
            thread.start()
        if kill is not None:
            with news:
                ready = news.wait_for(lambda: all(
                    r.ended or len(r.token_ids) >= kill_at for r in reads
                ), timeout_s)  # fmt: skip
            if not ready or any(r.ended for r in reads):
                raise RuntimeError(f"the streams did not all reach {kill_at} tokens: "
                                   f"{[r.error or len(r.token_ids) for r in reads]}")  # fmt: skip
            killed = kill(reads)
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            raise RuntimeError(f"the streams did not end within {timeout_s:.0f} s")
    return reads, killed
