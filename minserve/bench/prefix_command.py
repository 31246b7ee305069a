"""`minserve bench prefix`: the prefix cache on versus off, and cache-aware versus FCFS.

    minserve bench prefix --threads 1   # about 3-5 min

Shared system prompts and multi-turn chats, each on a fresh engine with the radix cache off
and on; then a pool too small for every prompt, scheduled FCFS, longest-prefix-match and
FCFS with a host tier; then TTFT probed one request at a time. Prints a row per run and the
summary: hit rate against the ideal, TTFT on hits, throughput, radix upkeep.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import asdict
from statistics import median
from typing import Any

from minserve.bench.options import set_threads
from minserve.bench.prefix import (
    MultiTurnWorkload,
    SharedPrefixWorkload,
    probe_ttft,
    run_multi_turn,
    run_shared_prefix,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """The `prefix` subcommand of `minserve bench`."""
    p = kinds.add_parser("prefix", help="prefix cache on vs off; cache-aware vs FCFS policy")
    add_arguments(p)
    p.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    measured = measure(args)
    print(runs_table(measured["runs"]) + "\n\n" + summary_table(measured["summary"]))
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every run on a fresh engine over the same loaded weights; settings, runs, TTFT probes
    and the summary."""
    from minserve import LLM  # torch import only when running

    shared = SharedPrefixWorkload(
        args.num_prefixes, args.prefix_len, args.questions, args.question_len,
        args.output_len, args.seed,
    )  # fmt: skip
    chat = MultiTurnWorkload(args.conversations, args.turns, args.user_len, args.answer_len)
    base = LLM(args.model, num_blocks=32)
    base.generate([list(range(100, 400))], use_tqdm=False)  # warm-up: a prefill and decodes

    def engine(**options: Any) -> Any:
        options.setdefault("num_blocks", args.num_blocks)
        return LLM(base.loaded, block_size=args.block_size, **options).engine

    runs = run_all(engine, shared, chat, args)
    probes = runs.pop("probe_ttft_s")
    pool = runs.pop("policy_pool_blocks")
    rows = list(runs.values())
    return {
        "settings": {
            "shared_prefix": asdict(shared),
            "multi_turn": asdict(chat),
            "block_size": args.block_size,
        },  # fmt: skip
        "runs": rows,
        "probe_ttft_s": probes,
        "summary": summarize(rows, probes, pool),
    }


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


def summarize(rows: list[dict], probes: dict[str, list[float]], pool_blocks: int) -> dict:
    """Cache on against off, lpm against FCFS, the host tier, and the worst upkeep."""
    by = {r["name"]: r for r in rows}
    on, off = by["shared, cache on"], by["shared, cache off"]
    chat_on, chat_off = by["chat, cache on"], by["chat, cache off"]
    return {
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
        "policy_pool_blocks": pool_blocks,
    }


def runs_table(runs: list[dict]) -> str:
    """A markdown table, a row per run."""
    return "\n".join([
        "| run | hit rate | ideal | TTFT p50 (s) | output tok/s | time (s) | upkeep | evicted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['name']} | {r['hit_rate']:.1%} | {r['ideal_hit_rate']:.1%} | "
            f"{r['ttft_p50_s']:.2f} | {r['output_tokens_per_s']:.1f} | {r['seconds']:.1f} | "
            f"{r['upkeep_fraction']:.3%} | {r['evicted_blocks']} |"
            for r in runs
        ),
    ])  # fmt: skip


def summary_table(s: dict, goals: Mapping[str, str] | None = None) -> str:
    """The summary as a markdown table; with `goals` (summary key -> text), a target column."""
    lpm, fcfs = s["lpm_vs_fcfs_hit_rate"]
    rows = {
        "hit_rate_of_ideal": ("hit rate / ideal (shared prefix)", f"{s['hit_rate_of_ideal']:.1%}"),
        "chat_hit_rate_of_ideal": (
            "hit rate / ideal (multi-turn chat)", f"{s['chat_hit_rate_of_ideal']:.1%}"
        ),
        "ttft_speedup_on_hits": (
            f"TTFT p50 on hits, one request at a time: off {s['ttft_p50_probe_off_s']:.3f} s / "
            f"on {s['ttft_p50_probe_on_s']:.3f} s", f"{s['ttft_speedup_on_hits']:.1f}x lower"
        ),
        "ttft_p50_batch_ratio": (
            "TTFT p50 in the offline batch, off / on", f"{s['ttft_p50_batch_ratio']:.1f}x lower"
        ),
        "throughput_ratio": (
            "output throughput, on / off (shared prefix)", f"{s['throughput_ratio']:.2f}x"
        ),
        "chat_throughput_ratio": (
            "output throughput, on / off (multi-turn chat)", f"{s['chat_throughput_ratio']:.2f}x"
        ),
        "upkeep_fraction": ("radix upkeep / step time (worst run)", f"{s['upkeep_fraction']:.3%}"),
        "lpm_vs_fcfs_hit_rate": (
            f"hit rate, small pool ({s['policy_pool_blocks']} blocks, 2 seats): lpm vs fcfs",
            f"{lpm:.1%} vs {fcfs:.1%}",
        ),
        "host_tier_hit_rate": (
            "hit rate, same small pool, fcfs + host tier (`kv_offloading_size=1`)",
            f"{s['host_tier_hit_rate']:.1%}",
        ),
    }  # fmt: skip
    if goals is None:
        lines = ["| measure | result |", "|---|---:|"]
        lines += [f"| {measure} | {result} |" for measure, result in rows.values()]
    else:
        lines = ["| measure | result | target |", "|---|---:|---:|"]
        lines += [f"| {m} | {r} | {goals.get(k, '')} |" for k, (m, r) in rows.items()]
    return "\n".join(lines)
