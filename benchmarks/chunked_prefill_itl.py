"""Chunked prefill's record: the streams' ITL with and without chunking, against the targets.

    python -m benchmarks.chunked_prefill_itl --threads 1 --clock cpu   # about 4 min

Runs what `minserve bench chunked-itl` runs (same options), under a run record, and writes
chunked_prefill_itl.{json,md,png}. The targets: with chunked prefill at the chosen budget, a
p99 ITL at least 3x lower than without, for at most 10% less throughput.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from benchmarks.run_env import RunRecord, measure_recorded, record_parser, write_results
from minserve.bench.chunked_itl import ItlConfig
from minserve.bench.chunked_itl_command import add_arguments, measure, table
from minserve.bench.options import positive_ints

TARGET_P99_REDUCTION = 3.0  # at least this many times lower p99 ITL with chunking
TARGET_THROUGHPUT_RATIO = 0.90  # for at most 10% less throughput
CLOCK_WORDS = {
    "wall": "wall clock (time.perf_counter)",
    "cpu": "this process's CPU time (time.process_time; the machine was shared)",
}


def main(argv: list[str] | None = None) -> int:
    parser = record_parser(__spec__.name, __doc__, add_arguments)
    parser.add_argument("--chosen-budget", type=int, default=512, help="the one the verdict is on")
    args = parser.parse_args(argv)
    if args.chosen_budget not in positive_ints(args.budgets, "--budgets"):
        parser.error(f"--chosen-budget {args.chosen_budget} is not in --budgets {args.budgets}")
    record, measured = measure_recorded(__spec__.name, argv, args, measure, args.threads)
    report = build_report(record, measured, args.chosen_budget)
    write_results(report, args.output, markdown(report), write_plot)
    return 0


def build_report(record: RunRecord, measured: dict[str, Any], chosen_budget: int) -> dict:
    """What the run measured, how it ran, and the verdict on the chosen budget."""
    chosen = measured["comparison"][ItlConfig(True, chosen_budget).name]
    return {
        "command": record.command,
        "date": record.date,
        "machine": record.machine,
        **measured,
        "settings": {**measured["settings"], "chosen_budget": chosen_budget},
        "targets": {
            "p99_itl_reduction_at_least": TARGET_P99_REDUCTION,
            "throughput_ratio_at_least": TARGET_THROUGHPUT_RATIO,
        },
        "verdict": {
            "p99_itl_reduction_met": chosen["p99_itl_reduction"] >= TARGET_P99_REDUCTION,
            "throughput_met": chosen["throughput_ratio"] >= TARGET_THROUGHPUT_RATIO,
        },
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as a page: how it ran, the table, and the verdict."""
    s = report["settings"]
    record = RunRecord(report["command"], report["date"], report["machine"])
    chosen = ItlConfig(True, s["chosen_budget"]).name
    c = report["comparison"][chosen]
    met = {True: "met", False: "not met"}
    lines = [
        "# Chunked prefill: inter-token latency of running decodes",
        "",
        f"- command: `{report['command']}`",
        f"- date: {report['date']}",
        record.load_line(),
        f"- model: {s['model']}, {s['dtype']}; greedy, EOS ignored, random token ids (seed "
        f"{s['seed']})",
        f"- workload: {s['num_streams']} streams ({s['stream_prompt_len']}-token prompts, "
        f"{s['stream_output_len']} tokens each) decode while {s['num_long']} prompts of "
        f"{s['long_prompt_len']} tokens ({s['long_output_len']} output tokens each) arrive, "
        f"one every {s['arrival_every']} steps from step {s['first_arrival']}",
        "- ITL: gaps between consecutive tokens of a stream, pooled over the streams (vLLM's "
        "definition); throughput: tokens over engine time (sum of step durations); steps "
        f"timed by {CLOCK_WORDS[s['clock']]}; {s['repeats']} run(s) per configuration, "
        "fastest time kept step by step",
        "",
        table(report),
        "",
        f"Chosen budget {s['chosen_budget']}: p99 ITL {c['p99_itl_reduction']:.2f}x lower "
        f"(target at least {TARGET_P99_REDUCTION:g}x: "
        f"{met[report['verdict']['p99_itl_reduction_met']]}), throughput "
        f"{c['throughput_ratio']:.3f} of no chunking (target at least "
        f"{TARGET_THROUGHPUT_RATIO:g}: {met[report['verdict']['throughput_met']]}).",
        "",
        "The default chosen budget, 512, is vLLM's default `max_num_batched_tokens` with "
        "chunked prefill (V0): what a user who does not tune gets. The sweep shows the knob: a "
        "smaller budget cuts the streams' p99 ITL further, a larger one moves it toward no "
        "chunking. A throughput ratio above 1 means the chunked run was faster: one 2k-token "
        "prefill step costs more than its chunks together on this CPU (attention scores grow "
        "with the square of the step's tokens).",
        "",
        "Mixed steps run a prefill chunk and decodes together (Sarathi-Serve's stall-free "
        "batches). The machine is shared: compare rows within this run, not across runs.",
        "",
    ]
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: Path) -> Path:
    """Left: one stream's ITL over time, no chunking vs the chosen budget. Right: the sweep,
    p99 ITL against throughput, one point per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    results = report["results"]
    chosen = ItlConfig(True, report["settings"]["chosen_budget"]).name
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[3, 2])
    for r in results:
        if r["name"] in (results[0]["name"], chosen):
            example = r["example_stream"]
            times = example["token_times_s"][1:]  # a gap is drawn at its second token
            left.plot(times, example["itl_ms"], ".-", label=_label(r))
    left.set(xlabel="seconds (engine time)", ylabel="inter-token latency (ms)", ylim=(0, None))
    left.set_title(f"One stream while {report['settings']['long_prompt_len']}-token prompts arrive")
    left.legend()
    for r in results:
        right.scatter(r["total_tokens_per_s"], r["itl_ms"]["p99"], s=40)
        point = (r["total_tokens_per_s"], r["itl_ms"]["p99"])
        right.annotate(_label(r), point, xytext=(4, 6), textcoords="offset points", fontsize=8)
    right.set(xlabel="total tokens / s", ylabel="p99 ITL (ms)", ylim=(0, None))
    right.margins(x=0.25)
    right.set_title("Token budget: latency against throughput")
    fig.savefig(path, dpi=110)
    return path


def _label(r: dict[str, Any]) -> str:
    mode = "chunked" if r["enable_chunked_prefill"] else "no chunking"
    return f"{mode}, budget {r['max_num_batched_tokens']}"


if __name__ == "__main__":
    sys.exit(main())
