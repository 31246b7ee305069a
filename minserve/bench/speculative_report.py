"""`minserve bench speculative`: plain vs speculative decoding, each proposer, two workloads,
batch 1 and 8, measured next to Leviathan et al.'s formulas.

    minserve bench speculative --threads 2

Writes benchmarks/speculative.{json,md,png}. The issue's targets, on the repetition workload
at batch 1 for the best proposer: at least 2 tokens per target forward and a 1.5x speedup.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from minserve.bench.run_env import RunRecord, write_results
from minserve.bench.spec_runs import load_drafts, measure_group
from minserve.bench.spec_workloads import WORKLOADS
from minserve.bench.speculative import Cell, ProposerSpec

TARGETS = {"tokens_per_forward": 2.0, "speedup": 1.5}  # repetition, batch 1, best proposer
BLOCK_SIZE = 16
PROPOSERS = ("ngram:k=4", "early_exit:layers=26:k=2", "draft_model:k=3")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """The `speculative` subcommand of `minserve bench`."""
    p = kinds.add_parser("speculative", help="speculative decoding: speedup vs the formula")
    p.add_argument("--proposers", nargs="+", default=list(PROPOSERS),
                   help="method[:k=N][:layers=N][:adaptive]; draft_model without layers: "
                   "the target itself; with layers: a truncated copy, from a temp dir")  # fmt: skip
    p.add_argument("--workloads", default="repetition,chat", help="comma-separated")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated")
    p.add_argument("--batch1-requests", type=int, default=8, help="requests run one at a time")
    p.add_argument("--repeats", type=int, default=2, help="runs of each batch of 8")
    p.add_argument("--max-tokens", type=int, default=128, help="per request (EOS ignored)")
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--max-load", type=float, default=None, help="wait for a load below this")
    p.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for it")
    p.add_argument("--output", type=Path, default=Path("benchmarks/speculative"))
    p.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    report = run_benchmark(args)
    write_results(report, args.output, markdown(report), write_plot)
    return 0


def _sizes(text: str, what: str) -> list[int]:
    sizes = [int(x) for x in text.split(",") if x.strip().isdigit()]
    if not sizes or min(sizes) < 1 or len(sizes) != len(text.split(",")):
        raise ValueError(f"--{what} must be positive integers, comma-separated; got {text!r}")
    return sizes


def _workloads(text: str) -> list[str]:
    names = [w.strip() for w in text.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        raise ValueError(f"unknown workload {unknown}; choose from {', '.join(WORKLOADS)}")
    return names


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Every (workload, batch size) group, each proposer against plain decoding."""
    from minserve import LLM, SamplingParams  # torch import only when running

    specs = [ProposerSpec.parse(p) for p in args.proposers]
    if min(args.repeats, args.batch1_requests, args.max_tokens) < 1:
        raise ValueError("--repeats, --batch1-requests and --max-tokens must be at least 1")
    batches, workloads = _sizes(args.batch_sizes, "batch-sizes"), _workloads(args.workloads)
    record = RunRecord.start(args.command_line, args.threads, args.max_load, args.max_wait)
    base = LLM(args.model, dtype="float32", num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=min(8, args.max_tokens), ignore_eos=True)
    prompts = {w: WORKLOADS[w](base.loaded.tokenizer) for w in workloads}
    longest = max(len(p) for group in prompts.values() for p in group)
    per_seq = -(-(longest + args.max_tokens + max(s.k for s in specs) + 1) // BLOCK_SIZE)

    def engine(config: dict[str, Any] | None) -> Any:
        blocks = max(batches) * per_seq + 4
        return LLM(
            base.loaded, block_size=BLOCK_SIZE, num_blocks=blocks, speculative_config=config
        ).engine

    with tempfile.TemporaryDirectory(prefix="minserve-spec-") as workdir:
        drafts = load_drafts(specs, base.loaded, Path(workdir))
        for spec in specs:  # warm-up: each proposer's path once, untimed
            config = spec.config(drafts.get(spec))
            warm = LLM(base.loaded, block_size=BLOCK_SIZE, num_blocks=per_seq + 1,
                       speculative_config=config)  # fmt: skip
            warm.generate(prompts[workloads[0]][:1], short, use_tqdm=False)
        groups = [(w, b) for w in workloads for b in batches]
        chosen = {(w, b): _requests(prompts[w], b, args) for w, b in groups}
        runs = sum(-(-len(chosen[g]) // g[1]) for g in groups)  # units per group
        cells: list[Cell] = []
        with tqdm(total=runs * (len(specs) + 1), desc="speculative", unit="run") as bar:
            for w, b in groups:
                bar.set_postfix_str(f"{w}, batch {b}")
                requests = chosen[w, b]
                cells += measure_group(engine, w, requests, b, specs, drafts, params, bar.update)
    record.finish()
    settings = {"workloads": workloads, "batch_sizes": batches, "max_tokens": args.max_tokens,
                "batch1_requests": args.batch1_requests, "repeats": args.repeats,
                "proposers": args.proposers,
                "dtype": "float32", "temperature": 0, "ignore_eos": True}  # fmt: skip
    return build_report(record, settings, cells)


def _requests(prompts: list[list[int]], batch: int, args: argparse.Namespace) -> list:
    """Batch 1: the first --batch1-requests prompts; larger batches: all, --repeats times."""
    return prompts[: args.batch1_requests] if batch == 1 else prompts * args.repeats


def build_report(record: RunRecord, settings: dict[str, Any], cells: list[Cell]) -> dict:
    """The JSON report: how it ran, every cell, and the targets' verdict."""
    at_target = [c for c in cells if c.workload == "repetition" and c.batch == 1]
    best = max(at_target, key=lambda c: c.speedup, default=None)
    summary = {
        "all_identical": all(c.identical for c in cells),
        "best_repetition_batch1": None if best is None else best.to_dict(),
        "targets_met": None
        if best is None
        else {
            "tokens_per_forward": best.tokens_per_forward >= TARGETS["tokens_per_forward"],
            "speedup": best.speedup >= TARGETS["speedup"],
        },
    }
    return {
        "command": record.command,
        "date": record.date,
        "machine": record.machine,
        "settings": settings,
        "cells": [c.to_dict() for c in cells],
        "summary": summary,
        "targets": TARGETS,
    }


def markdown(report: dict[str, Any]) -> str:
    s, summary = report["settings"], report["summary"]
    record = RunRecord(report["command"], report["date"], report["machine"])
    rows = [
        "| workload | batch | proposer | plain s | spec s | speedup | formula speedup | a | g "
        "| accepted len | formula tok/fwd | tok/forward | c | c vs plain step | identical |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in report["cells"]:
        rows.append(
            f"| {c['workload']} | {c['batch']} | {c['proposer']} | {c['plain_s']:.1f} | "
            f"{c['spec_s']:.1f} | {c['speedup']:.2f}x | {c['formula_speedup']:.2f}x | "
            f"{c['acceptance_rate']:.2f} | {c['mean_draft_len']:.2f} | "
            f"{c['mean_accepted_len']:.2f} | {c['formula_tokens_per_forward']:.2f} | "
            f"{c['tokens_per_forward']:.2f} | {c['c']:.3f} | {c['c_benchmark']:.3f} | "
            f"{'yes' if c['identical'] else 'NO'} |"
        )
    sources = sorted({c["c_source"] for c in report["cells"]})
    lines = [
        "# Speculative decoding: plain vs speculative, measured vs the formula",
        "",
        f"- command: `{report['command']}`",
        f"- date: {report['date']}",
        record.load_line(),
        f"- target SmolLM2-135M-Instruct (or `--model`), {s['dtype']}, greedy, EOS ignored, "
        f"{s['max_tokens']} output tokens per request; batch 1: {s['batch1_requests']} requests "
        f"one at a time; batch 8: 8 concurrent, run {s['repeats']} times",
        "- plain and speculative engines run the same requests, interleaved (the order rotates "
        "per unit); speedup = plain wall time / speculative wall time (prefill included); "
        "n-gram lookup: prompt_lookup_max 4, prompt_lookup_min 1 (the engine's defaults)",
        "- a = accepted / proposed drafts; g = drafts per verification (mean); accepted len = "
        "1 + accepted drafts per verification, the measured counterpart of the formula "
        "(1 - a^(g+1)) / (1 - a); tok/forward = the engine's tokens per target forward per "
        "sequence (prefill and steps without drafts included); formula speedup = "
        "(1 - a^(g+1)) / ((1 - a)(g c + 1))",
        f"- c = draft cost ratio used in the formula, from: {', '.join(sources)} (engine: "
        "`spec_decode_draft_cost_ratio`, one draft round over one verifying forward); c vs "
        "plain step = proposer seconds per drafted token / plain decode seconds per token, "
        "timed here around the proposer",
        "",
        *rows,
        "",
        "Reading it: a counts drafts after a sequence's first rejection as rejected though the "
        "target never tested them, so (1 - a^(g+1)) / (1 - a) with this a is below the measured "
        "accepted length when drafts are long; the formula's speedup also leaves out what a "
        "forward verifying g + 1 tokens costs next to a plain one-token step (on a CPU at "
        "batch 1, about the same), and the prefill inside the wall times.",
        "",
        *_verdict(summary),
        "",
    ]
    return "\n".join(lines)


def _verdict(summary: dict[str, Any]) -> list[str]:
    best = summary["best_repetition_batch1"]
    same = summary["all_identical"]
    lines = [f"Greedy tokens identical to plain decoding in every cell: {same}."]
    if best is not None:
        met = {k: "met" if v else "not met" for k, v in summary["targets_met"].items()}
        lines.append(
            f"Repetition workload, batch 1, best proposer ({best['proposer']}): "
            f"{best['tokens_per_forward']:.2f} tokens per target forward (target >= "
            f"{TARGETS['tokens_per_forward']}: {met['tokens_per_forward']}), "
            f"{best['speedup']:.2f}x wall-clock speedup (target >= {TARGETS['speedup']}x: "
            f"{met['speedup']})."
        )
    return lines


def write_plot(report: dict[str, Any], path: Path) -> Path:
    """Measured against predicted: tokens per forward (left) and speedup (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    pairs = (("formula_tokens_per_forward", "mean_accepted_len", "tokens per verification"),
             ("formula_speedup", "speedup", "speedup"))  # fmt: skip
    markers = {"ngram": "o", "early_exit": "s", "draft_model": "^"}
    colours = {("repetition", 1): "tab:blue", ("repetition", 8): "tab:cyan",
               ("chat", 1): "tab:red", ("chat", 8): "tab:orange"}  # fmt: skip
    for ax, (x_key, y_key, label) in zip(axes, pairs):
        for c in report["cells"]:
            ax.scatter(c[x_key], c[y_key], marker=markers.get(c["proposer"].split()[0], "x"),
                       color=colours.get((c["workload"], c["batch"]), "gray"), s=50)  # fmt: skip
        top = max([1.0] + [max(c[x_key], c[y_key]) for c in report["cells"]]) * 1.1
        ax.plot([0, top], [0, top], color="gray", lw=0.8, ls="--")
        ax.set(xlabel=f"formula: {label}", ylabel=f"measured: {label}")
        ax.set(xlim=(0, top), ylim=(0, top))
    handles = [plt.Line2D([], [], ls="", marker=m, color="k", label=n) for n, m in markers.items()]
    handles += [plt.Line2D([], [], ls="", marker="o", color=col, label=f"{w}, batch {b}")
                for (w, b), col in colours.items()]  # fmt: skip
    axes[1].legend(handles=handles, fontsize=8, loc="upper left")
    fig.suptitle("Speculative decoding: measured vs (1 - a^(g+1)) / (1 - a) and / (g c + 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
