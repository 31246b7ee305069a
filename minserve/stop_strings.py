"""Stop strings on a text stream: cut at the first one, and never show part of one.

Text arrives in deltas, one per token, and a stop string can straddle several of them
("</ans" + "wer>"). So the matcher holds back the longest tail of the text that could still
grow into a stop string, and releases it once it cannot (or when generation ends for another
reason: `flush`).

Which stop string wins when several occur? The one completed first, as if the text arrived one
character at a time: the earliest *end*, and on a tie the longer string (it starts earlier).
It is the only rule that does not depend on how the text happens to be split into deltas.
"""

from __future__ import annotations

from collections.abc import Sequence


# >>> exercise 9.5: stop strings across deltas
def first_stop(text: str, stop_strings: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop string) of the stop string that completes first in `text`, or None.

    First means the earliest end (start + length) of each string's first occurrence; on a
    tie, the longer string, which starts earlier ("ab" and "b" both end in "xab": "ab").
    """
    # >>> solution
    found = [(start + len(s), start, s) for s in stop_strings if (start := text.find(s)) >= 0]
    if not found:
        return None
    _end, start, stop = min(found)
    return start, stop
    # <<< solution


def partial_stop_length(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is the beginning of some stop string.

    Only proper beginnings count (a whole stop string would have matched already), so the
    answer is below the longest stop string's length; 0 when no tail can grow into one.
    """
    # >>> solution
    longest = max((len(s) for s in stop_strings), default=0)
    for length in range(min(len(text), longest - 1), 0, -1):
        tail = text[-length:]
        if any(s.startswith(tail) for s in stop_strings):
            return length
    return 0
    # <<< solution


class StopStringMatcher:
    """Streams text through, cut exactly at the first stop string (OpenAI's / vLLM's `stop`)."""

    def __init__(self, stop_strings: Sequence[str], include_stop_str_in_output: bool = False):
        if isinstance(stop_strings, str):
            raise TypeError("stop_strings must be a sequence of strings, not a single string")
        if not all(isinstance(s, str) and s for s in stop_strings):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop_strings)!r}")
        self.stop_strings = tuple(stop_strings)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched: str | None = None  # the stop string that ended the text
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Take the next piece of text; return (text safe to show now, stop string or None).

        The text is what was held back plus `delta`. If a stop string completes in it, return
        the text up to its start (through its end with `include_stop_str_in_output`) and the
        string, record it in `self.matched` and hold nothing. Otherwise hold back the
        longest tail that could still become a stop string (`self._held`) and return the
        rest. Feeding after a match is a RuntimeError.
        """
        # >>> solution
        if self.matched is not None:
            raise RuntimeError(f"stop string {self.matched!r} already matched; the text has ended")
        text = self._held + delta
        match = first_stop(text, self.stop_strings)
        if match is not None:
            start, self.matched = match
            self._held = ""
            end = start + len(self.matched) if self.include_stop_str_in_output else start
            return text[:end], self.matched
        keep = partial_stop_length(text, self.stop_strings)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], None
        # <<< solution

    def flush(self) -> str:
        """Generation ended for another reason: the held-back tail was no stop string after all.

        Return it, and hold nothing from now on.
        """
        # >>> solution
        held, self._held = self._held, ""
        return held
        # <<< solution


# <<< exercise
