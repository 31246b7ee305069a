"""`minserve bench router` runs both policies over fresh replicas and accounts for every
request: the replicas' own counters add up to what the load generator sent."""

from __future__ import annotations

import json

from minserve.cli import main


def test_bench_router_reports_both_policies_from_the_replicas_counters(tiny_model, tmp_path):
    out = tmp_path / "router"
    sizes = ["--num-prompts", "3", "--num-turns", "2", "--input-len", "8", "--output-len", "3"]
    argv = ["bench", "router", "--model", str(tiny_model("llama")), *sizes, "--output", str(out)]
    assert main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert [run["policy"] for run in report["runs"]] == ["round_robin", "cache_aware"]
    for run in report["runs"]:
        assert sum(run["requests_per_replica"]) == 6 == run["summary"]["completed"]
        assert 0 < run["prefix_cache_hits"] <= run["prefix_cache_queries"]
        assert run["prefix_hit_rate"] == run["prefix_cache_hits"] / run["prefix_cache_queries"]
    assert "| cache_aware |" in out.with_suffix(".md").read_text()
