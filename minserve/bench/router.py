"""`minserve bench router`: round_robin against cache_aware routing over the same replicas.

    minserve bench router --replicas 2 --workload multi-turn --num-prompts 16 \
        --request-rate 4 --goodput ttft:1000 tpot:100 --output benchmarks/router

For each policy, fresh replicas (one `LLM` each, prefix caching on, sharing the loaded
weights) are served in this process with a router in front; `bench serve`'s load generator
runs the workload through the router; then each replica's engine says how many prompt tokens
its prefix cache served. Same workload, seed and arrivals for both policies, one run: the
ratio is what to read. Replicas share this process's cores, so absolute times are pessimistic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from minserve.bench.serve import first_model
from minserve.bench.serve_client import Endpoint
from minserve.bench.serve_load import LoadSpec, run_load
from minserve.bench.serve_metrics import parse_goodput, summarize
from minserve.bench.serve_workloads import WORKLOADS, WorkloadSpec, build_workload
from minserve.router.policy import POLICIES

if TYPE_CHECKING:
    from minserve.model.loader import LoadedModel
    from minserve.server.background import BackgroundServer


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """The `router` subcommand of `minserve bench`."""
    p = kinds.add_parser("router", help="prefix hit rate and goodput: round_robin vs cache_aware")
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--balance-threshold", type=int, default=4)
    p.add_argument("--workload", default="multi-turn", choices=WORKLOADS)
    p.add_argument("--num-prompts", type=int, default=16, help="sessions")
    p.add_argument("--input-len", type=int, default=32, help="tokens (words for multi-turn)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: shared tokens")
    p.add_argument("--num-turns", type=int, default=3, help="multi-turn: turns per session")
    p.add_argument("--request-rate", type=float, default=math.inf, help="sessions/s")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="*", default=["ttft:1000", "tpot:100"], metavar="NAME:MS")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="write OUTPUT.json and OUTPUT.md")
    p.set_defaults(run=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    from minserve.llm import LLM

    if args.replicas < 2:
        raise ValueError(f"--replicas must be at least 2 to compare routing, got {args.replicas}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or any(p not in POLICIES for p in policies):
        raise ValueError(f"--policies: choose from {', '.join(POLICIES)}, got {args.policies!r}")
    slos = parse_goodput(args.goodput)
    spec = WorkloadSpec(args.workload, args.num_prompts, args.input_len, args.output_len,
                        args.prefix_len, args.num_turns, seed=args.seed)  # fmt: skip
    load = LoadSpec(args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed)
    loaded = LLM(args.model, engine="reference").loaded  # weights once, for every replica
    runs = [_run_policy(loaded, policy, spec, load, slos, args) for policy in policies]
    report = {"command": args.command_line, "workload": spec.__dict__, "runs": runs}
    report["load"] = {"request_rate": str(load.request_rate),
                      "max_concurrency": load.max_concurrency}  # fmt: skip
    print(markdown(report))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.with_suffix(".json").write_text(json.dumps(report, indent=2))
        args.output.with_suffix(".md").write_text(f"`{args.command_line}`\n\n{markdown(report)}\n")
        print(f"wrote {args.output.with_suffix('.json')}, {args.output.with_suffix('.md')}")
    return 0


def _run_policy(
    loaded: LoadedModel, policy: str, spec: WorkloadSpec, load: LoadSpec,
    slos: dict[str, float], args: argparse.Namespace,
) -> dict:  # fmt: skip
    """Fresh replicas and a router for `policy`; the load through it; the replicas' counts."""
    from minserve.llm import LLM
    from minserve.router.app import RouterConfig, build_router
    from minserve.server.app import build_server
    from minserve.server.background import BackgroundServer
    from minserve.server.serving import ServerConfig

    llms = [LLM(loaded, enable_prefix_caching=True, num_blocks=args.num_blocks)
            for _ in range(args.replicas)]  # fmt: skip
    replicas = [BackgroundServer(build_server(llm, ServerConfig("model"))) for llm in llms]
    urls = [replica.start() for replica in replicas]
    config = RouterConfig(tuple(urls), policy, balance_threshold=args.balance_threshold)
    router = BackgroundServer(build_router(config))
    try:
        endpoint = Endpoint(router.start(), "")
        endpoint = Endpoint(endpoint.base_url, first_model(endpoint))
        result = asyncio.run(run_load(endpoint, build_workload(spec), load, progress=False))
        done = sum(r.success for r in result.records)
        stats = _idle_stats(replicas, done)
    finally:
        router.stop()
        for replica in replicas:
            replica.stop()
    queries = sum(s["prefix_cache_queries"] for s in stats)
    hits = sum(s["prefix_cache_hits"] for s in stats)
    return {
        "policy": policy,
        "requests_per_replica": [int(s["num_requests_finished"]) for s in stats],
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "summary": summarize(result.records, result.duration_s, slos),
    }


def _idle_stats(
    replicas: list[BackgroundServer], finished: int, timeout_s: float = 10.0
) -> list[dict]:
    """Each replica's engine stats once they account for every finished request."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [replica.server.engine.stats for replica in replicas]
        if sum(s["num_requests_finished"] for s in stats) >= finished:
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas report fewer than {finished} finished requests")
        time.sleep(0.02)


def markdown(report: dict) -> str:
    """One row per policy: where requests went, prefix hit rate, goodput, latency."""
    rows = ["| policy | requests per replica | prefix hit rate | goodput (req/s) | req/s | "
            "TTFT p50 / p99 (ms) | E2E p50 (ms) |", "|" + "---|" * 7]  # fmt: skip
    for run in report["runs"]:
        s = run["summary"]
        good = "-" if s["request_goodput"] is None else f"{s['request_goodput']:.2f}"
        rows.append(
            f"| {run['policy']} | {run['requests_per_replica']} | {run['prefix_hit_rate']:.1%} | "
            f"{good} | {s['request_throughput']:.2f} | {s['ttft_ms']['p50']:.0f} / "
            f"{s['ttft_ms']['p99']:.0f} | {s['e2el_ms']['p50']:.0f} |"
        )
    return "\n".join(rows)
