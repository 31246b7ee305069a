"""benchmarks/chunked_prefill_itl.py: the record of a tiny run, with its verdict and machine."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.chunked_prefill_itl import main

ARGS = ["--num-streams", "3", "--stream-output-len", "20", "--num-long", "2",
        "--long-prompt-len", "96", "--arrival-every", "8", "--budgets", "16,32",
        "--unchunked-budget", "128", "--clock", "cpu"]  # fmt: skip


@pytest.fixture(scope="module")
def report(tiny_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("chunked_itl") / "itl"
    args = ["--model", str(tiny_model("llama")), "--output", str(out), *ARGS]
    assert main([*args, "--chosen-budget", "32"]) == 0
    assert out.with_suffix(".md").read_text().startswith("# Chunked prefill")
    assert out.with_suffix(".png").stat().st_size > 0
    return json.loads(out.with_suffix(".json").read_text())


def test_report_has_every_configuration_and_field(report) -> None:
    assert [r["name"] for r in report["results"]] == ["unchunked-128", "chunked-16", "chunked-32"]
    for r in report["results"]:
        assert set(r["itl_ms"]) == {"p50", "p90", "p99", "max", "mean"}
        assert r["itl_ms"]["p50"] <= r["itl_ms"]["p90"] <= r["itl_ms"]["p99"] <= r["itl_ms"]["max"]
        assert r["output_tokens"] == 3 * 20 + 2 * 16  # the CLI keeps the default output lengths
        assert r["total_tokens"] == r["output_tokens"] + 3 * 64 + 2 * 96
        assert r["num_itl_samples"] == 3 * 19
    assert set(report["comparison"]) == {"chunked-16", "chunked-32"}
    assert set(report["verdict"]) == {"p99_itl_reduction_met", "throughput_met"}
    assert report["machine"]["torch_threads"] == torch.get_num_threads()
    assert report["settings"]["clock"] == "cpu"
    assert len(report["machine"]["load_average_end"]) == 3


def test_the_chosen_budget_must_be_one_of_the_budgets(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--budgets", "16,32", "--chosen-budget", "64"])
    assert "--chosen-budget 64 is not in --budgets 16,32" in capsys.readouterr().err
