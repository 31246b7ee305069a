"""benchmarks/speculative.py: the record of a tiny run, every cell against plain decoding."""

from __future__ import annotations

import json

import pytest

from benchmarks.speculative import main
from minserve.bench.speculative import expected_speedup


def test_benchmark_runs_every_cell_and_reports_identical_greedy_tokens(
    tiny_model, tmp_path
) -> None:
    out = tmp_path / "spec"
    proposers = [
        "ngram:k=3",
        "early_exit:layers=1:k=2",
        "draft_model:layers=1:k=2",
        "draft_model:k=2",
    ]
    argv = ["--model", str(tiny_model("llama")), "--threads", "1",
            "--max-tokens", "6", "--batch1-requests", "2", "--repeats", "1", "--output", str(out),
            "--proposers", *proposers]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    cells = report["cells"]
    assert [(c["workload"], c["batch"]) for c in cells[:: len(proposers)]] == [
        ("repetition", 1), ("repetition", 8), ("chat", 1), ("chat", 8),
    ]  # fmt: skip
    assert [c["num_requests"] for c in cells] == [2] * 4 + [8] * 4 + [2] * 4 + [8] * 4
    assert all(c["output_tokens"] == 6 * c["num_requests"] for c in cells)
    assert report["summary"]["all_identical"] and all(c["identical"] for c in cells)
    for c in cells:
        assert c["tokens_per_forward"] >= 1 and 0 <= c["acceptance_rate"] <= 1
        assert c["plain_s"] > 0 and c["spec_s"] > 0
        assert c["speedup"] == pytest.approx(c["plain_s"] / c["spec_s"])
        a, g = c["acceptance_rate"], c["mean_draft_len"]
        assert c["formula_speedup"] == pytest.approx(expected_speedup(a, g, c["c"]))
        if c["proposer"].startswith("draft_model (k=2, the target itself)"):
            assert a == 1.0  # the same weights guess exactly what the target decodes
    page = out.with_suffix(".md").read_text()
    assert (
        " -m benchmarks.speculative --model" in page and "| repetition | 1 | ngram (k=3) |" in page
    )
    assert out.with_suffix(".png").stat().st_size > 0
