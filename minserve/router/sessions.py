"""Session stickiness: a conversation goes back to the replica that served its last turn.

A session (an `x-session-id` header, or the body's `user`) remembers its replica for
`ttl_s` seconds after its last request; the next turn then finds its history in that
replica's cache even when the router's index has not heard of it yet.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class SessionTable:
    """Session id -> (replica, last use), oldest first; expired sessions are dropped."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s < 0:
            raise ValueError(f"a session's time to live must be >= 0 s, got {ttl_s}")
        self.ttl_s, self.clock = ttl_s, clock
        self._last: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def replica(self, session: str | None) -> int | None:
        """The replica `session` last used, unless its time to live has run out."""
        self._expire(self.clock())
        found = self._last.get(session) if session is not None else None
        return None if found is None else found[0]

    def touch(self, session: str | None, replica: int) -> None:
        """`session` was just sent to `replica`."""
        if session is None:
            return
        self._last[session] = (replica, self.clock())
        self._last.move_to_end(session)

    def __len__(self) -> int:
        return len(self._last)

    def _expire(self, now: float) -> None:
        while self._last:
            _, (_, used) = next(iter(self._last.items()))
            if now - used < self.ttl_s:
                return
            self._last.popitem(last=False)
