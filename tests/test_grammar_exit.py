"""A process that exits while a grammar still compiles exits cleanly: it waits for the
compile (bounded) instead of aborting in xgrammar's C++ thread ("terminate called without
an active exception", exit code 134)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import json, xgrammar as xgr
from minserve.errors import StructuredOutputError
from minserve.sampling_params import StructuredOutputsParams
from minserve.structured.compiler import GrammarCompiler

names = [f"field_{i}" for i in range(300)]  # seconds to compile
schema = {"type": "object", "required": names,
          "properties": {n: {"type": "string", "pattern": f"^x{i}[a-z]{{2,5}}$"}
                         for i, n in enumerate(names)}}
compiler = GrammarCompiler(xgr.TokenizerInfo(["a", "b", "{", "}"]), list, timeout_s=0.05)
try:
    compiler.compile(StructuredOutputsParams(json=json.dumps(schema)))
except StructuredOutputError as error:
    print("refused:", error)
"""


def test_exiting_during_an_overdue_compile_exits_cleanly() -> None:
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert "took longer than" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0, done.stderr[-2000:]
