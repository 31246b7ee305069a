"""benchmarks/offline_throughput.py: the peers beside minserve, the report's ratios, the suite."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.offline_peers import left_padded, run_hf_static, static_batches
from benchmarks.offline_report import OfflineReport, markdown, write_report
from benchmarks.offline_throughput import main
from minserve.bench.offline import OfflineRequest, OfflineResult


def test_static_batches_keep_order_and_left_pad() -> None:
    workload = [OfflineRequest([5, 6, 7], 2), OfflineRequest([8], 3), OfflineRequest([9, 9], 1)]
    batches = static_batches(workload, 2)
    assert batches == [workload[:2], workload[2:]]
    ids, mask = left_padded(batches[0], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def _report(results: list[OfflineResult]) -> OfflineReport:
    settings = dict(
        num_requests=4, min_len=1, max_len=8, seed=0, temperature=0.6, requested_tokens=400
    )
    return OfflineReport(
        "python -m benchmarks.offline_throughput", "2026-01-01", {"cores": 2}, settings, results
    )


RESULTS = [
    OfflineResult("minserve", "bfloat16", output_tokens=400, generated_tokens=400, seconds=1.0),
    OfflineResult("hf16", "bfloat16", output_tokens=400, generated_tokens=512, seconds=4.0),
    OfflineResult("hf64", "bfloat16", output_tokens=400, generated_tokens=600, seconds=2.0),
    OfflineResult("vllm", "bfloat16", output_tokens=400, generated_tokens=400, seconds=0.8),
    OfflineResult("minserve", "float32", output_tokens=400, generated_tokens=400, seconds=2.0),
]


def test_ratios_compare_runs_of_the_same_dtype() -> None:
    report = _report(RESULTS)
    assert report.ratios(RESULTS[0]) == pytest.approx({"vllm": 0.8, "hf16": 4.0, "hf64": 2.0})
    assert report.ratios(RESULTS[4]) == {"vllm": None, "hf16": None, "hf64": None}


def test_markdown_table_shows_throughput_and_ratios() -> None:
    text = markdown(_report(RESULTS))
    row = "| minserve (paged engine) | bfloat16 | 400.0 | 400 / 400 | 1.0 | 0.80x | 4.00x | 2.00x |"
    assert row in text
    assert "| HF generate, static batches of 16 | bfloat16 | 100.0 | 400 / 512 | 4.0 |" in text
    assert "- minserve bfloat16: 400.0 tok/s; 0.80x vLLM CPU 0.32.0 (target 1x)" in text


def test_json_report_holds_ratios_and_missing_peers(tmp_path) -> None:
    missing = OfflineResult("vllm", "float32", "not installed", note="run the install script")
    written = write_report(_report([*RESULTS, missing]), tmp_path / "out")
    assert [p.suffix for p in written][:2] == [".json", ".md"]
    data = json.loads((tmp_path / "out.json").read_text())
    first = data["results"][0]
    assert first["tokens_per_s"] == 400.0
    assert first["ratios"] == {"vllm": 0.8, "hf16": 4.0, "hf64": 2.0}
    assert data["results"][-1]["status"] == "not installed"
    assert data["results"][-1]["tokens_per_s"] == 0.0
    assert "| vLLM CPU 0.32.0 | float32 | not installed |" in (tmp_path / "out.md").read_text()


def test_hf_static_batches_decode_to_their_longest_request(tiny_model) -> None:
    workload = [OfflineRequest([10, 11, 12], 2), OfflineRequest([13], 5), OfflineRequest([14], 3)]
    torch.manual_seed(0)
    result = run_hf_static(workload, 2, "float32", tiny_model("llama"))
    assert result.output_tokens == 10  # useful: what was asked for
    assert result.generated_tokens == 2 * 5 + 1 * 3  # each batch runs to its longest
    assert result.tokens_per_s > 0


def test_suite_reports_vllm_as_not_installed(tmp_path, capsys) -> None:
    out = tmp_path / "bench"
    argv = ["--peers", "vllm", "--dtype", "bfloat16", "--output", str(out)]
    assert main([*argv, "--vllm-python", str(tmp_path / "no-python")]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["status"] for r in data["results"]] == ["not installed"]
    assert "install_vllm_cpu.sh" in data["results"][0]["note"]
    assert " -m benchmarks.offline_throughput --peers vllm" in data["command"]
    assert "not installed" in capsys.readouterr().out


def test_suite_rejects_unknown_peers(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--peers", "minserve,sglang"])
    assert exited.value.code == 2
    assert "unknown peer 'sglang'" in capsys.readouterr().err


def test_fewer_bytes_reads_targets_and_floors_from_its_rows() -> None:
    from benchmarks.fewer_bytes import CONFIGS, step_bytes, targets
    from minserve.bench.offline import OfflineResult

    rows = [
        {"config": "minserve bf16", "workload": "offline", "tok_s": 300.0},
        {"config": "vllm bf16", "workload": "offline", "tok_s": 200.0},
        {"config": "minserve bf16", "workload": "batch1", "tok_s": 50.0, "share_of_floor": 0.4},
        {"config": "vllm bf16", "workload": "batch1", "status": "failed"},
        {"config": "minserve gguf", "workload": "offline", "tok_s": 150.0},
        {"config": "minserve gguf bf16", "workload": "offline", "tok_s": 250.0},
    ]
    verdicts = {name: (got, met) for name, got, _, met in targets(rows)}
    assert verdicts["offline bf16 vs vLLM bf16"] == (1.5, True)
    assert verdicts["batch-1 bf16, share of the bandwidth floor"] == (0.4, False)
    assert verdicts["batch-1 minserve gguf vs vLLM bf16 batch-1"] == (None, None)
    assert verdicts["offline minserve gguf bf16 vs vLLM bf16"] == (1.25, True)  # the better
    by_name = {c.name: c for c in CONFIGS}
    summary = "quantization=gguf(Q4_1:210; weights 92.0 MiB)"
    gguf = OfflineResult("minserve", "float32", "ok", 1, 1, 1.0, details={"execution": summary})
    assert step_bytes(by_name["minserve gguf"], gguf, 1000) == 92 * 2**20
    plain = OfflineResult("vllm", "bfloat16", "ok", 1, 1, 1.0)
    assert step_bytes(by_name["vllm bf16"], plain, 1000) == 500
