"""Serving: minserve against vLLM's CPU build, same model, same Poisson load, taking turns.

    .venv/bin/python -m benchmarks.serve [--rates 0.25,0.5,1] [--num-prompts 16]
    .venv/bin/python -m benchmarks.serve --rates 2,4,6 --duration 30 --repeats 1 \
        --minserve-args="--dtype bfloat16" --vllm-args="--dtype bfloat16" --output serve_best

Each server runs in its own process (`minserve serve` and vLLM's OpenAI server from
.venv-vllm) on the same Hugging Face folder of SmolLM2-135M-Instruct, in float32 unless
`--minserve-args` / `--vllm-args` add options of their own (the last `--dtype` wins); both
are up at once and take turns (A B B A per rate), so that a machine drifting slower or
faster favours neither. For each rate, `minserve bench serve`'s load generator sends the
same seeded workload (random token-id prompts of 128 tokens, 64 output tokens, ignore_eos,
greedy, Poisson arrivals; `--num-prompts` of them, or `--duration` seconds' worth at each
rate) and measures TTFT, TPOT, ITL, E2E and goodput at TTFT <= 1 s and TPOT <= 100 ms (an
interactive SLO) and at a CPU-sized SLO. Writes benchmarks/OUTPUT.json and .md (`--output`,
default serve).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from benchmarks.run_env import command_line
from benchmarks.vllm_peer import vllm_env
from minserve.bench.checkpoint import hf_model_folder
from minserve.bench.serve import make_report, markdown
from minserve.bench.serve_client import Endpoint
from minserve.bench.serve_load import LoadSpec, run_load
from minserve.bench.serve_metrics import parse_goodput, summarize
from minserve.bench.serve_workloads import WorkloadSpec, build_workload

HERE = Path(__file__).resolve().parent
SLOS = {"interactive": ["ttft:1000", "tpot:100"], "cpu": ["ttft:5000", "tpot:500"]}
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


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """Each peer's extra server options (after the common ones, so they override them)."""
    p.add_argument("--minserve-args", default="", help='e.g. "--dtype bfloat16"')
    p.add_argument("--vllm-args", default="", help='e.g. "--dtype bfloat16"')


def server_command(
    peer: str, folder: Path, port: int, max_model_len: int, extra: str = ""
) -> tuple[list, dict]:
    common = ["--model", str(folder), "--dtype", "float32", "--port", str(port),
              "--served-model-name", NAME, "--max-model-len", str(max_model_len),
              *shlex.split(extra)]  # fmt: skip
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


def start_peer(peer: str, folder: Path, args: argparse.Namespace) -> tuple:
    """Start one server and warm it up; (process, endpoint)."""
    port = free_port()
    extra = getattr(args, f"{peer}_args")
    command, env = server_command(peer, folder, port, args.input_len + args.output_len + 16, extra)
    logs = HERE.parent / ".cache"
    logs.mkdir(exist_ok=True)
    process = start(command, env, port, logs / f"serve-{peer}.log")
    endpoint = Endpoint(f"http://127.0.0.1:{port}", NAME)
    warm = WorkloadSpec("random", 2, args.input_len, 8, seed=99)
    asyncio.run(run_load(endpoint, build_workload(warm), LoadSpec(), progress=False))
    return process, endpoint


def run_once(peer: str, endpoint: Endpoint, rate: float, repeat: int, args) -> dict:
    """One seeded Poisson run of the workload against one server."""
    spec = WorkloadSpec("random", num_prompts(rate, args), args.input_len, args.output_len, seed=0)
    load = LoadSpec(request_rate=rate, seed=0)
    result = asyncio.run(run_load(endpoint, build_workload(spec), load, progress=False))
    slos = parse_goodput(SLOS["interactive"])
    report = make_report(result, endpoint, spec, load, slos, [50, 90, 99])
    report["label"], report["repeat"] = peer, repeat
    cpu_slos = parse_goodput(SLOS["cpu"])
    report["cpu_slo_goodput"] = summarize(result.records, result.duration_s, cpu_slos)[
        "request_goodput"
    ]
    report["load_average"] = round(os.getloadavg()[0], 2)
    # None: the request got no token (refused with a 503 under overload, or failed)
    report["ttft_ms_by_request"] = [round(r.ttft * 1e3) if r.success else None
                                    for r in result.records]  # fmt: skip
    del report["records"]  # the rest of each record is in the summary
    print(markdown([report]).splitlines()[-1], flush=True)
    return report


def num_prompts(rate: float, args: argparse.Namespace) -> int:
    """`--num-prompts`, or `--duration` seconds of arrivals at `rate`."""
    duration = getattr(args, "duration", None)
    return args.num_prompts if duration is None else max(1, round(rate * duration))


def bench_interleaved(peers: list[str], rates: list[float], args, run=run_once) -> list:
    """Both servers up at once (the idle one waits on its socket); for each rate, the runs
    alternate A B B A ..., so a machine that drifts slower or faster favours neither.
    `run(peer, endpoint, rate, repeat, args)` is one run (interop.py passes vLLM's client).

    A pause separates runs: without it, minserve's first request after a vLLM run lost
    ~0.9 s of TTFT (one request per run past the 1 s SLO), most likely to vLLM's threads
    still spinning after its last request; a CPU burner in between did not do that."""
    folder = hf_model_folder()
    servers: dict[str, tuple] = {}
    reports = []
    try:
        for peer in peers:
            servers[peer] = start_peer(peer, folder, args)
        for rate in rates:
            for repeat in range(args.repeats):
                order = peers if repeat % 2 == 0 else peers[::-1]
                for peer in order:
                    time.sleep(args.pause)  # the previous run's server spins down first
                    reports.append(run(peer, servers[peer][1], rate, repeat, args))
    finally:
        for process, _ in servers.values():
            stop(process)
    return reports


def summary_rows(reports: list, peers: list[str]) -> list[str]:
    """Per rate: each peer's median goodput and TPOT p50 over the repeats, and the ratio."""
    first, *others = peers
    head = f"| rate | {first} goodput | " + " | ".join(f"{p} goodput | ratio" for p in others)
    lines = [head + f" | {first} TPOT p50 | " + " | ".join(f"{p} TPOT p50" for p in others) + " |"]
    lines.append("|" + "---|" * (3 + 3 * len(others)))  # rate, goodputs and ratios, TPOTs

    def median_of(peer: str, rate: float, key: str) -> float:
        values = [r["summary"][key] if key == "request_goodput" else r["summary"][key]["p50"]
                  for r in reports
                  if r["label"] == peer and r["settings"]["request_rate"] == rate]  # fmt: skip
        return statistics.median(values)

    for rate in sorted({r["settings"]["request_rate"] for r in reports}):
        good = {p: median_of(p, rate, "request_goodput") for p in peers}
        tpot = {p: median_of(p, rate, "tpot_ms") for p in peers}
        cells = [f"{good[p]:.4f} | {ratio(good[first], good[p])}" for p in others]
        lines.append(f"| {rate} | {good[first]:.4f} | " + " | ".join(cells) + f" | "
                     f"{tpot[first]:.1f} | " + " | ".join(f"{tpot[p]:.1f}" for p in others)
                     + " |")  # fmt: skip
    return lines


def ratio(ours: float, theirs: float) -> str:
    """ours / theirs as "1.234x"; "-" where the peer met no SLO (0 goodput: no ratio)."""
    return f"{ours / theirs:.3f}x" if theirs > 0 else "-"


def write(reports: list, command: str, peers: list[str], args: argparse.Namespace) -> None:
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    record = {"command": command, "date": stamp, "slos": SLOS, "runs": reports}
    (HERE / f"{args.output}.json").write_text(json.dumps(record, indent=2))
    options = {peer: getattr(args, f"{peer}_args") or "(none)" for peer in peers}
    lines = [
        "# Serving: minserve vs vLLM CPU (same model, same Poisson load)",
        "",
        f"- command: `{command}`",
        f"- date: {stamp}; machine: {os.cpu_count()} cores, shared (load average per row)",
        "- model: SmolLM2-135M-Instruct as a Hugging Face folder, float32 unless the "
        "options below say otherwise; "
        + "; ".join(f"{peer} options: `{extra}`" for peer, extra in options.items()),
        "- workload: random token-id prompts of 128 tokens, 64 output tokens, ignore_eos, "
        "temperature 0, Poisson arrivals (seed 0, the same arrival times every run)",
        f"- protocol: both servers up at once, the idle one waiting; {args.repeats} runs per "
        "server and rate, alternating A B B A so that drift favours neither, 5 s apart "
        "(`--pause`); medians below",
        f"- goodput: requests/s meeting TTFT <= 1000 ms and TPOT <= 100 ms (interactive); "
        f"'cpu goodput' at {' '.join(SLOS['cpu'])}",
        "",
        *summary_rows(reports, peers),
        "",
        "Every run:",
        "",
        markdown(reports),
        "",
        "| run | rate | repeat | cpu goodput (req/s) | load average |",
        "|---|---|---|---|---|",
        *[
            f"| {r['label']} | {r['settings']['request_rate']} | {r['repeat']} | "
            f"{r['cpu_slo_goodput']:.2f} | {r['load_average']} |"
            for r in reports
        ],
        "",
        CAVEAT,
    ]
    (HERE / f"{args.output}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="0.25,0.5,1")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--peers", default="minserve,vllm")
    p.add_argument("--repeats", type=int, default=2, help="runs per server and rate")
    p.add_argument("--pause", type=float, default=5.0, help="seconds between runs")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of arrivals a run: rate x duration prompts")  # fmt: skip
    p.add_argument("--output", default="serve", help="benchmarks/OUTPUT.json and .md")
    add_server_arguments(p)
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    peers = args.peers.split(",")
    reports = bench_interleaved(peers, rates, args)
    command = command_line(__spec__.name)
    write(reports, command, peers, args)
    print("\n".join(summary_rows(reports, peers)))


if __name__ == "__main__":
    main()
