"""`minserve bench router` runs every policy over fresh replicas on each workload and accounts
for every request: the replicas' own counters add up to what the load generator sent."""

from __future__ import annotations

from collections import Counter

import pytest

from minserve.bench.router import sessions_for
from minserve.bench.serve_workloads import WorkloadSpec
from minserve.cli import main


def test_bench_router_prints_a_row_per_workload_and_policy(tiny_model, capsys):
    argv = ["bench", "router", "--model", str(tiny_model("llama")), "--workloads", "multi-turn",
            "--num-prompts", "2", "--num-turns", "2", "--input-len", "8", "--output-len", "3",
            "--request-rate", "inf", "--num-blocks", "64"]  # fmt: skip
    assert main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    header = "| workload | policy | requests per replica | prefix hit rate (ideal)"
    assert rows[0].startswith(header)
    assert [row.split(" | ")[:2] for row in rows[1:]] == [
        ["| multi-turn", "round_robin"], ["| multi-turn", "cache_aware"],
        ["| multi-turn", "kv_aware"],
    ]  # fmt: skip
    for row in rows[1:]:  # one replica that sees every turn hits at least as often as two
        rate, ideal = (float(x.strip("%) ")) for x in row.split(" | ")[3].split("("))
        assert rate <= ideal + 1e-9, row


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
