"""The bfloat16 panel kernel against oneDNN's packed kernel, for a bfloat16 model's linears.

    .venv/bin/python -m benchmarks.bf16_panels [--rows 1,4,8,...] [--batches 1,8,...] [--steps 60]

1. One pass over the bundled SmolLM2's 120 layer linears (bfloat16, 212 MB) and over its
   head (49152 x 576) at each row count, one row to a prefill's 2048: oneDNN on its packed
   weight and `cpu_ops.linear_panels` (`kernels/bf16_panels.c`) on the panels, in turns,
   median ms of the passes, with the multiply-adds per second each reached.
2. Whole engine decode steps (bfloat16, greedy, prompts of 128 tokens): one engine whose
   linears switch between the two layouts on alternate steps; a second engine on oneDNN
   takes the same steps and says whether the tokens stayed the same.
Needs a CPU with AVX512-BF16. Writes bf16_panels.json and bf16_panels.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.ab_steps import ab_decode_steps, steps_table
from benchmarks.run_env import RunRecord, command_line
from minserve.kernels import cpu_ops
from minserve.kernels.linear_kernels import NO_KERNELS, LinearPlan
from minserve.llm import LLM
from minserve.model.runner import ModelRunner
from minserve.platforms.cpu.packed_linear import PackedLinear

HERE = Path(__file__).parent
PASSES = 7


class Layouts:
    """Each linear's weight in both layouts, and a switch between them."""

    def __init__(self, linears: list[PackedLinear]) -> None:
        self.linears = linears
        self.panels = [m.packed for m in linears]
        self.onednn = [
            torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), None) for m in linears
        ]

    def use_panels(self, runner: ModelRunner, on: bool) -> None:
        """Every linear on the panel kernel, or on oneDNN for every row count."""
        for m, panels, onednn in zip(self.linears, self.panels, self.onednn):
            m.panels, m.packed = on, panels if on else onednn
            m.plan = LinearPlan(many=m.panels_kernel()) if on else NO_KERNELS


def one_pass_ms(layouts: Layouts, picked: list[int], rows: list[int]) -> list[dict]:
    """Median ms of one pass over the linears `picked` per layout and row count."""
    table = []
    flops_per_row = 2 * sum(
        layouts.linears[i].in_features * layouts.linears[i].out_features for i in picked
    )
    with torch.inference_mode():
        for count in rows:
            xs = [torch.randn(count, layouts.linears[i].in_features).bfloat16() for i in picked]
            passes = {
                "onednn": lambda xs=xs: [
                    torch.ops.mkldnn._linear_pointwise(x, layouts.onednn[i], None, "none", [], "")
                    for i, x in zip(picked, xs)
                ],
                "panels": lambda xs=xs: [
                    cpu_ops.linear_panels(x, layouts.panels[i], None) for i, x in zip(picked, xs)
                ],
            }  # fmt: skip
            samples: dict[str, list[float]] = {name: [] for name in passes}
            for i in range(PASSES + 1):
                for name in list(passes)[:: 1 if i % 2 else -1]:
                    start = time.perf_counter()
                    passes[name]()
                    if i:  # the first pass warms (oneDNN builds its kernel for this row count)
                        samples[name].append(time.perf_counter() - start)
            ms = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
            table.append({
                "rows": count,
                "onednn_ms": round(ms["onednn"], 2),
                "panels_ms": round(ms["panels"], 2),
                "speedup": round(ms["onednn"] / ms["panels"], 3),
                "onednn_gflop_s": round(flops_per_row * count / ms["onednn"] / 1e6),
                "panels_gflop_s": round(flops_per_row * count / ms["panels"] / 1e6),
            })  # fmt: skip
    return table


def write(passes: dict[str, list[dict]], steps: list[dict], run: RunRecord) -> None:
    record = {"command": run.command, "date": run.date, "machine": run.machine,
              "one_pass": passes, "engine_steps": steps}  # fmt: skip
    (HERE / "bf16_panels.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [*run.header_lines("bfloat16 linears: the panel kernel vs oneDNN's packed kernel"), ""]
    for what, rows in passes.items():
        lines += [
            f"One pass over {what}, median ms of {PASSES} (the two in turns), and GFLOP/s:",
            "",
            "| rows | oneDNN ms | panels ms | speed-up | oneDNN GFLOP/s | panels GFLOP/s |",
            "|---|---|---|---|---|---|",
            *(
                f"| {r['rows']} | {r['onednn_ms']} | {r['panels_ms']} | {r['speedup']}x | "
                f"{r['onednn_gflop_s']} | {r['panels_gflop_s']} |"
                for r in rows
            ),
            "",
        ]
    lines += [
        "Engine decode steps, bundled SmolLM2-135M bfloat16, greedy, prompts of 128 tokens, "
        "panels and oneDNN on alternate steps of one engine (ms; oneDNN for every row count "
        "here, where without panels the loader's few-row kernel takes 1-4 rows; same tokens: "
        "every step's tokens equal an all-oneDNN engine's, bf16 sums in another order can "
        "flip a near tie):",
        "",
        *steps_table(steps, ("panels", "onednn"), ("panels", "oneDNN")),
    ]
    (HERE / "bf16_panels.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,24,32,48,64,128,512,2048")
    parser.add_argument("--batches", default="1,8,16,32,64")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    command = command_line(__spec__.name)
    run = RunRecord.start(command, threads=None, max_load=1.0, max_wait_s=60)
    base = LLM(dtype="bfloat16")
    linears = [m for m in base.loaded.model.modules() if isinstance(m, PackedLinear)]
    if not all(m.panels for m in linears):
        raise SystemExit("the panel kernel needs a CPU with AVX512-BF16 and the C kernels built")
    layouts = Layouts(linears)
    head = base.loaded.model.lm_head
    layers = [i for i, m in enumerate(linears) if m is not head]
    rows = [int(r) for r in args.rows.split(",")]
    passes = {
        f"the {len(layers)} layer linears": one_pass_ms(layouts, layers, rows),
        "the head (49152 x 576)": one_pass_ms(layouts, [linears.index(head)], rows),
    }
    batches = [int(b) for b in args.batches.split(",")]
    steps = [
        ab_decode_steps(  # both sides walk the layers in Python
            base, b, args.steps, layouts.use_panels, ("panels", "onednn"), fused_decode=False
        )
        for b in batches
    ]
    run.finish()
    write(passes, steps, run)
    print((HERE / "bf16_panels.md").read_text())


if __name__ == "__main__":
    main()
