"""Streams that survive a dying replica: relay, and on a failure, continue elsewhere.

    replica A ─► chunk, chunk, chunk ─╳ (connection lost, or an error event of its own)
                 │ journal: body, token ids, text, id
                 ▼
    mark A down; policy.choose(the others) ─► replica B: body + resume_token_ids
    replica B ─► chunk, chunk, ..., usage, [DONE]   rewritten to A's id, no second role,
                                                    usage over both streams
    client    ◄─ one stream, the same text as if A had never failed

A stream is continued at most `resends` times; after that, or with no replica left, it
ends with an `{"error": ...}` event as an unjournaled stream does. A replica that broke
after the last token owes only the usage chunk and [DONE]: the router writes them itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx

from minserve.router.gateway_error import GatewayError
from minserve.router.journal import Journal
from minserve.router.replicas import Replica
from minserve.router.sse import DONE, EventCutter, data_event, event_data
from minserve.router.stall_histogram import StallHistogram
from minserve.server.errors import APIError

REPLICA_FAULTS = ("server_error",)  # error events that say the replica failed, not the request


@dataclass
class Leg:
    """One replica's part in answering a request: which replica, and its open response."""

    index: int
    replica: Replica
    upstream: httpx.Response


@dataclass
class Resends:
    """How many more times a request may be sent again after its replica broke."""

    left: int

    def spend(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


class LegFailed(Exception):
    """The replica answering a stream failed; `down`: mark it down (it broke, rather than
    refused the continuation with an answer of its own)."""

    def __init__(self, message: str, cause: Exception, down: bool = True) -> None:
        super().__init__(message)
        self.cause, self.down = cause, down


Reopen = Callable[[bytes | None, set[int]], Awaitable[Leg]]  # (body, replicas to avoid) -> a leg
Close = Callable[[Leg, LegFailed | None], Awaitable[None]]


class ResumingRelay:
    """Relays one journaled stream; continues it on another replica when its own fails."""

    def __init__(
        self, journal: Journal, leg: Leg, reopen: Reopen, close: Close, resends: Resends,
        stalls: StallHistogram, failed: set[int], clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        """`failed`: replicas this request must avoid (shared with `reopen`, which adds the
        ones that refuse a connection); `stalls` gets the wait of each continuation."""
        self.journal, self.leg, self.reopen, self.close = journal, leg, reopen, close
        self.resends, self.stalls, self.failed, self.clock = resends, stalls, failed, clock
        self._failed_at: float | None = None  # the failure a continuation is answering

    async def events(self) -> AsyncIterator[bytes]:
        """The client's stream: every leg's events, spliced."""
        leg: Leg | None = self.leg
        try:
            while leg is not None:
                try:
                    async for event in self._relay(leg):
                        self._stalled_until_now()
                        yield event
                    return
                except LegFailed as failure:
                    if self._failed_at is None:
                        self._failed_at = self.clock()
                    self.failed.add(leg.index)
                    broken, leg = leg, None
                    await self.close(broken, failure)
                    if self.journal.finished:
                        for event in self._ending():
                            yield event
                        return
                    leg, error = await self._continue(failure)
                    if error is not None:
                        broken.replica.broken_streams += 1
                        yield data_event(error.body())
        finally:
            if leg is not None:
                await self.close(leg, None)

    async def _relay(self, leg: Leg) -> AsyncIterator[bytes]:
        """One leg's events as the client sees them, until its [DONE]; LegFailed if it
        breaks, refuses, or reports a failure of its own first."""
        upstream, url = leg.upstream, leg.replica.url
        cutter = EventCutter()
        try:
            if upstream.status_code != 200:  # a continuation refused (overloaded, unsupported)
                answer = (await upstream.aread()).decode(errors="replace")[:500]
                cause = RuntimeError(f"answered {upstream.status_code}: {answer}")
                raise LegFailed(f"replica {url} refused the continuation: {answer}", cause, False)
            async for data in upstream.aiter_bytes():
                for event in cutter.feed(data):
                    if (out := self._take(event, leg)) is not None:
                        yield out
                    if event_data(event) == DONE:
                        return
        except httpx.HTTPError as error:
            raise LegFailed(f"replica {url} failed mid-stream: {error}", error) from error
        cause = RuntimeError("the stream ended without [DONE]")
        raise LegFailed(f"replica {url} failed mid-stream: {cause}", cause)

    def _take(self, event: bytes, leg: Leg) -> bytes | None:
        """One whole event of the leg, rewritten by the journal (None: dropped)."""
        data = event_data(event)
        try:
            chunk = json.loads(data) if data not in (None, DONE) else None
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):
            return event  # [DONE], a comment, something else: as it came
        error = chunk.get("error")
        if isinstance(error, dict) and error.get("type") in REPLICA_FAULTS:
            cause = RuntimeError(f"error event: {error.get('message')}")
            raise LegFailed(f"replica {leg.replica.url} failed mid-stream: {cause}", cause)
        out = self.journal.take(chunk)
        return None if out is None else data_event(out)

    async def _continue(self, failure: LegFailed) -> tuple[Leg | None, APIError | None]:
        """The next leg, on another replica; or the error that ends the stream."""
        if not self.resends.spend():
            return None, GatewayError(str(failure))
        try:
            leg = await self.reopen(self.journal.resume_body(), self.failed)
        except APIError as error:
            return None, error
        self.journal.resumed()
        if leg.upstream.status_code == 200:  # accepted: it continues the stream
            leg.replica.resumes += 1
            leg.replica.resumed_tokens += len(self.journal.token_ids)
        return leg, None

    def _ending(self) -> list[bytes]:
        """A finished stream whose replica broke before [DONE]: what it still owed."""
        usage = self.journal.ending()
        return [*([data_event(usage)] if usage is not None else []), data_event(DONE)]

    def _stalled_until_now(self) -> None:
        if self._failed_at is not None:
            self.stalls.observe(self.clock() - self._failed_at)
            self._failed_at = None
