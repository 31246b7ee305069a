"""Prefill/decode disaggregation's record: KV transfer, 1P1D vs colocated, capacity plans.

    python -m benchmarks.disagg --max-load 1.5   # about 5-10 min on 2 quiet cores

Runs what `minserve bench disagg` runs (same options), under a run record with one torch
thread, and writes disagg.{json,md,png}: the tables of every part, a plot of transfer over
prefill time by prompt length and of each plan's SLO-met rate by prefill share.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

from benchmarks.run_env import RunRecord, measure_recorded, record_parser, write_results
from minserve.bench.disagg import add_arguments, measure
from minserve.bench.disagg_tables import section_lines


def main(argv: list[str] | None = None) -> int:
    args = record_parser(__spec__.name, __doc__, add_arguments).parse_args(argv)
    record, report = measure_recorded(__spec__.name, argv, args, measure, threads=1)
    report["run"] = asdict(record)
    has_plot = "transfer" in report or "plans" in report
    write_results(report, args.output, markdown(report), plot if has_plot else None)
    return 0


def markdown(report: dict) -> str:
    """The run record, then every part the run has."""
    run = report.get("run", {})
    lines = [
        "# Prefill/decode disaggregation: KV transfer, 1P1D vs colocated, capacity plans",
        "",
        f"Command: `{run.get('command', '?')}` ({run.get('date', '?')})",
    ]
    if run:
        lines.append(RunRecord(**run).load_line())
    return "\n".join(lines + section_lines(report)) + "\n"


def plot(report: dict, path: Path) -> Path:
    """Transfer/prefill against prompt length; SLO-met rate per GPU against the prefill share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = report.get("plans", [])
    panels = ("transfer" in report) + len(plans)
    if panels == 0:
        raise ValueError("nothing to plot: the report has neither transfers nor plans")
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    axes = list(axes[0])
    if "transfer" in report:
        rows = report["transfer"]["rows"]
        ax = axes.pop(0)
        ax.loglog([r["prompt_len"] for r in rows], [r["transfer_over_prefill"] for r in rows], "o-")
        ax.set(title="KV transfer / prefill time", xlabel="prompt tokens", ylabel="ratio")
    for ax, p in zip(axes, plans):
        _plot_plan(ax, p)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_plan(ax, plan: dict) -> None:
    for i, (gpus, points) in enumerate(plan["by_cluster_size"].items()):
        color = f"C{i}"
        for tp, style in zip(plan["setting"]["tp_degrees"], ("-", "--", ":")):
            split = sorted(
                (q for q in points if q["tp"] == tp and q["num_prefill"]),
                key=lambda q: q["num_prefill"],
            )
            x = [q["num_prefill"] / (q["num_prefill"] + q["num_decode"]) for q in split]
            ax.plot(
                x,
                [q["served_per_gpu"] for q in split],
                style,
                color=color,
                marker=".",
                label=f"{gpus} GPUs TP{tp}",
            )
        colo = max((q for q in points if q["num_colocated"]), key=lambda q: q["served_per_gpu"])
        ax.axhline(colo["served_per_gpu"], color=color, lw=0.8, alpha=0.5)
    ax.set(
        title=f"{plan['setting']['name']}: SLO-met rate vs prefill share",
        xlabel="prefill instances / all instances",
        ylabel="SLO-met req/s per GPU; thin: best colocated",
    )
    ax.legend(fontsize=7)


if __name__ == "__main__":
    sys.exit(main())
