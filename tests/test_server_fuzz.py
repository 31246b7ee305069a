"""No request can take the server down: schemathesis against its own /openapi.json.

A bounded run (about two minutes on a 2-core CPU) of `benchmarks/fuzz_server.py`, every
check on: no 5xx, no failed check, the server up afterwards and every KV block free or held
only by the prefix cache. The long run is `python -m benchmarks.fuzz_server
--max-examples N` (benchmarks/fuzz_server.md).
"""

from __future__ import annotations

from dataclasses import asdict

from benchmarks.fuzz_server import ENGINE, fuzz_server, page
from minserve import LLM

MAX_EXAMPLES = 50  # fuzzing examples per operation, on top of the coverage phase's cases
MAX_TIME_S = 150  # a bound on a slow machine: the run stops there, with what it found


def test_fuzzing_the_server_finds_no_5xx_no_failed_check_and_no_leak(tiny_model) -> None:
    report = fuzz_server(LLM(tiny_model("llama"), **ENGINE), MAX_EXAMPLES, seed=0,
                         max_time_s=MAX_TIME_S)  # fmt: skip
    text = page(asdict(report), ["# the run"])  # counts, statuses, each failure in full
    assert report.cases > 500, text
    assert report.server_errors == 0, text
    assert report.failures == [], text
    assert report.errors == [], text
    assert report.server_up, text
    assert report.blocks_held == 0, text
