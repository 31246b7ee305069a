"""benchmarks/gpu_attention.py's plumbing, in its CPU dry mode: tiny shapes, interpreter.

The real run needs a GPU; this proves that when one is lent, the script gets as far as the
numbers: every kernel checked against its reference, every shape timed, JSON and markdown.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from minserve.course.chapters import REPO_ROOT


def load_script():
    path = REPO_ROOT / "benchmarks" / "gpu_attention.py"
    spec = importlib.util.spec_from_file_location("gpu_attention", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_checks_every_kernel_and_times_every_shape(tmp_path: Path) -> None:
    script = load_script()
    out = tmp_path / "gpu_attention.json"
    script.main(["--dry-run", "--out", str(out)])
    result = json.loads(out.read_text())
    kernels = {"store", "decode", "decode_split_k", "prefill"}
    assert {c["kernel"] for c in result["checks"]} == kernels
    assert len(result["checks"]) == len(kernels) * len(script.LAYOUTS) * 2  # bf16 and fp32
    failed = [c for c in result["checks"] if not c["ok"]]
    assert not failed, failed
    shapes = len(script.DRY_DECODE) + len(script.DRY_PREFILL)
    assert len(result["timings"]) == shapes * len(script.LAYOUTS)
    for row in result["timings"]:
        assert row["seconds"]["minserve"] > 0 and row["seconds"]["sdpa_gathered"] > 0
        assert 0 < row["minserve_bw_fraction"] and row["speedup_vs_sdpa"] > 0
    table = out.with_suffix(".md").read_text()
    assert table.count("\n| decode |") + table.count("\n| prefill |") == len(result["timings"])
