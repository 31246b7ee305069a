"""The grammar probe: a grammar that kills xgrammar's compiler kills only the probe's child
process; the next grammar gets a fresh child; a grammar xgrammar merely rejects passes the
probe (the server's own compile then names the problem)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from minserve.structured.crash_probe import CrashProbe, GrammarCrashError

CRASHES = "root ::= root{0,2}"


def test_the_grammar_really_kills_a_process_that_compiles_it() -> None:
    """The oracle: compiled directly, the grammar ends the process by a signal."""
    code = (
        "import sys, xgrammar as xgr\n"
        "xgr.GrammarCompiler(xgr.TokenizerInfo(['a'])).compile_grammar(sys.argv[1])\n"
    )
    done = subprocess.run([sys.executable, "-c", code, CRASHES], capture_output=True, timeout=120)
    assert done.returncode < 0 or done.returncode > 128, done.returncode


def test_a_crash_is_refused_and_the_next_grammar_gets_a_fresh_child() -> None:
    probe = CrashProbe()
    try:
        probe.check('root ::= "a" | "b"', timeout_s=60)
        first = probe._child
        with pytest.raises(GrammarCrashError, match="crashes on it"):
            probe.check(CRASHES, timeout_s=60)
        probe.check("root ::= undefined_rule", timeout_s=60)  # xgrammar raises: not a crash
        assert probe._child is not None and probe._child is not first
        assert probe._child.poll() is None
    finally:
        probe.close()
    assert probe._child is None
