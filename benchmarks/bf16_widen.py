"""A bfloat16 linear on a CPU without a native bfloat16 product: oneDNN against widening.

    .venv/bin/python -m benchmarks.bf16_widen [--rows 24,64,256,2048]

Where the CPU has neither AVX512-BF16 nor AMX, oneDNN emulates a bfloat16 product. The CPU
platform then keeps the bfloat16 weight and widens it to fp32 for each call of many rows
(`KernelLinear` "widen", `kernels/linear_kernels.py`). For one pass over SmolLM2's layer
linears (120 of them) and over its 49152 x 576 head, at each row count: oneDNN's bfloat16
product on the packed weight, the widened product, and oneDNN's fp32 product on a packed
fp32 copy (the speed an fp32 model gets, at twice the memory); median ms of 7 passes, in
turns. Writes bf16_widen.json and bf16_widen.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from benchmarks.run_env import RunRecord, command_line
from minserve.device import native_bf16
from minserve.loader import load_model
from minserve.platforms.cpu.packed_linear import PackedLinear

HERE = Path(__file__).parent
PASSES = 7
Pass = Callable[[], object]


def paths(weights: list[torch.Tensor], rows: int) -> dict[str, Pass]:
    """One pass over `weights` [out, in] (bfloat16) per path, on `rows` random rows."""
    xs = [torch.randn(rows, w.shape[1], dtype=torch.bfloat16) for w in weights]
    bf16 = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    fp32 = [torch.ops.mkldnn._reorder_linear_weight(w.float(), None) for w in weights]
    widened = [PackedLinear(_linear(w), widen=True) for w in weights]

    def onednn(packed: list[torch.Tensor], widen_rows: bool) -> Pass:
        def run() -> None:
            for x, p in zip(xs, packed):
                rows_in = x.float() if widen_rows else x
                torch.ops.mkldnn._linear_pointwise(rows_in, p, None, "none", [], "")

        return run

    def widen() -> None:
        for x, layer in zip(xs, widened):
            layer.many_rows(x)

    return {"onednn_bf16": onednn(bf16, False), "widen": widen, "onednn_fp32": onednn(fp32, True)}


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


def median_ms(runs: dict[str, Pass]) -> dict[str, float]:
    """Median ms of each pass, the passes taken in turns after one warm-up each."""
    for run in runs.values():
        run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(PASSES):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            samples[name].append(1e3 * (time.perf_counter() - start))
    return {name: round(statistics.median(s), 2) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="24,64,256,2048")
    parser.add_argument("--max-load", type=float, default=1.5)
    parser.add_argument("--output", default=str(HERE / "bf16_widen"))
    args = parser.parse_args()
    record = RunRecord.start(command_line("benchmarks.bf16_widen"), None, args.max_load, 600)
    model = load_model(dtype="bfloat16", prepack=False).model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    head = model.lm_head.weight.detach()
    layers = [m.weight.detach() for m in linears if m.weight is not model.lm_head.weight]
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    with torch.inference_mode():
        for part, weights in (("layers", layers), ("head", [head])):
            for rows in rows_list:
                ms = median_ms(paths(weights, rows))
                speedup = round(ms["onednn_bf16"] / ms["widen"], 2)
                results.append({"part": part, "rows": rows, **ms, "widen_vs_onednn_bf16": speedup})
    record.finish()
    out = Path(args.output)
    out.with_suffix(".json").write_text(json.dumps(
        {"record": record.__dict__, "native_bf16": native_bf16(), "results": results}, indent=1
    ) + "\n")  # fmt: skip
    lines = record.header_lines("bfloat16 linears without a native bfloat16 product")
    lines += [f"- native bfloat16 on this CPU: {native_bf16() or 'none'}", "",
              "| part | rows | oneDNN bf16 ms | widen ms | oneDNN fp32 copy ms | widen speed-up |",
              "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    lines += [
        f"| {r['part']} | {r['rows']} | {r['onednn_bf16']} | {r['widen']} | "
        f"{r['onednn_fp32']} | {r['widen_vs_onednn_bf16']}x |"
        for r in results
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
