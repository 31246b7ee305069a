"""`minserve bench speculative`: plain vs speculative decoding, each proposer, two workloads,
batch 1 and 8, measured next to Leviathan et al.'s formulas.

    minserve bench speculative --threads 2   # about 10 min

prints a row per workload, batch size and proposer: speedup, acceptance rate a, drafts per
verification g, tokens per target forward, draft cost c, next to (1 - a^(g+1)) / (1 - a) and
(1 - a^(g+1)) / ((1 - a)(g c + 1)), and whether the greedy tokens equal plain decoding's.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from minserve.bench.options import choices, positive_ints, set_threads
from minserve.bench.spec_runs import load_drafts, measure_group
from minserve.bench.spec_workloads import WORKLOADS
from minserve.bench.speculative import Cell, ProposerSpec

BLOCK_SIZE = 16
PROPOSERS = ("ngram:k=4", "early_exit:layers=26:k=2", "draft_model:k=3")


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """The `speculative` subcommand of `minserve bench`."""
    p = kinds.add_parser("speculative", help="speculative decoding: speedup vs the formula")
    add_arguments(p)
    p.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    print(table(measure(args)["cells"]))
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every (workload, batch size) group, each proposer against plain decoding: the
    settings and a cell per group and proposer."""
    from minserve import LLM, SamplingParams  # torch import only when running

    specs = [ProposerSpec.parse(p) for p in args.proposers]
    if min(args.repeats, args.batch1_requests, args.max_tokens) < 1:
        raise ValueError("--repeats, --batch1-requests and --max-tokens must be at least 1")
    batches = positive_ints(args.batch_sizes, "--batch-sizes")
    workloads = choices(args.workloads, tuple(WORKLOADS), "workload")
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
    settings = {"workloads": workloads, "batch_sizes": batches, "max_tokens": args.max_tokens,
                "batch1_requests": args.batch1_requests, "repeats": args.repeats,
                "proposers": args.proposers,
                "dtype": "float32", "temperature": 0, "ignore_eos": True}  # fmt: skip
    return {"settings": settings, "cells": [c.to_dict() for c in cells]}


def _requests(prompts: list[list[int]], batch: int, args: argparse.Namespace) -> list:
    """Batch 1: the first --batch1-requests prompts; larger batches: all, --repeats times."""
    return prompts[: args.batch1_requests] if batch == 1 else prompts * args.repeats


def table(cells: list[dict[str, Any]]) -> str:
    """A markdown table, a row per cell: times, speedup against the formula's, a, g, c."""
    rows = [
        "| workload | batch | proposer | plain s | spec s | speedup | formula speedup | a | g "
        "| accepted len | formula tok/fwd | tok/forward | c | c vs plain step | identical |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in cells:
        rows.append(
            f"| {c['workload']} | {c['batch']} | {c['proposer']} | {c['plain_s']:.1f} | "
            f"{c['spec_s']:.1f} | {c['speedup']:.2f}x | {c['formula_speedup']:.2f}x | "
            f"{c['acceptance_rate']:.2f} | {c['mean_draft_len']:.2f} | "
            f"{c['mean_accepted_len']:.2f} | {c['formula_tokens_per_forward']:.2f} | "
            f"{c['tokens_per_forward']:.2f} | {c['c']:.3f} | {c['c_benchmark']:.3f} | "
            f"{'yes' if c['identical'] else 'NO'} |"
        )
    return "\n".join(rows)
