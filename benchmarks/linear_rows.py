"""The few-row C kernel for a decode step's linears against oneDNN (and MKL's F.linear).

    .venv/bin/python -m benchmarks.linear_rows [--rows 1,2,4,8] [--batches 1,4,8] [--steps 80]

1. One pass over SmolLM2's 120 layer linears (fp32, 425 MB in all), and over its head (49152 x
   576), at each row count: oneDNN on the packed weight, F.linear (MKL) and
   `cpu_ops.linear_rows` (`kernels/linear_rows.c`) in turns, median ms of 12 passes.
2. Whole engine decode steps of the bundled SmolLM2 (greedy, prompts of 128 tokens): one
   engine, the kernel on (the loader's measured `kernel_rows` per layer shape) and off
   (oneDNN for every row count) for alternate steps; the tokens of both kinds of step must
   equal a second engine's that never uses the kernel. Writes linear_rows.json and
   linear_rows.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.ab_steps import ab_decode_steps, steps_table
from benchmarks.run_env import RunRecord, command_line
from minserve.kernels import cpu_ops
from minserve.kernels.linear_kernels import NO_KERNELS
from minserve.llm import LLM
from minserve.model.runner import ModelRunner
from minserve.platforms.cpu.linear_choice import shape_of
from minserve.platforms.cpu.packed_linear import PackedLinear
from minserve.viz.linear_timing import PATHS, time_linear_paths

HERE = Path(__file__).parent
PASSES = 12


def one_pass_ms(linears: list[PackedLinear], rows: list[int]) -> list[dict]:
    """Median ms of one pass over `linears` per path and row count, as table rows."""
    times = time_linear_paths(linears, rows, PASSES)
    onednn, mkl, kernel = (times[name] for name in PATHS)
    return [
        {
            "rows": r,
            "onednn_ms": onednn[r],
            "mkl_ms": mkl[r],
            "kernel_ms": kernel[r],
            "kernel_vs_onednn": round(onednn[r] / kernel[r], 3),
            "kernel_vs_mkl": round(mkl[r] / kernel[r], 3),
        }  # fmt: skip
        for r in rows
    ]


def engine_steps(batch: int, steps: int, base: LLM) -> dict:
    """p10 / p50 decode step times with the kernel on and off, alternating steps."""
    linears = [m for m in base.loaded.model.modules() if isinstance(m, PackedLinear)]
    tuned = [m.plan for m in linears]

    def switch(runner: ModelRunner, on: bool) -> None:
        for m, plan in zip(linears, tuned):
            m.plan = plan if on else NO_KERNELS

    # both sides walk the layers in Python
    return ab_decode_steps(base, batch, steps, switch, ("kernel", "onednn"), fused_decode=False)


def write(passes: dict[str, list[dict]], steps: list[dict], tuned: dict, run: RunRecord) -> None:
    record = {"command": run.command, "date": run.date, "machine": run.machine,
              "kernel_rows": tuned, "one_pass": passes, "engine_steps": steps}  # fmt: skip
    (HERE / "linear_rows.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        *run.header_lines("Few-row C kernel vs oneDNN for a decode step's linears (CPU, fp32)"),
        "- the loader's choice in this run (`kernel_rows` per layer shape, in x out): "
        + ", ".join(f"{k} -> {v}" for k, v in tuned.items()),
        "",
    ]
    for what, rows in passes.items():
        lines += [
            f"One pass over {what}, median ms of {PASSES} (the paths in turns):",
            "",
            "| rows | oneDNN | MKL F.linear | kernel | vs oneDNN | vs MKL |",
            "|---|---|---|---|---|---|",
            *(
                f"| {r['rows']} | {r['onednn_ms']} | {r['mkl_ms']} | {r['kernel_ms']} | "
                f"{r['kernel_vs_onednn']}x | {r['kernel_vs_mkl']}x |"
                for r in rows
            ),
            "",
        ]
    lines += [
        "Engine decode steps, bundled SmolLM2-135M fp32, greedy, prompts of 128 tokens, the "
        "kernel on and off (oneDNN) for alternate steps of one engine (ms):",
        "",
        *steps_table(steps, ("kernel", "onednn"), ("kernel", "oneDNN")),
    ]
    (HERE / "linear_rows.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,3,4,6,8,12,16,24")
    parser.add_argument("--batches", default="1,2,4,8,12,16")
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    command = command_line(__spec__.name)
    run = RunRecord.start(command, threads=None, max_load=1.0, max_wait_s=60)
    base = LLM()
    linears = [m for m in base.loaded.model.modules() if isinstance(m, PackedLinear)]
    if not cpu_ops.applies(linears[0]._weight):
        raise SystemExit("the few-row kernel needs fp32 weights and the C kernels built")
    tuned = {f"{s[0]}x{s[1]}": m.plan.few_rows for m in linears for s in [shape_of(m)]}
    head = base.loaded.model.lm_head
    rows = [int(r) for r in args.rows.split(",")]
    layers = [m for m in linears if m is not head]
    passes = {
        f"the {len(layers)} layer linears": one_pass_ms(layers, rows),
        "the head (49152 x 576, 113 MB)": one_pass_ms([head], rows),
    }
    steps = [engine_steps(b, args.steps, base) for b in (int(b) for b in args.batches.split(","))]
    run.finish()
    write(passes, steps, tuned, run)
    print((HERE / "linear_rows.md").read_text())


if __name__ == "__main__":
    main()
