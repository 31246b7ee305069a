"""The `minserve` command: `generate`, `serve`, `router`, `bench`, and `check` and `hint`
for the course."""

from __future__ import annotations

import argparse
import shlex
import sys

from minserve.bench.cli import add_bench_parser
from minserve.course import check, hints
from minserve.router.cli import add_router_parser
from minserve.server.cli import add_serve_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(commands)
    check.add_check_parser(commands)
    hints.add_hint_parser(commands)
    add_serve_parser(commands)
    add_router_parser(commands)
    add_bench_parser(commands)
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
    p.add_argument(
        "--quantization", default=None, choices=["gguf", "int8"],
        help="gguf: a .gguf file's weights as stored; int8: per output channel",
    )  # fmt: skip
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
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization)
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        output = llm.chat(messages, params, use_tqdm=False)[0]
    else:
        output = llm.generate(args.prompt, params, use_tqdm=False)[0]
        sys.stdout.write(args.prompt)
    sys.stdout.write(output.outputs[0].text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
