"""`minserve bench router` runs both policies over fresh replicas on each workload and accounts
for every request: the replicas' own counters add up to what the load generator sent."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from minserve.bench.router import sessions_for
from minserve.bench.serve_workloads import WorkloadSpec
from minserve.cli import main


def test_bench_router_reports_both_policies_from_the_replicas_counters(tiny_model, tmp_path):
    out = tmp_path / "router"
    sizes = ["--num-prompts", "3", "--num-turns", "2", "--input-len", "8", "--output-len", "3",
             "--prefix-len", "24", "--num-prefixes", "1", "--request-rate", "inf",
             "--num-blocks", "64"]  # fmt: skip
    argv = ["bench", "router", "--model", str(tiny_model("llama")), *sizes, "--output", str(out)]
    assert main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    cells = [(run["workload"], run["policy"]) for run in report["runs"]]
    assert cells == [(w, p) for w in ("multi-turn", "shared-prefix")
                     for p in ("round_robin", "cache_aware")]  # fmt: skip
    for run in report["runs"]:
        sent = 6 if run["workload"] == "multi-turn" else 3  # sessions x turns
        assert sum(run["requests_per_replica"]) == sent == run["summary"]["completed"]
        assert 0 < run["prefix_cache_hits"] <= run["prefix_cache_queries"]
        assert run["prefix_hit_rate"] == run["prefix_cache_hits"] / run["prefix_cache_queries"]
    for workload, cell in report["summary"].items():
        by = {run["policy"]: run for run in report["runs"] if run["workload"] == workload}
        rates = [by["cache_aware"]["prefix_hit_rate"], by["round_robin"]["prefix_hit_rate"]]
        assert cell["hit_rate"] == rates
    assert report["command"].startswith("minserve bench router --model")
    assert report["machine"]["cores"] >= 1
    page = out.with_suffix(".md").read_text()
    assert "| shared-prefix | cache_aware |" in page and report["command"] in page
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_router_names_an_unknown_workload(capsys):
    assert main(["bench", "router", "--workloads", "multi-turn,chatty"]) == 2
    assert "unknown workload 'chatty'" in capsys.readouterr().err


def test_shared_prefix_sessions_split_evenly_over_distinct_prefixes_in_a_seeded_order():
    spec = WorkloadSpec("shared-prefix", num_sessions=7, input_len=4, prefix_len=12, seed=3)
    sessions = sessions_for(spec, num_prefixes=3)
    prompts = [session.prompts[0] for session in sessions]
    assert all(len(prompt) == 12 + 4 for prompt in prompts)
    counts = Counter(tuple(prompt[:12]) for prompt in prompts)
    assert sorted(counts.values()) == [2, 2, 3]
    assert [s.prompts for s in sessions_for(spec, 3)] == [s.prompts for s in sessions]
    first = [tuple(prompt[:12]) for prompt in prompts]
    assert first != sorted(first, key=list(counts).index)  # shuffled, not grouped by prefix
    with pytest.raises(ValueError, match=r"--num-prefixes must be in \[1, 7\], got 8"):
        sessions_for(spec, num_prefixes=8)
