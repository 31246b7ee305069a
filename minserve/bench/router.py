"""`minserve bench router`: round_robin, cache_aware and kv_aware over the same replicas.

    minserve bench router --threads 2      # prints a row per workload and policy

For each workload (multi-turn chat, shared prefix) and each policy, fresh replicas (one `LLM`
each, prefix caching on, sharing the loaded weights; for kv_aware also publishing their KV
events, which the router follows) are served in this process with a router in front;
`bench serve`'s load generator runs the workload through the router; then each replica's
engine says how many prompt tokens its prefix cache served. Same workload, seed and
arrivals for every policy, one run: the ratios are what to read. Replicas share
this process's cores, so absolute times are pessimistic.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from minserve.bench.options import choices, set_threads
from minserve.bench.serve import first_model
from minserve.bench.serve_client import Endpoint
from minserve.bench.serve_load import LoadSpec, run_load
from minserve.bench.serve_metrics import parse_goodput, summarize
from minserve.bench.serve_workloads import WORKLOADS, Session, WorkloadSpec, build_workload
from minserve.router.policy import POLICIES, Policy

if TYPE_CHECKING:
    from minserve.loader import LoadedModel
    from minserve.router.app import Router
    from minserve.server.background import BackgroundServer

KV_EVENTS = {"enable_kv_cache_events": True}  # kv_aware's replicas: vLLM's kv_events_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default=",".join(POLICIES), help=f"from {', '.join(POLICIES)}")
    p.add_argument("--balance-threshold", type=int, default=4)
    p.add_argument("--workloads", default="multi-turn,shared-prefix",
                   help=f"comma-separated, from {', '.join(WORKLOADS)}")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=16, help="sessions per workload")
    p.add_argument("--input-len", type=int, default=32, help="tokens (words for multi-turn)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: shared tokens")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct ones")
    p.add_argument("--num-turns", type=int, default=3, help="multi-turn: turns per session")
    p.add_argument("--request-rate", type=float, default=2.0, help="sessions/s (inf: at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="*", default=["ttft:1000", "tpot:100"], metavar="NAME:MS")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """The `router` subcommand of `minserve bench`."""
    p = kinds.add_parser("router", help="prefix hit rate and goodput of each routing policy")
    add_arguments(p)
    p.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    print(table(measure(args)["runs"]))
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every workload through every policy, on fresh replicas; settings, runs and summary."""
    from minserve.llm import LLM

    if args.replicas < 2:  # (the ideal hit rate comes from one replica that sees everything)
        raise ValueError(f"--replicas must be at least 2 to compare routing, got {args.replicas}")
    policies = choices(args.policies, POLICIES, "policy")
    workloads = choices(args.workloads, WORKLOADS, "workload")
    slos = parse_goodput(args.goodput)
    base = WorkloadSpec(workloads[0], args.num_prompts, args.input_len, args.output_len,
                        args.prefix_len, args.num_turns, seed=args.seed)  # fmt: skip
    load = LoadSpec(args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed)
    warm = LLM(args.model, num_blocks=32)  # weights once, for every replica
    warm.generate([list(range(100, 300))], use_tqdm=False)  # warm-up: a prefill and decodes
    runs = []
    for workload in workloads:
        for policy in policies:
            print(f"running {workload}, {policy} ...", flush=True)
            spec = replace(base, name=workload)
            sessions = sessions_for(spec, args.num_prefixes)
            routed = asyncio.run(run_routed(warm.loaded, policy, sessions, load, slos,
                                            args.replicas, args.num_blocks,
                                            args.balance_threshold))  # fmt: skip
            runs.append({"workload": workload, **routed})
        ideal = asyncio.run(run_routed(warm.loaded, "round_robin", sessions, load, slos, 1,
                                       args.num_blocks))  # fmt: skip
        for run in runs:
            if run["workload"] == workload:
                run["ideal_hit_rate"] = ideal["prefix_hit_rate"]
    settings = {**asdict(base), "replicas": args.replicas, "request_rate": str(load.request_rate),
                "max_concurrency": load.max_concurrency, "goodput_slos_s": slos,
                "balance_threshold": args.balance_threshold,
                "num_prefixes": args.num_prefixes}  # fmt: skip
    settings.pop("name")
    return {"settings": settings, "runs": runs, "summary": summary(runs)}


def sessions_for(spec: WorkloadSpec, num_prefixes: int) -> list[Session]:
    """The workload; shared-prefix with `num_prefixes` prefixes, each shared by an equal part
    of the sessions, in a seeded random order (so no policy gets them pre-sorted)."""
    if spec.name != "shared-prefix":
        return build_workload(spec)
    if not 1 <= num_prefixes <= spec.num_sessions:
        raise ValueError(f"--num-prefixes must be in [1, {spec.num_sessions}], got {num_prefixes}")
    sessions: list[Session] = []
    for i in range(num_prefixes):
        share = len(range(i, spec.num_sessions, num_prefixes))  # sessions of prefix i
        sessions += build_workload(replace(spec, num_sessions=share, seed=spec.seed + i))
    random.Random(spec.seed).shuffle(sessions)
    return sessions


async def run_routed(
    loaded: LoadedModel, policy: str | Policy, sessions: list[Session], load: LoadSpec,
    slos: dict[str, float], replicas: int = 2, num_blocks: int | None = None,
    balance_threshold: int = 4,
) -> dict:  # fmt: skip
    """Fresh replicas (prefix caching on) and a router for `policy` (a name, or a policy
    object such as your own `CacheAware`); the load through it; the replicas' counts.
    kv_aware's replicas publish KV events, and its router tokenizes with the served model's
    tokenizer. A coroutine, so that a notebook can await it on its running event loop."""
    from minserve.engine_args import EngineArgs
    from minserve.engine_builder import build_engine
    from minserve.router.app import RouterConfig, build_router
    from minserve.server.app import build_server
    from minserve.server.background import BackgroundServer
    from minserve.server.serving import ServerConfig

    name = policy if isinstance(policy, str) else policy.name
    events = KV_EVENTS if name == "kv_aware" else None
    args = EngineArgs(model=loaded, enable_prefix_caching=True, num_blocks=num_blocks,
                      kv_events_config=events)  # fmt: skip
    engines = [build_engine(args) for _ in range(replicas)]
    servers = [BackgroundServer(build_server(e, ServerConfig("model"))) for e in engines]
    urls = [server.start() for server in servers]
    own = None if isinstance(policy, str) else policy
    config = RouterConfig(tuple(urls), balance_threshold=balance_threshold,
                          tokenizer=str(loaded.path))  # fmt: skip
    if own is None:  # a policy object of any name: the config's policy is then not used
        config = replace(config, policy=name)
    router = BackgroundServer(build_router(config, own))
    try:
        endpoint = Endpoint(router.start(), "")
        _await_feed(router.server)
        endpoint = Endpoint(endpoint.base_url, first_model(endpoint))
        result = await run_load(endpoint, sessions, load, progress=False)
        done = sum(r.success for r in result.records)
        stats = _idle_stats(servers, done)
    finally:
        router.stop()
        for server in servers:
            server.stop()
    queries = sum(s["prefix_cache_queries"] for s in stats)
    hits = sum(s["prefix_cache_hits"] for s in stats)
    later = [r.ttft for r in result.records if r.success and r.turn > 0]
    return {
        "ttft_later_turns_p50_ms": 1e3 * statistics.median(later) if later else None,
        "policy": name,
        "requests_per_replica": [int(s["num_requests_finished"]) for s in stats],
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "summary": summarize(result.records, result.duration_s, slos),
    }


def _await_feed(router: Router, timeout_s: float = 30.0) -> None:
    """Wait until a kv_aware router follows every replica's events (none to wait for else)."""
    if router.feed is None:
        return
    deadline = time.monotonic() + timeout_s
    blocks = router.feed.blocks
    while any(blocks.source(i) is None for i in range(blocks.num_replicas)):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the router follows no KV events of some replica after {timeout_s} s"
            )
        time.sleep(0.02)


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


def summary(runs: list[dict]) -> dict[str, dict[str, Any]]:
    """Per workload: cache_aware against round_robin (hit rates, goodput ratio), and under
    "kv_aware" the same for kv_aware when it ran."""
    out = {}
    for workload in dict.fromkeys(run["workload"] for run in runs):
        by = {run["policy"]: run for run in runs if run["workload"] == workload}
        if "round_robin" not in by:
            continue
        cell = _against(by["cache_aware"], by["round_robin"]) if "cache_aware" in by else {}
        if "kv_aware" in by:
            cell["kv_aware"] = _against(by["kv_aware"], by["round_robin"])
        if cell:
            out[workload] = cell
    return out


def _against(run: dict, baseline: dict) -> dict[str, Any]:
    """Hit rates [run, baseline], the run's share of the ideal hit rate (one replica holding
    everything), goodput run / baseline, and TTFT p50 of turns 2+ run / baseline."""
    good = [r["summary"]["request_goodput"] for r in (run, baseline)]
    later = [r.get("ttft_later_turns_p50_ms") for r in (run, baseline)]
    ideal = run.get("ideal_hit_rate")
    return {
        "hit_rate": [run["prefix_hit_rate"], baseline["prefix_hit_rate"]],
        "of_ideal": run["prefix_hit_rate"] / ideal if ideal else None,
        "goodput_ratio": good[0] / good[1] if None not in good and good[1] else None,
        "ttft_later_turns_ratio": later[0] / later[1] if None not in later and later[1] else None,
    }


def table(runs: list[dict]) -> str:
    """A markdown table, a row per workload and policy: where requests went, hit rate,
    goodput, latency."""
    rows = [
        "| workload | policy | requests per replica | prefix hit rate (ideal) | goodput (req/s) | "
        "req/s | TTFT p50 / p99 (ms) | TTFT p50, turns 2+ (ms) | E2E p50 (ms) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        m = run["summary"]
        good = "-" if m["request_goodput"] is None else f"{m['request_goodput']:.2f}"
        ideal = f" ({run['ideal_hit_rate']:.1%})" if "ideal_hit_rate" in run else ""
        later = run.get("ttft_later_turns_p50_ms")
        later_text = "-" if later is None else f"{later:.0f}"
        rows.append(
            f"| {run['workload']} | {run['policy']} | {run['requests_per_replica']} | "
            f"{run['prefix_hit_rate']:.1%}{ideal} | {good} | {m['request_throughput']:.2f} | "
            f"{m['ttft_ms']['p50']:.0f} / {m['ttft_ms']['p99']:.0f} | {later_text} | "
            f"{m['e2el_ms']['p50']:.0f} |"
        )
    return "\n".join(rows)
