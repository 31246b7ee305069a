"""Bytes per token against vLLM CPU: every weight and KV format, offline and at batch 1.

    python -m benchmarks.fewer_bytes --max-load 1.5      # writes benchmarks/fewer_bytes.*

Two workloads, each run by every configuration in its own process, one after another, on
one saved copy (`benchmarks/offline_throughput.py`'s peers): offline, 64 requests of random
token ids with prompt and output lengths uniform in [32, 256] (seed 0, ignore_eos); batch
1, one 128-token prompt and 128 output tokens. minserve runs in float32 and bfloat16, with
`quantization="gguf"` (the bundled file's blocks as stored) and `"int8"`, and with 8-bit KV
caches (int8, fp8_e4m3); vLLM CPU in bfloat16 (its default) and float32, on the
same weights. The same run measures the machine's floors: the copy bandwidth (a sum over
512 MiB) and matmul FLOP/s, so batch-1 speed can be read as a share of bandwidth / bytes
per step. The report says which targets are met.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks.offline_peers import save_workload
from benchmarks.offline_throughput import SuiteSettings, run_one
from benchmarks.run_env import REPO_ROOT, machine_info
from minserve.bench.checkpoint import vocab_size
from minserve.bench.offline import OfflineResult, offline_workload
from minserve.loader import load_model
from minserve.viz.naive import measure_matmul_flops, measure_memory_bandwidth, weight_bytes

WORKLOADS = {"offline": (64, 32, 256), "batch1": (1, 128, 128)}  # requests, min, max length


@dataclass(frozen=True)
class Config:
    """One engine configuration: who runs, in which dtype, with which LLM options."""

    name: str
    peer: str  # "minserve" or "vllm"
    dtype: str
    options: tuple[tuple[str, Any], ...] = ()


CONFIGS = (
    Config("minserve fp32", "minserve", "float32"),
    Config("minserve bf16", "minserve", "bfloat16"),
    Config("minserve gguf", "minserve", "float32", (("quantization", "gguf"),)),
    Config("minserve gguf bf16", "minserve", "bfloat16", (("quantization", "gguf"),)),
    Config("minserve int8", "minserve", "float32", (("quantization", "int8"),)),
    Config("minserve int8 bf16", "minserve", "bfloat16", (("quantization", "int8"),)),
    Config("minserve bf16 kv int8", "minserve", "bfloat16", (("kv_cache_dtype", "int8"),)),
    Config("minserve bf16 kv fp8", "minserve", "bfloat16", (("kv_cache_dtype", "fp8_e4m3"),)),
    Config("vllm bf16", "vllm", "bfloat16"),
    Config("vllm fp32", "vllm", "float32"),
)


@dataclass(frozen=True)
class Floors:
    """The machine's limits, measured in this run."""

    bandwidth_gb_s: float
    matmul_gflop_s_fp32: float
    matmul_gflop_s_bf16: float


def measure_floors() -> Floors:
    return Floors(
        bandwidth_gb_s=measure_memory_bandwidth() / 1e9,
        matmul_gflop_s_fp32=measure_matmul_flops(1024) / 1e9,
        matmul_gflop_s_bf16=measure_matmul_flops(1024, dtype=torch.bfloat16) / 1e9,
    )


def step_bytes(config: Config, result: OfflineResult, fp32_bytes: int) -> int:
    """Weight bytes one decode step reads: the stored weights (quantized: as the start-up
    line says; vLLM and plain minserve: the parameters in their dtype)."""
    stored = re.search(r"weights ([\d.]+) MiB", result.details.get("execution", ""))
    if stored:
        return int(float(stored.group(1)) * 2**20)
    return fp32_bytes // 2 if config.dtype == "bfloat16" else fp32_bytes


def run_config(
    config: Config, workload: str, workdir: Path, settings: SuiteSettings
) -> OfflineResult:
    """One configuration on one saved workload, in its own process."""
    peer_settings = replace(settings, llm_options=config.options)
    path = workdir / f"{workload}.json"
    return run_one(config.peer, config.dtype, workdir, path, peer_settings)


def measure(
    settings: SuiteSettings, configs: tuple[Config, ...], workloads: tuple[str, ...]
) -> dict[str, Any]:
    """Floors, then every configuration on both workloads; the rows of the report."""
    floors = measure_floors()
    fp32_bytes = weight_bytes(load_model(settings.model, dtype="float32", prepack=False).model)
    vocab = vocab_size(settings.model)
    rows = []
    with tempfile.TemporaryDirectory(prefix="minserve-bytes-") as tmp:
        workdir = Path(tmp)
        for name in workloads:
            n, lo, hi = WORKLOADS[name]
            save_workload(
                offline_workload(n, lo, hi, settings.seed, vocab), workdir / f"{name}.json"
            )
        runs = [(c, w) for w in workloads for c in configs]
        for config, workload in tqdm(runs, desc="fewer bytes", unit="run"):
            result = run_config(config, workload, workdir, settings)
            row = {"config": config.name, "workload": workload, "status": result.status}
            if result.ok:
                row["tok_s"] = round(result.tokens_per_s, 1)
                nbytes = step_bytes(config, result, fp32_bytes)
                row["step_mib"] = round(nbytes / 2**20, 1)
                floor = floors.bandwidth_gb_s * 1e9 / nbytes
                row["floor_tok_s"] = round(floor, 1)
                row["share_of_floor"] = round(result.tokens_per_s / floor, 3)
            else:
                row["note"] = result.note
            tqdm.write(json.dumps(row))
            rows.append(row)
    return {"floors": asdict(floors), "rows": rows}


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, float | None, float, bool | None]]:
    """(target, measured ratio, required, met) for each target this run can judge; a
    quantized model is judged in its better dtype (best configuration against vLLM's)."""
    tok = {(r["config"], r["workload"]): r.get("tok_s") for r in rows}
    share = {(r["config"], r["workload"]): r.get("share_of_floor") for r in rows}

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> float | None:
        return None if not tok.get(a) or not tok.get(b) else round(tok[a] / tok[b], 2)

    def best(configs: tuple[str, ...], workload: str) -> tuple[str, str]:
        measured = [c for c in configs if tok.get((c, workload))]
        return max(measured, key=lambda c: tok[(c, workload)], default=configs[0]), workload

    gguf = ("minserve gguf", "minserve gguf bf16")
    vllm_offline, vllm_batch1 = ("vllm bf16", "offline"), ("vllm bf16", "batch1")
    gguf_batch1, gguf_offline = best(gguf, "batch1"), best(gguf, "offline")
    checks = [
        ("offline bf16 vs vLLM bf16", ratio(("minserve bf16", "offline"), vllm_offline), 1.2),
        ("batch-1 bf16, share of the bandwidth floor", share.get(("minserve bf16", "batch1")), 0.6),
        (f"batch-1 {gguf_batch1[0]} vs vLLM bf16 batch-1", ratio(gguf_batch1, vllm_batch1), 2.0),
        (f"offline {gguf_offline[0]} vs vLLM bf16", ratio(gguf_offline, vllm_offline), 1.0),
    ]
    return [(name, got, need, None if got is None else got >= need) for name, got, need in checks]


def markdown(record: dict[str, Any]) -> str:
    f = record["floors"]
    lines = [
        "# Bytes per token: minserve's formats against vLLM CPU",
        "",
        f"- command: `{record['command']}`",
        f"- date: {record['date']}; machine: {record['machine'].get('cpu', '?')}, "
        f"{record['machine'].get('cores', '?')} cores",
        f"- floors measured in this run: copy bandwidth {f['bandwidth_gb_s']:.1f} GB/s; "
        f"matmul {f['matmul_gflop_s_fp32']:.0f} GFLOP/s fp32, "
        f"{f['matmul_gflop_s_bf16']:.0f} GFLOP/s bf16",
        "- offline: 64 requests, random token ids, prompt and output lengths uniform in "
        "[32, 256], temperature 0.6, ignore_eos; batch 1: one 128-token prompt, 128 tokens",
        "",
        "| config | workload | output tok/s | weights read per step (MiB) | batch-1 bandwidth "
        "floor tok/s | share of floor |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in record["rows"]:
        if "tok_s" in r and r["workload"] == "batch1":
            lines.append(
                f"| {r['config']} | {r['workload']} | {r['tok_s']} | {r['step_mib']} | "
                f"{r['floor_tok_s']} | {r['share_of_floor']:.0%} |"
            )
        elif "tok_s" in r:  # a step serves many sequences: the batch-1 floor does not apply
            lines.append(
                f"| {r['config']} | {r['workload']} | {r['tok_s']} | {r['step_mib']} | | |"
            )
        else:
            lines.append(f"| {r['config']} | {r['workload']} | {r['status']} | | | |")
    lines += ["", "| target | measured | required | met |", "|---|---:|---:|---|"]
    for name, got, need, met in record["targets"]:
        verdict = "not measured" if met is None else ("yes" if met else "no")
        lines.append(f"| {name} | {'-' if got is None else got} | {need} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(c.name for c in CONFIGS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="offline,batch1")
    parser.add_argument("--max-load", type=float, default=1.5)
    parser.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"))
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "benchmarks" / "fewer_bytes")
    args = parser.parse_args(argv)
    wanted = args.configs.split(",")
    unknown = sorted(set(wanted) - {c.name for c in CONFIGS})
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {[c.name for c in CONFIGS]}")
    configs = tuple(c for c in CONFIGS if c.name in wanted)
    workloads = tuple(args.workloads.split(","))
    if not set(workloads) <= set(WORKLOADS):
        parser.error(f"unknown workloads in {workloads}; choose from {list(WORKLOADS)}")
    settings = SuiteSettings(max_load=args.max_load, vllm_python=args.vllm_python)
    record = measure(settings, configs, workloads)
    words = sys.argv[1:] if argv is None else argv
    record = {
        "command": " ".join(["python -m benchmarks.fewer_bytes", *words]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        **record,
    }
    record["targets"] = targets(record["rows"])
    args.output.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    table = markdown(record)
    args.output.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
