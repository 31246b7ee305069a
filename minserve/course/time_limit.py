"""A time limit for one check, so an endless loop in your code cannot hang `minserve check`.

A SIGALRM timer raises `CheckTimeout` in the running code, at the next Python line your
loop runs, so `while True: pass` stops; a call that stays inside C (one huge tensor
operation) is stopped when it returns. Signals reach the main thread only, which is where
a terminal runs `minserve check` and where a notebook kernel (ipykernel) runs its cells.
Called from another thread (or where there is no SIGALRM), checks run without a limit.

Given `files` (yours), the limit only stops code while one of them is on the call stack:
a check that spends its first seconds loading a model, with none of your code running,
is left to finish that; the first moment past the limit that your code runs, it stops.

`CheckTimeout` is a `BaseException`, like `KeyboardInterrupt`: an `except Exception` in
your code does not swallow it. While the check keeps running past its limit the timer
fires again every half second, in case a bare `except:` caught it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from types import FrameType

DEFAULT_TIME_LIMIT = 10.0  # seconds per check
_REPEAT = 0.5  # seconds between further interruptions once past the limit


class CheckTimeout(BaseException):
    """A check ran past its time limit."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no result in {seconds:g} s")
        self.seconds = seconds


@contextmanager
def time_limit(seconds: float | None, files: Collection[str] | None = None) -> Iterator[None]:
    """Raise `CheckTimeout` in this thread if the block runs longer than `seconds` (None or
    0: no limit), at a moment when code from `files` (None: any code) is on the stack."""
    if not seconds or seconds <= 0:
        yield
    elif threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        with _alarm(seconds, files):
            yield
    else:  # signals reach the main thread only
        yield


def _runs(frame: FrameType | None, files: Collection[str] | None) -> bool:
    """Whether code from `files` is on the stack that ends in `frame`."""
    if files is None:
        return True
    while frame is not None:
        if frame.f_code.co_filename in files:
            return True
        frame = frame.f_back
    return False


@contextmanager
def _alarm(seconds: float, files: Collection[str] | None) -> Iterator[None]:
    """SIGALRM after `seconds`, then every `_REPEAT` s, until the block ends."""
    armed = [True]

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        # the block may have ended between the signal and this handler
        if armed[0] and _runs(frame, files):
            raise CheckTimeout(seconds)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, _REPEAT)
    try:
        yield
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
