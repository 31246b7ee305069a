"""Decode speed of minserve's reference path, Hugging Face `generate`, and the bandwidth floor.

    .venv/bin/python -m benchmarks.naive_decode [--threads N] [--batch-sizes 1 8]

Both engines run greedy with EOS ignored on the same fixed prompts of the bundled
SmolLM2-135M-Instruct (fp32, CPU), taking turns in one process so that machine noise hits
both alike. Decode tokens/s subtracts the prefill: (time for N tokens - time for 1 token)
over N - 1 steps. The floor is what a step costs if it only reads the weights once at the
measured memory bandwidth. Writes naive_decode.json and naive_decode.md next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.run_env import command_line, machine_info, wait_for_quiet
from minserve import LLM
from minserve.viz.naive import (
    bandwidth_floor,
    decode_tokens_per_second,
    hf_decode_tokens_per_second,
    load_hf_model,
    measure_memory_bandwidth,
    weight_bytes,
)

HERE = Path(__file__).resolve().parent
ENGINES = ("minserve", "hf")
Rates = dict[str, dict[int, list[float]]]  # engine -> batch size -> tokens/s per round


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per sequence")
    p.add_argument("--rounds", type=int, default=5, help="turns per engine; the median is kept")
    p.add_argument("--repeats", type=int, default=2, help="best-of within one measurement")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--max-load", type=float, default=None, help="wait for a lower load average")
    p.add_argument("--out", type=Path, default=HERE / "naive_decode", help="path without suffix")
    return p.parse_args(argv)


def machine() -> dict[str, Any]:
    """What the numbers were measured on, including how busy the machine was."""
    import transformers

    return {
        **machine_info(),
        "load_average_1min_at_start": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def measure_rates(llm: LLM, hf_model: Any, args: argparse.Namespace) -> Rates:
    """Decode tokens/s per engine and batch size, one value per round, engines taking turns."""
    rates: Rates = {e: {b: [] for b in args.batch_sizes} for e in ENGINES}
    runs = {
        "minserve": lambda b: decode_tokens_per_second(
            llm, b, args.prompt_len, args.new_tokens, args.repeats
        ),
        "hf": lambda b: hf_decode_tokens_per_second(
            hf_model, b, args.prompt_len, args.new_tokens, args.repeats
        ),
    }
    jobs = [(e, b) for _ in range(args.rounds) for b in args.batch_sizes for e in ENGINES]
    for engine, batch in tqdm(jobs, desc="decode runs", unit="run"):
        rates[engine][batch].append(runs[engine](batch))
    return rates


def summarize(rates: Rates, bandwidth: float, num_bytes: int) -> list[dict[str, Any]]:
    """One row per batch size: median rates, the floor and the fraction of it reached.

    The minserve / HF ratio is the median of each round's own ratio: the two engines ran
    back to back in a round, so a busy spell on the machine mostly cancels out.
    """
    rows = []
    for batch in rates["minserve"]:
        ours, theirs = (statistics.median(rates[e][batch]) for e in ENGINES)
        paired = [a / b for a, b in zip(rates["minserve"][batch], rates["hf"][batch])]
        floor = bandwidth_floor(bandwidth, num_bytes, batch)
        rows.append(
            {
                "batch_size": batch,
                "minserve_tokens_per_s": round(ours, 2),
                "hf_tokens_per_s": round(theirs, 2),
                "minserve_over_hf": round(statistics.median(paired), 3),
                "bandwidth_floor_tokens_per_s": round(floor, 2),
                "fraction_of_floor": round(ours / floor, 3),
                "hf_fraction_of_floor": round(theirs / floor, 3),
                "minserve_rounds": [round(r, 2) for r in rates["minserve"][batch]],
                "hf_rounds": [round(r, 2) for r in rates["hf"][batch]],
            }
        )
    return rows


def markdown(report: dict[str, Any]) -> str:
    """The report as a short markdown page."""
    m, s = report["machine"], report["settings"]
    lines = [
        "# Naive decode: minserve reference path vs Hugging Face `generate`",
        "",
        f"- command: `{report['command']}`",
        f"- date: {report['date']}",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, "
        f"load average {m['load_average_1min_at_start']} at start; torch {m['torch']}, "
        f"transformers {m['transformers']}",
        f"- model: {report['model']} (fp32, CPU)",
        f"- workload: {s['prompt_len']}-token fixed prompts, {s['new_tokens']} new tokens, "
        f"greedy, ignore EOS; median of {s['rounds']} rounds, each the best of "
        f"{s['repeats']}, engines taking turns (minserve / HF: median of per-round ratios)",
        f"- memory bandwidth (sum over a 512 MiB fp32 tensor, best of 10): "
        f"{report['bandwidth_gb_per_s']:.1f} GB/s",
        f"- weight bytes read per decode step: {report['weight_bytes'] / 1e6:.1f} MB",
        "",
        "| batch | minserve tok/s | HF tok/s | minserve / HF | floor tok/s | minserve / floor "
        "| HF / floor |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['batch_size']} | {r['minserve_tokens_per_s']:.1f} | {r['hf_tokens_per_s']:.1f} "
            f"| {r['minserve_over_hf']:.2f} | {r['bandwidth_floor_tokens_per_s']:.1f} "
            f"| {r['fraction_of_floor']:.0%} | {r['hf_fraction_of_floor']:.0%} |"
        )
    lines += [
        "",
        "The floor at batch B is B x bandwidth / weight bytes: each decode step must read",
        "every weight once, and one read serves the whole batch. Absolute numbers depend on",
        "the machine and how busy it was; the ratios are measured side by side in one run.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    wait_for_quiet(args.max_load, max_wait_s=600)
    info = machine()
    llm = LLM(engine="reference", dtype="float32", device="cpu")  # the contiguous-KV path
    hf_model = load_hf_model(llm.loaded.path)
    num_bytes = weight_bytes(llm.loaded.model)
    bandwidth = measure_memory_bandwidth(repeats=10)
    rates = measure_rates(llm, hf_model, args)
    report = {
        "command": command_line(__spec__.name, argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": info,
        "model": llm.loaded.path.name,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "max_load")},
        "bandwidth_gb_per_s": round(bandwidth / 1e9, 2),
        "weight_bytes": num_bytes,
        "results": summarize(rates, bandwidth, num_bytes),
    }
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
