"""KV-cache memory utilization: the paged pool against contiguous max-length reservations.

    .venv/bin/python -m benchmarks.kv_utilization [--threads N] [--num-blocks 256]

On the offline workload (64 requests, prompt and output lengths uniform in [32, 256],
seed 0) it reports tokens stored / slots reserved, averaged over every step of every
request, for the paged pool (block sizes 1 and 16) and for contiguous buffers of
max_model_len (2048) or prompt + max_tokens slots, and how many requests a budget of
num_blocks x block_size KV slots holds at once. Then it runs the real engine on the same
workload with SmolLM2-135M-Instruct (greedy, EOS ignored) in a pool of that budget, too
small to hold every request, and reads the allocator and the block tables after every
step. Writes kv_utilization.json and kv_utilization.md next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks.naive_decode import machine
from benchmarks.run_env import command_line
from minserve import LLM
from minserve.bench.offline import offline_workload
from minserve.viz.kv_utilization import (
    ContiguousMaxLen,
    ContiguousMaxTokens,
    EngineRun,
    Paged,
    compare_layouts,
    measure_engine,
)

HERE = Path(__file__).resolve().parent
TARGET = 0.90  # the paged pool should use at least this fraction of what it reserves


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16, help="the engine run's block size")
    p.add_argument("--num-blocks", type=int, default=256, help="the engine's pool: the budget")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=HERE / "kv_utilization", help="path without suffix")
    return p.parse_args(argv)


def engine_summary(run: EngineRun, seconds: float) -> dict[str, Any]:
    """The engine run's numbers: at the step with the most slots allocated, and over all steps."""
    peak = run.peak
    return {
        "steps": len(run.snapshots),
        "seconds": round(seconds, 1),
        "num_preemptions": run.num_preemptions,
        "max_seqs_holding_kv": run.max_seqs,
        "peak_slots_reserved": peak.slots_reserved,
        "peak_tokens_stored": peak.tokens_stored,
        "peak_num_seqs": peak.num_seqs,
        "peak_utilization": round(peak.utilization, 4),
        "mean_utilization": round(run.mean_utilization, 4),
        "contiguous_at_peak": {
            label: round(value, 4) for label, value in run.contiguous_utilization(peak).items()
        },
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as a short markdown page."""
    m, s, e = report["machine"], report["settings"], report["engine"]
    lines = [
        "# KV-cache utilization: paged pool vs contiguous reservation",
        "",
        f"- command: `{report['command']}`",
        f"- date: {report['date']}",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, "
        f"load average {m['load_average_1min_at_start']} at start; torch {m['torch']}",
        f"- workload: {s['num_requests']} requests, prompt and output lengths uniform in "
        f"[{s['min_len']}, {s['max_len']}], seed {s['seed']}; "
        f"{report['workload_tokens']} tokens at their final lengths",
        f"- budget: {report['budget_tokens']} KV slots ({s['num_blocks']} blocks of "
        f"{s['block_size']}; {report['budget_bytes'] / 2**20:.0f} MiB for {report['model']}"
        " in fp32)",
        "",
        "## On paper: every step of every request",
        "",
        "| layout | tokens stored / slots reserved | requests that fit the budget |",
        "|---|---:|---:|",
    ]
    for r in report["layouts"]:
        lines.append(f"| {r['label']} | {r['utilization']:.1%} | {r['requests_fit']} |")
    lines += [
        "",
        f"Target: the paged pool stores at least {TARGET:.0%} of what it reserves: "
        f"{'met' if report['target_met'] else 'NOT met'}.",
        "",
        "## The real engine",
        "",
        f"`LLM(num_blocks={s['num_blocks']}, block_size={s['block_size']}, "
        f"max_model_len={s['max_model_len']})` on the same workload, greedy with EOS ignored "
        f"({e['steps']} steps, {e['seconds']} s, {e['num_preemptions']} preemptions). The pool "
        "is read after every step: slots = allocated blocks x block size (the allocator), "
        "tokens = filled slots of the block tables.",
        "",
        f"- at the fullest step: {e['peak_tokens_stored']} tokens in {e['peak_slots_reserved']} "
        f"slots of {e['peak_num_seqs']} sequences: **{e['peak_utilization']:.1%}**",
        f"- over all steps: {e['mean_utilization']:.1%}; at most {e['max_seqs_holding_kv']} "
        "sequences held KV at once",
    ]
    for label, value in e["contiguous_at_peak"].items():
        lines.append(f"- {label}, for the same sequences at that step: {value:.1%}")
    lines += [
        "",
        "Utilization on paper assumes every request is resident for all of its steps; the",
        "engine's numbers are what minserve's allocator and block tables actually held.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads
    info = machine()
    workload = offline_workload(args.num_requests, args.min_len, args.max_len, args.seed)
    lengths = [(len(r.prompt_token_ids), r.max_tokens) for r in workload]
    budget = args.num_blocks * args.block_size
    layouts = [Paged(1), Paged(16), ContiguousMaxLen(args.max_model_len), ContiguousMaxTokens()]
    results = compare_layouts(lengths, layouts, budget)

    llm = LLM(
        dtype="float32", device="cpu", block_size=args.block_size,
        num_blocks=args.num_blocks, max_model_len=args.max_model_len,
    )  # fmt: skip
    start = time.perf_counter()
    run = measure_engine(
        llm.engine, [r.prompt_token_ids for r in workload], [r.max_tokens for r in workload]
    )
    seconds = time.perf_counter() - start
    report = {
        "command": command_line(__spec__.name, argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": info,
        "model": llm.loaded.path.name,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "workload_tokens": sum(p + o for p, o in lengths),
        "budget_tokens": budget,
        "budget_bytes": llm.engine.worker.pool.nbytes,
        "layouts": [
            {
                "label": r.label,
                "utilization": round(r.utilization, 4),
                "requests_fit": r.requests_fit,
            }
            for r in results
        ],
        "target_met": run.peak.utilization >= TARGET
        and all(
            r.utilization >= TARGET for r, lay in zip(results, layouts) if isinstance(lay, Paged)
        ),
        "engine": engine_summary(run, seconds),
    }
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
