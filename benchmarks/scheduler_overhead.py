"""Scheduler overhead's record: the share of a decode step outside the model, against the target.

    python -m benchmarks.scheduler_overhead --threads 1   # about 3 min

Runs what `minserve bench scheduler-overhead` runs (same options), under a run record, and
writes scheduler_overhead.{json,md}. The target: overhead under 5% of the step at 64
running requests.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.run_env import RunRecord, measure_recorded, record_parser, write_results
from minserve.bench.sched_overhead import add_arguments, measure_sizes, table

TARGET_FRACTION = 0.05  # at 64 running requests
TARGET_BATCH = 64


def main(argv: list[str] | None = None) -> int:
    args = record_parser(__spec__.name, __doc__, add_arguments).parse_args(argv)
    record, results = measure_recorded(__spec__.name, argv, args, measure_sizes, args.threads)
    report = {
        "command": record.command,
        "date": record.date,
        "machine": record.machine,
        "settings": {"prompt_len": args.prompt_len, "steps": args.steps, "dtype": args.dtype},
        "results": [r.to_dict() for r in results],
        "target": {"num_requests": TARGET_BATCH, "overhead_fraction_below": TARGET_FRACTION},
    }
    write_results(report, args.output, markdown(report, record))
    return 0


def markdown(report: dict[str, Any], record: RunRecord) -> str:
    """The report as a page: how it ran, one row per batch size, the verdict."""
    s = report["settings"]
    verdict = [
        f"At {TARGET_BATCH} running requests: overhead {100 * r['overhead_fraction']:.2f}% of "
        f"the step (target under {100 * TARGET_FRACTION:g}%: "
        f"{'met' if r['overhead_fraction'] < TARGET_FRACTION else 'not met'})."
        for r in report["results"]
        if r["num_requests"] == TARGET_BATCH
    ]
    lines = [
        "# Scheduler overhead at decode steady state",
        "",
        f"- command: `{record.command}`",
        f"- date: {record.date}",
        record.load_line(),
        f"- workload: N requests with {s['prompt_len']}-token random prompts, greedy, EOS "
        f"ignored, all decoding; {s['steps']} steps measured per N after 2 warm-up steps; "
        f"{s['dtype']}",
        "- phases (mean ms per step) from each step's `StepRecord`; overhead = schedule + "
        "prepare (flat batch, slot mapping, block tables) + update (append, stop, outputs)",
        "",
        table(report["results"]),
        "",
        *verdict,
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
