"""`minserve bench ...`: each subcommand measures and prints its table."""

from __future__ import annotations

import argparse

from minserve.bench import (
    chunked_itl_command,
    disagg,
    offline,
    perplexity_command,
    prefix_command,
    router,
    sched_overhead,
    serve,
    speculative_command,
)


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="measure minserve (or any OpenAI server)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    for command in (offline, chunked_itl_command, sched_overhead, serve, prefix_command, router,
                    disagg, speculative_command, perplexity_command):  # fmt: skip
        command.add_parser(kinds)
