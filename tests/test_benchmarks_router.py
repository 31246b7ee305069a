"""benchmarks/router.py: every policy over fresh replicas on each workload, accounted from the
replicas' own counters, and the record of it."""

from __future__ import annotations

import json

from benchmarks.router import main


def test_record_reports_every_policy_from_the_replicas_counters(tiny_model, tmp_path):
    out = tmp_path / "router"
    sizes = ["--num-prompts", "3", "--num-turns", "2", "--input-len", "8", "--output-len", "3",
             "--prefix-len", "24", "--num-prefixes", "1", "--request-rate", "inf",
             "--num-blocks", "64"]  # fmt: skip
    argv = ["--model", str(tiny_model("llama")), *sizes, "--output", str(out)]
    assert main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    cells = [(run["workload"], run["policy"]) for run in report["runs"]]
    assert cells == [(w, p) for w in ("multi-turn", "shared-prefix")
                     for p in ("round_robin", "cache_aware", "kv_aware")]  # fmt: skip
    for run in report["runs"]:
        sent = 6 if run["workload"] == "multi-turn" else 3  # sessions x turns
        assert sum(run["requests_per_replica"]) == sent == run["summary"]["completed"]
        assert 0 < run["prefix_cache_hits"] <= run["prefix_cache_queries"]
        assert run["prefix_hit_rate"] == run["prefix_cache_hits"] / run["prefix_cache_queries"]
    for workload, cell in report["summary"].items():
        by = {run["policy"]: run for run in report["runs"] if run["workload"] == workload}
        for policy, versus in (("cache_aware", cell), ("kv_aware", cell["kv_aware"])):
            rates = [by[policy]["prefix_hit_rate"], by["round_robin"]["prefix_hit_rate"]]
            assert versus["hit_rate"] == rates
    assert " -m benchmarks.router --model" in report["command"]
    assert report["machine"]["cores"] >= 1
    page = out.with_suffix(".md").read_text()
    assert "| shared-prefix | kv_aware |" in page and report["command"] in page
    assert out.with_suffix(".png").stat().st_size > 0
