"""`minserve bench chunked-itl`: running decodes' ITL while long prompts arrive, with chunked
prefill at several token budgets and without.

    minserve bench chunked-itl --threads 1 [--budgets 256,512,1024] [--clock cpu]

prints a row per configuration: ITL percentiles, throughput, the long prompts' TTFT, and
whether the greedy tokens equal the unchunked run's.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from tqdm.auto import tqdm

from minserve.bench.chunked_itl import ItlConfig, ItlWorkload, comparison, run_configs
from minserve.bench.options import positive_ints, set_threads


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The workload, the configurations and the model."""
    w = ItlWorkload()
    p.add_argument("--num-streams", type=int, default=w.num_streams, help="decoding requests")
    p.add_argument("--stream-output-len", type=int, default=w.stream_output_len)
    p.add_argument("--num-long", type=int, default=w.num_long, help="long prompts arriving")
    p.add_argument("--long-prompt-len", type=int, default=w.long_prompt_len)
    p.add_argument("--arrival-every", type=int, default=w.arrival_every, help="steps apart")
    p.add_argument("--budgets", default="256,512,1024", help="chunked token budgets to sweep")
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


def add_parser(kinds: argparse._SubParsersAction) -> None:
    """The `chunked-itl` subcommand of `minserve bench`."""
    p = kinds.add_parser("chunked-itl", help="running decodes' ITL with and without chunking")
    add_arguments(p)
    p.set_defaults(run=run_command)


def workload_from(args: argparse.Namespace) -> ItlWorkload:
    return ItlWorkload(
        num_streams=args.num_streams,
        stream_output_len=args.stream_output_len,
        num_long=args.num_long,
        long_prompt_len=args.long_prompt_len,
        arrival_every=args.arrival_every,
        seed=args.seed,
    )


def configs_from(args: argparse.Namespace, workload: ItlWorkload) -> list[ItlConfig]:
    """The unchunked configuration first, then one chunked configuration per budget."""
    budgets = positive_ints(args.budgets, "--budgets")
    if min(budgets) <= workload.num_streams:
        raise ValueError(
            f"--budgets must be token budgets above --num-streams ({workload.num_streams}), "
            f"so a prompt chunk fits beside the decodes; got {args.budgets!r}"
        )
    if args.unchunked_budget < workload.min_unchunked_budget():
        raise ValueError(
            f"--unchunked-budget {args.unchunked_budget} cannot hold a {workload.long_prompt_len}"
            f"-token prompt beside the decodes; use at least {workload.min_unchunked_budget()}"
        )
    return [ItlConfig(False, args.unchunked_budget), *(ItlConfig(True, b) for b in budgets)]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run every configuration on the workload the options describe; the settings, each
    configuration's numbers, the chunked runs against the unchunked one, and whether their
    greedy tokens are the same."""
    from minserve import LLM  # torch import only when running

    workload = workload_from(args)
    configs = configs_from(args, workload)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    base = LLM(args.model, dtype=args.dtype)
    base.generate([list(range(100, 400))], use_tqdm=False)  # warm-up: a prefill and decodes

    def make_engine(config: ItlConfig) -> Any:
        return LLM(base.loaded, num_blocks=workload.kv_blocks(), **asdict(config)).engine

    with tqdm(total=len(configs) * args.repeats, desc="chunked prefill ITL", unit="run") as bar:
        results, tokens = run_configs(
            make_engine, configs, workload, base.loaded.config.vocab_size, args.repeats,
            on_run=lambda name: (bar.set_postfix_str(name), bar.update()), clock=args.clock,
        )  # fmt: skip
    unchunked = configs[0].name
    settings = {
        **asdict(workload),
        "model": str(args.model or "SmolLM2-135M-Instruct (bundled GGUF)"),
        "dtype": args.dtype,
        "repeats": args.repeats,
        "clock": args.clock,
    }
    return {
        "settings": settings,
        "results": [r.to_dict() for r in results],
        "comparison": {name: _rounded(c) for name, c in comparison(results).items()},
        "same_greedy_tokens_as_unchunked": {
            name: ids == tokens[unchunked] for name, ids in tokens.items()
        },
    }


def run_command(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    print(table(measure(args)))
    return 0


def _rounded(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in values.items()}


def table(measured: dict[str, Any]) -> str:
    """A markdown table, a row per configuration (the unchunked one first)."""
    rows = [
        "| configuration | token budget | ITL p50 ms | p90 | p99 | max | p99 ITL lower by "
        "| output tok/s | total tok/s | throughput vs no chunking | long prompt TTFT s "
        "| steps / largest step (tokens) / mixed steps | same greedy tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in measured["results"]:
        c = measured["comparison"].get(r["name"], {})
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
            "yes" if measured["same_greedy_tokens_as_unchunked"][r["name"]] else "no",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
