"""Routing's record: round_robin, cache_aware and kv_aware over the same replicas.

    python -m benchmarks.router --threads 2 --max-load 1.5   # both workloads, every policy

Runs what `minserve bench router` runs (same options), under a run record, and writes
router.{json,md,png}: prefix hit rate from the replicas' own counters, goodput and TTFT.
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.run_env import (
    RunRecord,
    measure_recorded,
    record_parser,
    save_figure,
    write_results,
)
from minserve.bench.router import add_arguments, measure, table


def main(argv: list[str] | None = None) -> int:
    args = record_parser(__spec__.name, __doc__, add_arguments).parse_args(argv)
    record, measured = measure_recorded(__spec__.name, argv, args, measure, args.threads)
    report = {"command": record.command, "date": record.date, "machine": record.machine,
              **measured}  # fmt: skip
    write_results(report, args.output, markdown(report), write_plot)
    return 0


def markdown(report: dict) -> str:
    """The settings, then one row per workload and policy."""
    s = report["settings"]
    record = RunRecord(report["command"], report["date"], report["machine"])
    slos = ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in s["goodput_slos_s"].items())
    ran = {run["workload"] for run in report["runs"]}
    shapes = {
        "multi-turn": f"multi-turn: {s['num_turns']} turns of {s['input_len']} words",
        "shared-prefix": f"shared-prefix: {s['num_prefixes']} prefixes of {s['prefix_len']} "
        f"tokens, each shared by 1/{s['num_prefixes']} of the sessions, + {s['input_len']} "
        "own tokens",
    }
    workloads = "; ".join(text for name, text in shapes.items() if name in ran)
    rows = [
        "# Routing policies: round robin, cache-aware, KV-aware",
        "",
        f"- command: `{report['command']}`",
        f"- date: {report['date']}",
        record.load_line(),
        f"- {s['replicas']} replicas (prefix caching on; for kv_aware publishing their KV "
        "events, which the router follows) and the router in one process; "
        f"{s['num_sessions']} sessions per workload at {s['request_rate']} sessions/s "
        f"(Poisson, seed {s['seed']}); {workloads}; {s['output_len']} output tokens; "
        f"goodput at {slos or 'no SLO'}",
        "- hit rate = prompt tokens served from the replicas' prefix caches / prompt tokens",
        "",
        table(report["runs"]),
    ]
    return "\n".join(rows) + "\n"


def write_plot(report: dict, path: Path) -> Path:
    """Hit rate, and goodput inside throughput (pale), policies side by side per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(run["workload"] for run in report["runs"]))
    policies = list(dict.fromkeys(run["policy"] for run in report["runs"]))
    by = {(run["workload"], run["policy"]): run for run in report["runs"]}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        xs = [w + i * width for w in range(len(workloads))]
        runs = [by[(workload, policy)] for workload in workloads]
        bars = axes[0].bar(xs, [100 * r["prefix_hit_rate"] for r in runs], width, label=policy)
        color = bars.patches[0].get_facecolor()
        throughput = [r["summary"]["request_throughput"] for r in runs]
        axes[1].bar(xs, throughput, width, color=color, alpha=0.3)
        goodput = [r["summary"]["request_goodput"] or 0.0 for r in runs]
        axes[1].bar(xs, goodput, width, color=color)
    labels = ("prefix hit rate (%)", "goodput, in throughput (requests/s)")
    for ax, label in zip(axes, labels, strict=True):
        ax.set_xticks([w + 0.4 - width / 2 for w in range(len(workloads))], workloads)
        ax.set_ylabel(label)
    axes[0].legend(frameon=False)
    return save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
