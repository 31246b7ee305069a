"""`minserve bench offline`: its workload, minserve's runs, and the table it prints."""

from __future__ import annotations

import pytest

from minserve.bench.offline import offline_workload, requested_tokens, run_minserve
from minserve.cli import main


def test_workload_is_deterministic_for_a_seed() -> None:
    assert offline_workload(16, 4, 40, seed=3, vocab_size=500) == offline_workload(
        16, 4, 40, seed=3, vocab_size=500
    )
    assert offline_workload(16, 4, 40, seed=3) != offline_workload(16, 4, 40, seed=4)


def test_workload_lengths_and_token_ids_stay_within_bounds() -> None:
    workload = offline_workload(64, 32, 256, seed=0, vocab_size=1000)
    assert len(workload) == 64
    assert all(32 <= len(r.prompt_token_ids) <= 256 for r in workload)
    assert all(32 <= r.max_tokens <= 256 for r in workload)
    assert all(0 <= t < 1000 for r in workload for t in r.prompt_token_ids)
    assert len({len(r.prompt_token_ids) for r in workload}) > 10  # lengths really vary


def test_workload_rejects_empty_length_ranges() -> None:
    with pytest.raises(ValueError, match="need 0 < min_len <= max_len"):
        offline_workload(4, 10, 5)


def test_minserve_runner_generates_exactly_the_requested_tokens(tiny_model) -> None:
    workload = offline_workload(6, 3, 12, seed=1, vocab_size=49152)
    result = run_minserve(workload, "paged", "float32", tiny_model("llama"))
    assert result.ok and result.tokens_per_s > 0
    assert result.output_tokens == result.generated_tokens == requested_tokens(workload)
    assert result.details["num_preemptions"] == 0


def test_reference_runner_generates_exactly_the_requested_tokens(tiny_model) -> None:
    workload = offline_workload(4, 3, 10, seed=2, vocab_size=49152)
    result = run_minserve(workload, "reference", "float32", tiny_model("llama"))
    assert result.peer == "reference" and result.tokens_per_s > 0
    assert result.output_tokens == requested_tokens(workload)


def test_bench_offline_prints_a_row_per_dtype(tiny_model, capsys) -> None:
    argv = ["bench", "offline", "--model", str(tiny_model("llama")), "--num-requests", "3"]
    assert main([*argv, "--min-len", "2", "--max-len", "6", "--dtype", "float32,bfloat16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("3 requests, ")
    rows = [line for line in out.splitlines() if line.startswith("| minserve |")]
    assert [row.split(" | ")[1] for row in rows] == ["float32", "bfloat16"]


def test_bench_offline_rejects_unknown_dtypes(capsys) -> None:
    assert main(["bench", "offline", "--dtype", "float32,int4"]) == 2
    assert "unknown dtype 'int4'" in capsys.readouterr().err
