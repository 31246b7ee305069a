"""benchmarks/scheduler_overhead.py: the record of a tiny run, with its target and machine."""

from __future__ import annotations

import json

import torch

from benchmarks.scheduler_overhead import main

PHASES = ("schedule", "prepare", "forward", "sample", "update")


def test_record_writes_json_and_markdown(tiny_model, tmp_path) -> None:
    out = tmp_path / "overhead"
    args = ["--model", str(tiny_model("llama"))]
    assert main([*args, "--batch-sizes", "2,4", "--steps", "2", "--output", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert [r["num_requests"] for r in report["results"]] == [2, 4]
    for r in report["results"]:
        assert r["num_steps"] == 2
        assert set(r["phase_ms"]) == {*PHASES, "propose"}
    assert report["machine"]["torch_threads"] == torch.get_num_threads()
    assert report["target"] == {"num_requests": 64, "overhead_fraction_below": 0.05}
    assert "| 4 |" in out.with_suffix(".md").read_text()
