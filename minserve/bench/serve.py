"""`minserve bench serve`: load-test any OpenAI-compatible server, vLLM's way.

    minserve bench serve --base-url http://127.0.0.1:8000 --workload random \
        --num-prompts 64 --input-len 128 --output-len 64 --request-rate 2 \
        --goodput ttft:1000 tpot:100 --output benchmarks/serve_run

Writes OUTPUT.json (settings, summary, per-request records), OUTPUT.md (a table) and
OUTPUT.png (TTFT and ITL distributions) and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from dataclasses import asdict
from pathlib import Path

import httpx

from minserve.bench.serve_client import Endpoint
from minserve.bench.serve_load import LoadResult, LoadSpec, run_load
from minserve.bench.serve_metrics import parse_goodput, summarize
from minserve.bench.serve_workloads import WORKLOADS, WorkloadSpec, build_workload


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("serve", help="load-test an OpenAI-compatible server (TTFT, ITL, goodput)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="without /v1")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", default="random", choices=WORKLOADS)
    p.add_argument("--num-prompts", type=int, default=100, help="sessions (one per prompt)")
    p.add_argument("--input-len", type=int, default=128, help="tokens (words for multi-turn)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: shared tokens")
    p.add_argument("--num-turns", type=int, default=3, help="multi-turn: turns per session")
    p.add_argument("--vocab-size", type=int, default=49152, help="random token ids below this")
    p.add_argument("--request-rate", type=float, default=math.inf, help="sessions/s; inf: all")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS",
                   help="SLOs, e.g. ttft:1000 tpot:100 (e2el too)")  # fmt: skip
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="write OUTPUT.{json,md,png}")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    slos = parse_goodput(args.goodput)
    percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    endpoint = Endpoint(args.base_url.rstrip("/"), args.model or "", args.api_key)
    if not endpoint.model:
        endpoint = Endpoint(endpoint.base_url, first_model(endpoint), args.api_key)
    spec = WorkloadSpec(args.workload, args.num_prompts, args.input_len, args.output_len,
                        args.prefix_len, args.num_turns, args.vocab_size, args.seed)  # fmt: skip
    load = LoadSpec(args.request_rate, args.burstiness, args.max_concurrency, args.seed)
    result = asyncio.run(run_load(endpoint, build_workload(spec), load, not args.no_progress))
    report = make_report(result, endpoint, spec, load, slos, percentiles, args.command_line)
    print(markdown([report]))
    if args.output is not None:
        print("wrote " + ", ".join(str(p) for p in write_report(report, args.output)))
    return 0


def first_model(endpoint: Endpoint) -> str:
    response = httpx.get(endpoint.base_url + "/v1/models", headers=endpoint.headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def make_report(
    result: LoadResult, endpoint: Endpoint, spec: WorkloadSpec, load: LoadSpec,
    slos: dict[str, float], percentiles: list[float], command: str = "",
) -> dict:  # fmt: skip
    settings = {"base_url": endpoint.base_url, "model": endpoint.model, **asdict(spec),
                **asdict(load)}  # fmt: skip
    settings["request_rate"] = str(load.request_rate)  # JSON has no inf
    return {
        "command": command,
        "settings": settings,
        "summary": summarize(result.records, result.duration_s, slos, percentiles),
        "records": [asdict(r) for r in result.records],
    }


def markdown(reports: list[dict]) -> str:
    """One row per run (its "label", or the model): throughputs, goodput, latency p50 / p99."""
    head = ("| run | rate (req/s) | done | req/s | out tok/s | goodput (req/s) | TTFT p50 / p99 "
            "(ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | E2E p50 / p99 (ms) |")  # fmt: skip
    rows = [head, "|" + "---|" * 10]
    for r in reports:
        s = r["summary"]
        good = "-" if s["request_goodput"] is None else f"{s['request_goodput']:.2f}"
        lat = [f"{s[k]['p50']:.0f} / {s[k]['p99']:.0f}" for k in ("ttft_ms", "tpot_ms", "itl_ms",
                                                                  "e2el_ms")]  # fmt: skip
        name = r.get("label") or r["settings"]["model"]
        rows.append(f"| {name} | {r['settings']['request_rate']} | "
                    f"{s['completed']}/{s['completed'] + s['failed']} | "
                    f"{s['request_throughput']:.2f} | {s['output_throughput']:.1f} | {good} | "
                    + " | ".join(lat) + " |")  # fmt: skip
    return "\n".join(rows)


def write_report(report: dict, output: Path) -> list[Path]:
    output.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = output.with_suffix(".json"), output.with_suffix(".md")
    json_path.write_text(json.dumps(report, indent=2))
    md_path.write_text(f"`{report['command']}`\n\n{markdown([report])}\n")
    return [json_path, md_path, plot_latencies(report, output.with_suffix(".png"))]


def plot_latencies(report: dict, path: Path) -> Path:
    """TTFT and ITL histograms of one run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in report["records"] if r["success"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.hist([r["ttft"] * 1000 for r in done], bins=30)
    a.set(title="time to first token", xlabel="ms", ylabel="requests")
    b.hist([gap * 1000 for r in done for gap in r["itl"]], bins=30)
    b.set(title="inter-token latency", xlabel="ms", ylabel="gaps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
