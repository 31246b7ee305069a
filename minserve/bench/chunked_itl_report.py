"""`minserve bench chunked-itl`: run the configurations, then write JSON, markdown and a plot.

    minserve bench chunked-itl --threads 1 [--budgets 256,512,1024] [--chosen-budget 512]

Writes benchmarks/chunked_prefill_itl.{json,md,png}. The issue's target: with chunked
prefill, a p99 ITL at least 3x lower than without, for at most 10% less throughput.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from minserve.bench.chunked_itl import ItlConfig, ItlResult, ItlWorkload, comparison, run_configs
from minserve.bench.run_env import RunRecord, write_results

TARGET_P99_REDUCTION = 3.0  # at least this many times lower p99 ITL with chunking
TARGET_THROUGHPUT_RATIO = 0.90  # for at most 10% less throughput
CLOCK_WORDS = {
    "wall": "wall clock (time.perf_counter)",
    "cpu": "this process's CPU time (time.process_time; the machine was shared)",
}


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """The `chunked-itl` subcommand of `minserve bench`."""
    p = kinds.add_parser("chunked-itl", help="running decodes' ITL with and without chunking")
    w = ItlWorkload()
    p.add_argument("--num-streams", type=int, default=w.num_streams, help="decoding requests")
    p.add_argument("--stream-output-len", type=int, default=w.stream_output_len)
    p.add_argument("--num-long", type=int, default=w.num_long, help="long prompts arriving")
    p.add_argument("--long-prompt-len", type=int, default=w.long_prompt_len)
    p.add_argument("--arrival-every", type=int, default=w.arrival_every, help="steps apart")
    p.add_argument("--budgets", default="256,512,1024", help="chunked token budgets to sweep")
    p.add_argument("--chosen-budget", type=int, default=512, help="the one the verdict is on")
    p.add_argument("--unchunked-budget", type=int, default=4096, help="budget without chunking")
    p.add_argument("--repeats", type=int, default=1, help="runs per config, fastest step kept")
    p.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="time steps by wall clock, or by this process's CPU time (steadier when shared)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=w.seed)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--max-load", type=float, default=None, help="wait for a load below this")
    p.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for it")
    p.add_argument("--output", type=Path, default=Path("benchmarks/chunked_prefill_itl"))
    p.set_defaults(run=run_command)


def configs_from(args: argparse.Namespace, workload: ItlWorkload) -> list[ItlConfig]:
    """The unchunked configuration first, then one chunked configuration per budget."""
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    if not budgets or min(budgets) <= workload.num_streams:
        raise ValueError(
            f"--budgets must be token budgets above --num-streams ({workload.num_streams}), "
            f"so a prompt chunk fits beside the decodes; got {args.budgets!r}"
        )
    if args.chosen_budget not in budgets:
        raise ValueError(f"--chosen-budget {args.chosen_budget} is not in --budgets {budgets}")
    if args.unchunked_budget < workload.min_unchunked_budget():
        raise ValueError(
            f"--unchunked-budget {args.unchunked_budget} cannot hold a {workload.long_prompt_len}"
            f"-token prompt beside the decodes; use at least {workload.min_unchunked_budget()}"
        )
    return [ItlConfig(False, args.unchunked_budget), *(ItlConfig(True, b) for b in budgets)]


def run_command(args: argparse.Namespace) -> int:
    from minserve import LLM  # torch import only when running

    workload = ItlWorkload(
        num_streams=args.num_streams,
        stream_output_len=args.stream_output_len,
        num_long=args.num_long,
        long_prompt_len=args.long_prompt_len,
        arrival_every=args.arrival_every,
        seed=args.seed,
    )
    configs = configs_from(args, workload)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    record = RunRecord.start(args.command_line, args.threads, args.max_load, args.max_wait)
    base = LLM(args.model, dtype=args.dtype)
    base.generate([list(range(100, 400))], use_tqdm=False)  # warm-up: a prefill and decodes

    def make_engine(config: ItlConfig) -> Any:
        return LLM(base.loaded, num_blocks=workload.kv_blocks(), **asdict(config)).engine

    with tqdm(total=len(configs) * args.repeats, desc="chunked prefill ITL", unit="run") as bar:
        results, tokens = run_configs(
            make_engine, configs, workload, base.loaded.config.vocab_size, args.repeats,
            on_run=lambda name: (bar.set_postfix_str(name), bar.update()), clock=args.clock,
        )  # fmt: skip
    record.finish()
    settings = {
        **asdict(workload),
        "model": str(args.model or "SmolLM2-135M-Instruct (bundled GGUF)"),
        "dtype": args.dtype,
        "repeats": args.repeats,
        "clock": args.clock,
        "chosen_budget": args.chosen_budget,
    }
    report = build_report(record, settings, results, tokens)
    write_results(report, args.output, markdown(report), write_plot)
    return 0


def build_report(
    record: RunRecord,
    settings: dict[str, Any],
    results: Sequence[ItlResult],
    tokens: dict[str, list[list[int]]],
) -> dict[str, Any]:
    """Everything the run measured, with the comparisons and the verdict on the chosen budget."""
    unchunked = next(r.name for r in results if not r.enable_chunked_prefill)
    compared = comparison(results)
    chosen = compared[ItlConfig(True, settings["chosen_budget"]).name]
    return {
        "command": record.command,
        "date": record.date,
        "machine": record.machine,
        "settings": settings,
        "results": [r.to_dict() for r in results],
        "comparison": {name: _rounded(c) for name, c in compared.items()},
        "same_greedy_tokens_as_unchunked": {
            name: ids == tokens[unchunked] for name, ids in tokens.items()
        },
        "targets": {
            "p99_itl_reduction_at_least": TARGET_P99_REDUCTION,
            "throughput_ratio_at_least": TARGET_THROUGHPUT_RATIO,
        },
        "verdict": {
            "p99_itl_reduction_met": chosen["p99_itl_reduction"] >= TARGET_P99_REDUCTION,
            "throughput_met": chosen["throughput_ratio"] >= TARGET_THROUGHPUT_RATIO,
        },
    }


def _rounded(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in values.items()}


def table_row(r: dict[str, Any], report: dict[str, Any]) -> str:
    c = report["comparison"].get(r["name"], {})
    itl = r["itl_ms"]
    cells = [
        "chunked prefill" if r["enable_chunked_prefill"] else "no chunking",
        str(r["max_num_batched_tokens"]),
        *(f"{itl[k]:.0f}" for k in ("p50", "p90", "p99", "max")),
        f"{c['p99_itl_reduction']:.2f}x" if c else "1.00x",
        f"{r['output_tokens_per_s']:.1f}",
        f"{r['total_tokens_per_s']:.1f}",
        f"{c['throughput_ratio']:.3f}" if c else "1.000",
        f"{r['long_ttft_s']:.1f}",
        f"{r['num_steps']} / {r['max_step_tokens']} / {r['mixed_steps']}",
        "yes" if report["same_greedy_tokens_as_unchunked"][r["name"]] else "no",
    ]
    return "| " + " | ".join(cells) + " |"


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
        "| configuration | token budget | ITL p50 ms | p90 | p99 | max | p99 ITL lower by "
        "| output tok/s | total tok/s | throughput vs no chunking | long prompt TTFT s "
        "| steps / largest step (tokens) / mixed steps | same greedy tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *(table_row(r, report) for r in report["results"]),
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
