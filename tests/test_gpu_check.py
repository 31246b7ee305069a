"""The GPU check's dry run: every stage's plumbing on the CPU, its results written as it goes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_check


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("gpu_check")
    gpu_check.main(["--output", str(output), "--dry-run"])
    return output


def test_dry_run_records_every_stage_with_a_status(dry_run: Path) -> None:
    report = json.loads((dry_run / "gpu_check.json").read_text())
    assert [s["stage"] for s in report["stages"]] == gpu_check.STAGE_NAMES
    assert {s["status"] for s in report["stages"]} == {"passed"}


def test_dry_run_compares_kernels_and_engine_backends(dry_run: Path) -> None:
    stages = {s["stage"]: s for s in json.loads((dry_run / "gpu_check.json").read_text())["stages"]}
    kernels = {row["kernel"] for row in stages["kernels"]["rows"]}
    assert kernels == {"decode splits=1", "decode splits=4", "prefill/extend", "store"}
    assert all(row["ok"] for row in stages["engine"]["rows"])
    assert len(stages["engine"]["rows"]) == 5


def test_dry_run_writes_a_markdown_table(dry_run: Path) -> None:
    page = (dry_run / "gpu_check.md").read_text()
    assert "| kernels | passed |" in page and "| throughput | passed |" in page


def test_a_stage_past_its_timeout_is_recorded_as_such(tmp_path: Path) -> None:
    stage = gpu_check.Stage("environment", 20, 30)
    record = gpu_check.run_stage(stage, tmp_path, dry_run=True, timeout_s=0.5)
    assert record["status"] == "timeout"
    assert record["error"] == "stopped after its 0.5 s timeout"


def test_stages_past_the_budget_are_skipped(tmp_path: Path) -> None:
    records = gpu_check.run_all(["environment", "kernels"], tmp_path, dry_run=True, budget_s=1)
    assert [r["status"] for r in records] == ["skipped", "skipped"]
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["stages"][1]["error"] == "the 1 s budget ran out"


def test_unknown_stage_names_are_rejected() -> None:
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--output", "x", "--stages", "kernels,warp"])


def test_python_m_dry_run_validates_every_feature_check(tmp_path: Path) -> None:
    """`python -m benchmarks.gpu_check --dry-run`: each GPU check's configuration built and
    validated on the CPU, the tiny model's greedy tokens equal transformers', exit 0."""
    import subprocess
    import sys

    from benchmarks.gpu_check_features import CHECKS

    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--stages", "features",
         "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (stage,) = json.loads((tmp_path / "gpu_check.json").read_text())["stages"]
    assert stage["status"] == "passed", stage
    checks = [row["check"] for row in stage["rows"]]
    assert checks == [*CHECKS, "tiny parity on the CPU"]
    assert stage["rows"][-1]["first_mismatch"] is None
