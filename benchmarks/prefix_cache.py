"""The prefix cache's record: cache on vs off, cache-aware vs FCFS, against the targets.

    python -m benchmarks.prefix_cache --threads 2 --num-prefixes 8 --questions 16

Runs what `minserve bench prefix` runs (same options), under a run record, and writes
prefix_cache.{json,md,png}. The targets: a hit rate of at least 90% of the ideal, a time to
first token at least 5x lower on hits, radix-tree upkeep under 1% of the step time.
"""

from __future__ import annotations

import sys
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks.run_env import (
    RunRecord,
    measure_recorded,
    record_parser,
    save_figure,
    write_results,
)
from minserve.bench.prefix_command import add_arguments, measure, runs_table, summary_table

TARGETS = {"hit_rate_of_ideal": 0.90, "ttft_speedup_on_hits": 5.0, "upkeep_fraction": 0.01}
GOALS = {  # the targets as the summary table shows them
    "hit_rate_of_ideal": ">= 90%",
    "chat_hit_rate_of_ideal": ">= 90%",
    "ttft_speedup_on_hits": ">= 5x",
    "upkeep_fraction": "< 1%",
    "lpm_vs_fcfs_hit_rate": "lpm higher",
}


def main(argv: list[str] | None = None) -> int:
    args = record_parser(__spec__.name, __doc__, add_arguments).parse_args(argv)
    record, measured = measure_recorded(__spec__.name, argv, args, measure, args.threads)
    report = {"command": record.command, "date": record.date, "machine": record.machine,
              **measured, "targets": TARGETS}  # fmt: skip
    write_results(report, args.output, markdown(report), write_plot)
    return 0


def markdown(report: dict[str, Any]) -> str:
    sp, mt = report["settings"]["shared_prefix"], report["settings"]["multi_turn"]
    record = RunRecord(report["command"], report["date"], report["machine"])
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
        runs_table(report["runs"]),
        "",
        "## Against the targets",
        "",
        summary_table(report["summary"], GOALS),
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
    return save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
