"""Server-sent events as the router reads them: a byte stream cut into whole events.

    b'data: {"id": ...}\\n\\ndata: {"id"' + b': ...}\\n\\ndata: [DONE]\\n\\n'
        ─► b'data: {"id": ...}\\n\\n', b'data: {"id": ...}\\n\\n', b'data: [DONE]\\n\\n'

Network reads end anywhere, mid-event included; an event is whole once its blank line has
arrived, so a replica that dies mid-event leaves a piece the router never relays.
"""

from __future__ import annotations

import json

DONE = "[DONE]"  # the data of OpenAI's last event


class EventCutter:
    """Collects bytes and hands back each event once it is whole (blank-line terminated)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The events `data` completes, each with its terminating blank line."""
        # CRLF -> LF over the whole buffer, so a CR and LF split across reads still pair up
        self._buffer = (self._buffer + data).replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        return [event + b"\n\n" for event in events if event]

    @property
    def pending(self) -> bytes:
        """The start of an event that has not ended yet."""
        return self._buffer


def event_data(event: bytes) -> str | None:
    """The event's data (its `data:` lines joined), or None when it has none (a comment)."""
    lines = event.decode("utf-8", errors="replace").split("\n")
    data = [line[5:].removeprefix(" ") for line in lines if line.startswith("data:")]
    return "\n".join(data) if data else None


def data_event(payload: dict | str) -> bytes:
    """One event carrying `payload` (JSON, or a string as it is), as minserve serve writes it."""
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {text}\n\n".encode()
