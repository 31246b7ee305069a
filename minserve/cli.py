"""The `minserve` command: `generate`, `check` for the course, `bench`; `serve` to come."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from minserve.bench import (
    chunked_itl_report,
    disagg,
    prefix_report,
    router,
    sched_overhead,
    serve,
    speculative_report,
)
from minserve.course import check
from minserve.router.cli import add_router_parser
from minserve.server.cli import add_serve_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(commands)
    check.add_check_parser(commands)
    add_serve_parser(commands)
    add_router_parser(commands)
    _add_bench_parser(commands)
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["minserve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: say what, no traceback
        print(f"minserve: error: {e}", file=sys.stderr)
        return 2


def _add_generate_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("generate", help="generate a completion (or a chat reply) offline")
    p.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.set_defaults(run=_generate)


def _generate(args: argparse.Namespace) -> int:
    from minserve import LLM, SamplingParams  # torch import only when generating

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
    )
    llm = LLM(model=args.model, dtype=args.dtype)
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        output = llm.chat(messages, params, use_tqdm=False)[0]
    else:
        output = llm.generate(args.prompt, params, use_tqdm=False)[0]
        sys.stdout.write(args.prompt)
    sys.stdout.write(output.outputs[0].text + "\n")
    return 0


def _add_bench_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks (results go to benchmarks/)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    p = kinds.add_parser(
        "offline", help="offline throughput vs the reference path, HF generate and vLLM CPU"
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32, help="shortest prompt and output")
    p.add_argument("--max-len", type=int, default=256, help="longest prompt and output")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32,bfloat16", help="comma-separated dtypes")
    p.add_argument("--peers", default="minserve,reference,hf16,hf64,vllm")
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: SmolLM2)")
    p.add_argument("--output", type=Path, default=Path("benchmarks/offline_throughput"))
    p.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"))
    p.add_argument(
        "--max-load", type=float, default=None,
        help="before each peer, wait for a 1-min load average below this and idle cores",
    )  # fmt: skip
    p.add_argument("--max-wait", type=float, default=600.0, help="seconds, per peer")
    p.set_defaults(run=_bench_offline)
    chunked_itl_report.add_parser(kinds)
    sched_overhead.add_parser(kinds)
    serve.add_parser(kinds)
    prefix_report.add_parser(kinds)
    router.add_parser(kinds)
    disagg.add_parser(kinds)
    speculative_report.add_parser(kinds)


def _bench_offline(args: argparse.Namespace) -> int:
    from minserve.bench.offline_report import markdown, write_report
    from minserve.bench.offline_suite import DTYPES, PEERS, SuiteSettings, run_suite

    peers = _choices(args.peers, PEERS, "peer")
    dtypes = _choices(args.dtype, DTYPES, "dtype")
    settings = SuiteSettings(
        num_requests=args.num_requests,
        min_len=args.min_len,
        max_len=args.max_len,
        seed=args.seed,
        peers=peers,
        dtypes=dtypes,
        model=args.model,
        vllm_python=args.vllm_python,
        max_load=args.max_load,
        max_wait_s=args.max_wait,
    )
    report = run_suite(settings, args.command_line, lambda r: write_report(r, args.output))
    written = write_report(report, args.output)
    print(markdown(report))
    print("wrote " + ", ".join(map(str, written)))
    return 0


def _choices(text: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    """Split a comma-separated option and check each item against `allowed`."""
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise ValueError(f"unknown {what} {', '.join(unknown)!r}; choose from {', '.join(allowed)}")
    return items


if __name__ == "__main__":
    sys.exit(main())
