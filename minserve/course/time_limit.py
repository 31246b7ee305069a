"""A time limit for one check, so an endless loop in your code cannot hang `minserve check`.

In the main thread (a terminal, or a notebook kernel, which runs cells there) a SIGALRM
timer raises `CheckTimeout` in the running code; in any other thread a watchdog thread
raises it there with CPython's `PyThreadState_SetAsyncExc`. Either way it lands at the
next Python line your loop runs, so `while True: pass` stops. A call that stays inside C
(one huge tensor operation) is stopped when it returns.

Given `files` (yours), the limit only stops code while one of them is on the call stack:
a check that spends its first seconds loading a model, with none of your code running,
is left to finish that; the first moment past the limit that your code runs, it stops.

`CheckTimeout` is a `BaseException`, like `KeyboardInterrupt`: an `except Exception` in
your code does not swallow it. While the check keeps running past its limit the timer
fires again every half second, in case a bare `except:` caught it.
"""

from __future__ import annotations

import ctypes
import signal
import sys
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
    else:
        with _watchdog(seconds, files):
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


@contextmanager
def _watchdog(seconds: float, files: Collection[str] | None) -> Iterator[None]:
    """A thread that raises `CheckTimeout` into this one after `seconds`."""
    target = threading.get_ident()
    done = threading.Event()
    lock = threading.Lock()

    def watch() -> None:
        wait = seconds
        while not done.wait(wait):
            with lock:
                if not done.is_set() and _runs(sys._current_frames().get(target), files):
                    _raise_in(target, _timeout_class(seconds))
            wait = _REPEAT

    watcher = threading.Thread(target=watch, name="minserve-check-time-limit", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        with lock:
            done.set()
            _raise_in(target, None)  # drop one still pending
        watcher.join()


def _timeout_class(seconds: float) -> type[CheckTimeout]:
    """PyThreadState_SetAsyncExc takes a class, raised without arguments: bind `seconds`."""
    return type(
        "CheckTimeout",
        (CheckTimeout,),
        {"__init__": lambda self: CheckTimeout.__init__(self, seconds)},
    )


def _raise_in(thread_id: int, exception: type[BaseException] | None) -> None:
    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async_exc(ctypes.c_ulong(thread_id), ctypes.py_object(exception) if exception else None)
