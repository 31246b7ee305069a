"""A grammar tried first where a crash costs nothing: a child process that compiles it.

xgrammar's compiler is C++ and, on a few grammars, it does not raise but dies: version
0.2.8 ends the process with a segmentation fault on `root ::= root{0,2}` (a rule that
may be empty and repeats only itself). The server compiles request grammars in its own
process, so one such request would take down every stream it serves. An EBNF grammar is
therefore compiled once more in a long-lived child process first, against a one-token
vocabulary (the crash is in the grammar's own rewriting, before any token is looked at;
the probe costs a millisecond or two once the child is up). If the child dies, the
grammar is refused, and the next probe starts a fresh child.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
import time

# The child: one JSON string per line in (a grammar), one line out per grammar ("ok", or
# "error" when xgrammar raises: the parent's own compile then reports xgrammar's message).
_CHILD = """
import json, sys
import xgrammar as xgr
compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["a"]), max_threads=1, cache_enabled=False)
print("ready", flush=True)
for line in sys.stdin:
    try:
        compiler.compile_grammar(json.loads(line))
        print("ok", flush=True)
    except Exception:
        print("error", flush=True)
"""


class GrammarCrashError(ValueError):
    """xgrammar's compiler killed the probe process on this grammar."""


class CrashProbe:
    """One child process that compiles EBNF grammars before the server does; thread-safe
    (one probe at a time)."""

    def __init__(self, start_timeout_s: float = 60.0) -> None:
        self.start_timeout_s = start_timeout_s
        self._child: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def check(self, text: str, timeout_s: float) -> None:
        """Return if compiling `text` leaves xgrammar's process alive (whether or not it
        raises); a GrammarCrashError if it kills it; a TimeoutError past `timeout_s`."""
        with self._lock:
            child = self._running_child()
            assert child.stdin is not None
            child.stdin.write(json.dumps(text) + "\n")
            child.stdin.flush()
            try:
                answer = self._read_line(child, timeout_s)
            except TimeoutError:
                self._stop_child()
                raise
            if answer in ("ok", "error"):
                return
            returncode = child.wait()
            self._child = None
            raise GrammarCrashError(
                f"xgrammar's compiler crashes on it (its process ended with code "
                f"{returncode}); rewrite the rule that repeats or is only itself"
            )

    def close(self) -> None:
        """Stop the child process, if one runs."""
        with self._lock:
            self._stop_child()

    def _running_child(self) -> subprocess.Popen[str]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._child = subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if self._read_line(self._child, self.start_timeout_s) != "ready":
            code = self._child.wait()
            self._child = None
            raise RuntimeError(f"the grammar probe process did not start (exit code {code})")
        return self._child

    def _read_line(self, child: subprocess.Popen[str], timeout_s: float) -> str:
        """The child's next line ("" once it has died); a TimeoutError past `timeout_s`."""
        assert child.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the grammar probe gave no answer within {timeout_s:g} s")
            readable, _, _ = select.select([child.stdout], [], [], left)
            if readable:
                return child.stdout.readline().strip()

    def _stop_child(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None
