"""Serving: minserve against vLLM's CPU build, same model, same Poisson load, one after another.

    .venv/bin/python benchmarks/serve.py [--rates 0.25,0.5,1] [--num-prompts 16]

Each server runs in its own process (`minserve serve`, then vLLM's OpenAI server from
.venv-vllm) on the same Hugging Face folder of SmolLM2-135M-Instruct in float32, alone on
the machine. For each rate, `minserve bench serve`'s load generator sends the same seeded
workload (random token-id prompts of 128 tokens, 64 output tokens, ignore_eos, greedy,
Poisson arrivals) and measures TTFT, TPOT, ITL, E2E and goodput at TTFT <= 1 s and
TPOT <= 100 ms (the issue's SLOs) and at a CPU-sized SLO. Writes serve.json and serve.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from minserve.bench.offline_suite import hf_model_folder, vllm_env
from minserve.bench.serve import make_report, markdown
from minserve.bench.serve_client import Endpoint
from minserve.bench.serve_load import LoadSpec, run_load
from minserve.bench.serve_metrics import parse_goodput, summarize
from minserve.bench.serve_workloads import WorkloadSpec, build_workload

HERE = Path(__file__).resolve().parent
SLOS = {"issue": ["ttft:1000", "tpot:100"], "cpu": ["ttft:5000", "tpot:500"]}
NAME = "smollm2"
CAVEAT = (
    "The machine has 2 cores shared with other work: a row whose load average is above 2 "
    "ran contended, and its latencies say more about the neighbours than about the server. "
    "Compare servers only at similar load, and rerun on an idle machine before drawing a "
    "conclusion."
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(peer: str, folder: Path, port: int, max_model_len: int) -> tuple[list, dict]:
    common = ["--model", str(folder), "--dtype", "float32", "--port", str(port),
              "--served-model-name", NAME, "--max-model-len", str(max_model_len)]  # fmt: skip
    if peer == "minserve":
        return [sys.executable, "-m", "minserve.cli", "serve", *common], {}
    python = HERE.parent / ".venv-vllm" / "bin" / "python"
    env = vllm_env()
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp.resolve())
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", *common, "--seed", "0"], env


def start(command: list, env: dict, port: int, log: Path) -> subprocess.Popen:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               env=full_env, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(process)
    raise RuntimeError(f"server on port {port} did not come up in 600 s")


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def bench_peer(peer: str, folder: Path, rates: list[float], args: argparse.Namespace) -> list:
    port = free_port()
    command, env = server_command(peer, folder, port, args.input_len + args.output_len + 16)
    logs = HERE.parent / ".cache"
    logs.mkdir(exist_ok=True)
    process = start(command, env, port, logs / f"serve-{peer}.log")
    endpoint = Endpoint(f"http://127.0.0.1:{port}", NAME)
    spec = WorkloadSpec("random", args.num_prompts, args.input_len, args.output_len, seed=0)
    reports = []
    try:
        warm = WorkloadSpec("random", 2, args.input_len, 8, seed=99)
        asyncio.run(run_load(endpoint, build_workload(warm), LoadSpec(), progress=False))
        for rate in rates:
            load = LoadSpec(request_rate=rate, seed=0)
            result = asyncio.run(run_load(endpoint, build_workload(spec), load, progress=False))
            slos = parse_goodput(SLOS["issue"])
            report = make_report(result, endpoint, spec, load, slos, [50, 90, 99])
            report["label"] = peer
            report["cpu_slo_goodput"] = summarize(
                result.records, result.duration_s, parse_goodput(SLOS["cpu"])
            )["request_goodput"]
            report["load_average"] = round(os.getloadavg()[0], 2)
            del report["records"]
            reports.append(report)
            print(markdown([report]).splitlines()[-1], flush=True)
    finally:
        stop(process)
    return reports


def write(reports: list, command: str) -> None:
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    record = {"command": command, "date": stamp, "slos": SLOS, "runs": reports}
    (HERE / "serve.json").write_text(json.dumps(record, indent=2))
    lines = [
        "# Serving: minserve vs vLLM CPU (same model, same Poisson load)",
        "",
        f"- command: `{command}`",
        f"- date: {stamp}; machine: {os.cpu_count()} cores, shared (load average per row)",
        "- model: SmolLM2-135M-Instruct as a Hugging Face folder, float32, both servers",
        "- workload: random token-id prompts of 128 tokens, 64 output tokens, ignore_eos, "
        "temperature 0, Poisson arrivals (seed 0); each server alone, one after the other",
        f"- goodput: requests/s meeting TTFT <= 1000 ms and TPOT <= 100 ms (issue); "
        f"'cpu goodput' at {' '.join(SLOS['cpu'])}",
        "",
        markdown(reports),
        "",
        "| run | rate | cpu goodput (req/s) | load average |",
        "|---|---|---|---|",
        *[
            f"| {r['label']} | {r['settings']['request_rate']} | {r['cpu_slo_goodput']:.2f} | "
            f"{r['load_average']} |"
            for r in reports
        ],
        "",
        CAVEAT,
    ]
    (HERE / "serve.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="0.25,0.5,1")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--peers", default="minserve,vllm")
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    folder = hf_model_folder()
    reports = []
    for peer in args.peers.split(","):
        reports += bench_peer(peer, folder, rates, args)
        write(reports, shlex.join([".venv/bin/python", "benchmarks/serve.py", *sys.argv[1:]]))
    print(markdown(reports))


if __name__ == "__main__":
    main()
