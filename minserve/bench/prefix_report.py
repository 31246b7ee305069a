"""`minserve bench prefix`: the prefix cache on versus off, and cache-aware versus FCFS.

    minserve bench prefix --threads 1

Writes benchmarks/prefix_cache.{json,md,png}. The issue's targets: a hit rate of at least
90% of the ideal, a time to first token at least 5x lower on hits, radix-tree upkeep
under 1% of the step time.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict
from pathlib import Path
from statistics import median
from typing import Any

from minserve.bench.prefix import (
    MultiTurnWorkload,
    SharedPrefixWorkload,
    probe_ttft,
    run_multi_turn,
    run_shared_prefix,
)
from minserve.bench.run_env import RunRecord, write_results

TARGETS = {"hit_rate_of_ideal": 0.90, "ttft_speedup_on_hits": 5.0, "upkeep_fraction": 0.01}


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """The `prefix` subcommand of `minserve bench`."""
    p = kinds.add_parser("prefix", help="prefix cache on vs off; cache-aware vs FCFS policy")
    w, m = SharedPrefixWorkload(), MultiTurnWorkload()
    p.add_argument("--num-prefixes", type=int, default=w.num_prefixes)
    p.add_argument("--prefix-len", type=int, default=w.prefix_len)
    p.add_argument("--questions", type=int, default=w.questions_per_prefix, help="per prefix")
    p.add_argument("--question-len", type=int, default=w.question_len)
    p.add_argument("--output-len", type=int, default=w.output_len)
    p.add_argument("--conversations", type=int, default=m.conversations)
    p.add_argument("--turns", type=int, default=m.turns)
    p.add_argument("--user-len", type=int, default=m.user_len)
    p.add_argument("--answer-len", type=int, default=m.output_len)
    p.add_argument("--policy-pool-prefixes", type=float, default=3.0,
                   help="policy comparison: a pool holding this many prompts")  # fmt: skip
    p.add_argument("--num-blocks", type=int, default=512, help="pool for the on/off runs")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--max-load", type=float, default=None, help="wait for a load below this")
    p.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for it")
    p.add_argument("--output", type=Path, default=Path("benchmarks/prefix_cache"))
    p.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    from minserve import LLM  # torch import only when running

    shared = SharedPrefixWorkload(
        args.num_prefixes, args.prefix_len, args.questions, args.question_len,
        args.output_len, args.seed,
    )  # fmt: skip
    chat = MultiTurnWorkload(args.conversations, args.turns, args.user_len, args.answer_len)
    record = RunRecord.start(args.command_line, args.threads, args.max_load, args.max_wait)
    base = LLM(args.model, num_blocks=32)
    base.generate([list(range(100, 400))], use_tqdm=False)  # warm-up: a prefill and decodes

    def engine(**options: Any) -> Any:
        options.setdefault("num_blocks", args.num_blocks)
        return LLM(base.loaded, block_size=args.block_size, **options).engine

    runs = run_all(engine, shared, chat, args)
    record.finish()
    report = build_report(record, {"shared_prefix": asdict(shared), "multi_turn": asdict(chat),
                                   "block_size": args.block_size}, runs)  # fmt: skip
    write_results(report, args.output, markdown(report), write_plot)
    return 0


def run_all(
    engine: Any, shared: SharedPrefixWorkload, chat: MultiTurnWorkload, args: argparse.Namespace
) -> dict[str, Any]:
    """Every run of the report, each on a fresh engine, printing progress."""
    per_request = shared.prefix_len + shared.question_len + shared.output_len
    pool = math.ceil(args.policy_pool_prefixes * per_request / args.block_size)
    tight = dict(enable_prefix_caching=True, num_blocks=pool, max_num_seqs=2)
    plan = {
        "shared, cache off": lambda: run_shared_prefix("shared, cache off", engine, shared),
        "shared, cache on": lambda: run_shared_prefix(
            "shared, cache on", engine, shared, enable_prefix_caching=True
        ),
        "chat, cache off": lambda: run_multi_turn("chat, cache off", engine, chat),
        "chat, cache on": lambda: run_multi_turn(
            "chat, cache on", engine, chat, enable_prefix_caching=True
        ),
        "shared, small pool, fcfs": lambda: run_shared_prefix(
            "shared, small pool, fcfs", engine, shared, scheduling_policy="fcfs", **tight
        ),
        "shared, small pool, lpm": lambda: run_shared_prefix(
            "shared, small pool, lpm", engine, shared, scheduling_policy="lpm", **tight
        ),
        "shared, small pool, fcfs, host tier": lambda: run_shared_prefix(
            "shared, small pool, fcfs, host tier",
            engine,
            shared,
            kv_offloading_size=1.0,
            scheduling_policy="fcfs",
            **tight,
        ),
    }
    runs: dict[str, Any] = {}
    for name, run in plan.items():
        print(f"running {name} ...", flush=True)
        runs[name] = run().to_dict()
    print("probing TTFT one request at a time ...", flush=True)
    runs["probe_ttft_s"] = {
        "cache off": probe_ttft(engine, shared),
        "cache on": probe_ttft(engine, shared, enable_prefix_caching=True),
    }
    runs["policy_pool_blocks"] = pool
    return runs


def build_report(record: RunRecord, settings: dict[str, Any], runs: dict[str, Any]) -> dict:
    probes = runs.pop("probe_ttft_s")
    rows = [r for r in runs.values() if isinstance(r, dict)]
    by = {r["name"]: r for r in rows}
    on, off = by["shared, cache on"], by["shared, cache off"]
    chat_on, chat_off = by["chat, cache on"], by["chat, cache off"]
    summary = {
        "hit_rate_of_ideal": on["hit_rate"] / on["ideal_hit_rate"],
        "chat_hit_rate_of_ideal": chat_on["hit_rate"] / chat_on["ideal_hit_rate"],
        "ttft_p50_probe_off_s": median(probes["cache off"]),
        "ttft_p50_probe_on_s": median(probes["cache on"]),
        "ttft_speedup_on_hits": median(probes["cache off"]) / median(probes["cache on"]),
        "ttft_p50_batch_ratio": off["ttft_p50_s"] / on["ttft_p50_s"],
        "throughput_ratio": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        "chat_throughput_ratio": chat_on["output_tokens_per_s"] / chat_off["output_tokens_per_s"],
        "upkeep_fraction": max(r["upkeep_fraction"] for r in rows),
        "lpm_vs_fcfs_hit_rate": (
            by["shared, small pool, lpm"]["hit_rate"],
            by["shared, small pool, fcfs"]["hit_rate"],
        ),
        "host_tier_hit_rate": by["shared, small pool, fcfs, host tier"]["hit_rate"],
        "policy_pool_blocks": runs["policy_pool_blocks"],
    }
    return {
        "command": record.command,
        "date": record.date,
        "machine": record.machine,
        "settings": settings,
        "runs": rows,
        "probe_ttft_s": probes,
        "summary": summary,
        "targets": TARGETS,
    }


def markdown(report: dict[str, Any]) -> str:
    s, sp = report["summary"], report["settings"]["shared_prefix"]
    mt = report["settings"]["multi_turn"]
    record = RunRecord(report["command"], report["date"], report["machine"])
    lpm, fcfs = s["lpm_vs_fcfs_hit_rate"]
    lines = [
        "# Prefix caching: radix cache on vs off, cache-aware vs FCFS scheduling",
        "",
        f"- command: `{report['command']}`",
        f"- date: {report['date']}",
        record.load_line(),
        f"- shared prefix: {sp['num_prefixes']} system prompts of {sp['prefix_len']} tokens x "
        f"{sp['questions_per_prefix']} questions of {sp['question_len']} tokens, "
        f"{sp['output_len']} output tokens each, shuffled, all at once (offline)",
        f"- multi-turn chat: {mt['conversations']} conversations x {mt['turns']} turns, "
        f"{mt['user_len']}-token user messages, {mt['output_len']}-token answers",
        f"- block size {report['settings']['block_size']}; times are engine time (steps' wall "
        "time); hit rate = cached prompt tokens / prompt tokens; ideal = every token seen "
        "before reused",
        "",
        "| run | hit rate | ideal | TTFT p50 (s) | output tok/s | time (s) | upkeep | evicted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['name']} | {r['hit_rate']:.1%} | {r['ideal_hit_rate']:.1%} | "
            f"{r['ttft_p50_s']:.2f} | {r['output_tokens_per_s']:.1f} | {r['seconds']:.1f} | "
            f"{r['upkeep_fraction']:.3%} | {r['evicted_blocks']} |"
            for r in report["runs"]
        ),
        "",
        "## Against the targets",
        "",
        "| measure | result | target |",
        "|---|---:|---:|",
        f"| hit rate / ideal (shared prefix) | {s['hit_rate_of_ideal']:.1%} | >= 90% |",
        f"| hit rate / ideal (multi-turn chat) | {s['chat_hit_rate_of_ideal']:.1%} | >= 90% |",
        f"| TTFT p50 on hits, one request at a time: off {s['ttft_p50_probe_off_s']:.3f} s / "
        f"on {s['ttft_p50_probe_on_s']:.3f} s | {s['ttft_speedup_on_hits']:.1f}x lower | "
        ">= 5x |",
        f"| TTFT p50 in the offline batch, off / on | {s['ttft_p50_batch_ratio']:.1f}x lower | |",
        f"| output throughput, on / off (shared prefix) | {s['throughput_ratio']:.2f}x | |",
        f"| output throughput, on / off (multi-turn chat) | {s['chat_throughput_ratio']:.2f}x | |",
        f"| radix upkeep / step time (worst run) | {s['upkeep_fraction']:.3%} | < 1% |",
        f"| hit rate, small pool ({s['policy_pool_blocks']} blocks, 2 seats): lpm vs fcfs | "
        f"{lpm:.1%} vs {fcfs:.1%} | lpm higher |",
        f"| hit rate, same small pool, fcfs + host tier (`kv_offloading_size=1`) | "
        f"{s['host_tier_hit_rate']:.1%} | |",
        "",
    ]
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["runs"] if "cache off" not in r["name"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [r["name"].replace("shared, ", "") for r in runs]
    ax1.barh(names, [r["ideal_hit_rate"] for r in runs], color="#ddd", label="ideal")
    ax1.barh(names, [r["hit_rate"] for r in runs], height=0.5, color="tab:blue", label="measured")
    ax1.set_xlabel("hit rate (cached prompt tokens / prompt tokens)")
    ax1.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2, frameon=False)
    probes = report["probe_ttft_s"]
    ax2.bar(list(probes), [median(v) for v in probes.values()], color=["tab:orange", "tab:blue"])
    ax2.set_ylabel("TTFT p50 (s), one request at a time")
    ax2.set_title(f"{report['summary']['ttft_speedup_on_hits']:.1f}x lower on hits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
