"""The state plane's record: the disk tier, the load-or-recompute rule, KV events, spilling.

    python -m benchmarks.state_plane --threads 2 --max-load 1.5

Runs `minserve.bench.state_plane`'s measurements under a run record and writes
state_plane.{json,md,png}: a returning session's time to first token from disk against
recomputing it (after a restart on the same directory, page cache dropped), the rule's
choice against both paths measured over throttled disks, the router's index kept from KV
events against the engines' own block sets, and output tokens/s under memory pressure with
and without the disk tier.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from benchmarks.run_env import (
    RunRecord,
    measure_recorded,
    record_parser,
    save_figure,
    write_results,
)
from minserve.bench import state_plane


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--repeats", type=int, default=3, help="disk tier: runs per length (median)")
    p.add_argument("--directory", default="/var/tmp", help="where the disk tiers' files go")
    p.add_argument("--parts", default="disk,rule,events,spill", help="which parts to run")


def measure(args: argparse.Namespace) -> dict:
    from minserve.llm import LLM

    settings = state_plane.Settings(repeats=args.repeats, directory=args.directory)
    base = LLM(num_blocks=32)  # the bundled model, loaded once; each part builds its engines
    parts = set(args.parts.split(","))
    report: dict = {"settings": {"lengths": settings.lengths, "caps_mb_s": settings.caps_mb_s,
                                 "rule_lengths": settings.rule_lengths,
                                 "repeats": settings.repeats}}  # fmt: skip
    if "disk" in parts:
        report["disk_tier"] = state_plane.disk_tier(base, settings)
    if "rule" in parts:
        report["rule"] = state_plane.rule(base, settings)
    if "events" in parts:
        report["events"] = state_plane.events(base, settings)
    if "spill" in parts:
        report["spill"] = state_plane.spill(base, settings)
    return report


def main(argv: list[str] | None = None) -> int:
    args = record_parser(__spec__.name, __doc__, add_arguments).parse_args(argv)
    record, measured = measure_recorded(__spec__.name, argv, args, measure, args.threads)
    report = {"command": record.command, "date": record.date, "machine": record.machine,
              **measured}  # fmt: skip
    write_results(report, args.output, markdown(report), write_plot)
    return 0


def markdown(report: dict) -> str:
    record = RunRecord(report["command"], report["date"], report["machine"])
    rows = ["# The state plane: disk tier, load-or-recompute, KV events, spilling", "",
            f"- command: `{report['command']}`", f"- date: {report['date']}",
            record.load_line(), ""]  # fmt: skip
    if "disk_tier" in report:
        rows += ["## A returning session's first token, by where its KV comes from", "",
                 "Recompute: a fresh engine. Disk: an engine restarted on the same directory, "
                 "the files' pages dropped from the OS cache. Device: a hit in the pool. "
                 f"Medians of {report['settings']['repeats']} runs; tokens: 16 greedy tokens "
                 "after a disk load vs computed.", "",
                 "| history | recompute | disk | device | disk / recompute | blocks from disk "
                 "| same tokens |",
                 "|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for r in report["disk_tier"]:
            rows.append(f"| {r['history']} | {r['recompute_s'] * 1e3:.0f} ms | "
                        f"{r['disk_s'] * 1e3:.0f} ms | {r['device_s'] * 1e3:.0f} ms | "
                        f"{r['disk_over_recompute']:.3f} | {r['blocks_loaded']} | "
                        f"{r['same_tokens']} |")  # fmt: skip
        rows.append("")
    if "rule" in report:
        right = [r["right"] for r in report["rule"]]
        rows += ["## The load-or-recompute rule over throttled disks", "",
                 f"The rule chose the faster path in {sum(right)} of {len(right)} cases "
                 f"({sum(right) / len(right):.0%}). Both paths measured with the page cache "
                 "dropped; the cap (`BandwidthCap`) sleeps to honour its bandwidth.", "",
                 "| history | disk cap | load | recompute | faster | rule chose |",
                 "|---:|---:|---:|---:|---|---|"]  # fmt: skip
        for r in report["rule"]:
            cap = "none" if not math.isfinite(r["cap_mb_s"]) else f"{r['cap_mb_s']:g} MB/s"
            mark = "" if r["right"] else " (wrong)"
            rows.append(f"| {r['history']} | {cap} | {r['load_s'] * 1e3:.0f} ms | "
                        f"{r['recompute_s'] * 1e3:.0f} ms | {r['faster']} | "
                        f"{r['chose']}{mark} |")  # fmt: skip
        rows.append("")
    if "events" in report:
        e = report["events"]
        rows += ["## KV events: the index against the engines", "",
                 f"Two engines (device, host and disk tiers) publishing; a mixed workload; "
                 f"one restarted on its directory. Index equal to every engine's block sets, "
                 f"every medium: **{e['exact']}**.", "",
                 "| when | engine | device | host | disk | replays | exact |",
                 "|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
        for when in ("before_restart", "after_restart"):
            for i, c in enumerate(e[when]):
                b = c["blocks"]
                rows.append(f"| {when.replace('_', ' ')} | {i} | {b['device']} | {b['host']} | "
                            f"{b['disk']} | {c['replays']} | {c['exact']} |")  # fmt: skip
        rows.append("")
    if "spill" in report:
        s = report["spill"]
        rows += [
            "## Spilling under memory pressure",
            "",
            "| | output tok/s | preemptions | blocks read from disk |",
            "|---|---:|---:|---:|",
        ]
        for label in ("recompute", "disk"):
            r = s[label]
            rows.append(f"| {label} | {r['output_tok_s']:.1f} | {r['preemptions']} | "
                        f"{r['disk_blocks_loaded']} |")  # fmt: skip
        rows += ["", f"disk / recompute: {s['disk_over_recompute']:.2f}x; same tokens: "
                 f"{s['same_tokens']}", ""]  # fmt: skip
    return "\n".join(rows) + "\n"


def write_plot(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minserve.viz.tiers import plot_first_token_by_tier

    fig, ax = plt.subplots(figsize=(7, 3.5))
    rows = report.get("disk_tier", [])
    lengths = [r["history"] for r in rows]
    seconds = {tier: [r[f"{tier}_s"] for r in rows] for tier in ("recompute", "disk", "device")}
    plot_first_token_by_tier(lengths, seconds, ax)
    return save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
