"""Which GEMM a decode step's few rows should use: measured once per process, on this CPU.

`PackedLinear` runs oneDNN on a prepacked weight, which wins from four rows up everywhere
we measured. For one to three rows it depends on the CPU: on an Intel Xeon here MKL's
`F.linear` streamed the row-major weight 10-13% faster per decode step, on an AMD EPYC
oneDNN was faster at every row count (`benchmarks/packed_linear.md`). So the loader times
both on the model's own linears, a few passes each, taking turns, and sets
`PackedLinear.plain_rows` to the largest row count at which `F.linear` won clearly.

The answer is cached per process (by the layers' shapes and torch's threads), so every
model loaded in one process makes the same choice and gives the same tokens.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minserve.model.packed_linear import PackedLinear

CANDIDATE_ROWS = (1, 2, 3)  # MKL switches to a GEMM kernel from 4 rows, and loses there
MARGIN = 0.95  # F.linear must take at most 95% of oneDNN's time: noise does not flip it
PASSES = 5


def choose_plain_rows(times: dict[int, tuple[float, float]], margin: float = MARGIN) -> int:
    """times {rows: (oneDNN seconds, F.linear seconds)} -> the largest row count up to
    which F.linear won at every row count by the margin (0: never)."""
    chosen = 0
    for rows in sorted(times):
        packed, plain = times[rows]
        if plain > margin * packed:
            break
        chosen = rows
    return chosen


def time_pass(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(linears: list[PackedLinear], rows: int, passes: int = PASSES) -> tuple[float, float]:
    """Median seconds of one pass over every layer: (oneDNN packed, F.linear), taking turns."""
    xs = [torch.randn(rows, layer.in_features, dtype=layer.weight.dtype) for layer in linears]

    def packed() -> None:
        for layer, x in zip(linears, xs):
            torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer._bias, "none", [], "")

    def plain() -> None:
        for layer, x in zip(linears, xs):
            F.linear(x, layer.weight, layer.bias)

    packed(), plain()  # warm: oneDNN builds its kernel for this row count
    samples = [(time_pass(packed), time_pass(plain)) for _ in range(passes)]
    return statistics.median(p for p, _ in samples), statistics.median(q for _, q in samples)


_chosen: dict[tuple, int] = {}  # per process: every model of these shapes chooses alike


def tune_plain_rows(model: nn.Module) -> int:
    """Set `plain_rows` on every `PackedLinear` in `model`: measured once per process and
    set of layer shapes, or taken from $MINSERVE_PLAIN_ROWS where that is set."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not linears:
        return 0
    shapes = tuple((m.in_features, m.out_features, m.weight.dtype) for m in linears)
    key = (shapes, torch.get_num_threads())
    if "MINSERVE_PLAIN_ROWS" in os.environ:
        _chosen[key] = int(os.environ["MINSERVE_PLAIN_ROWS"])
    elif key not in _chosen:
        with torch.inference_mode():
            timed = {rows: measure(linears, rows) for rows in CANDIDATE_ROWS}
        _chosen[key] = choose_plain_rows(timed)
    for m in linears:
        m.plain_rows = _chosen[key]
    return _chosen[key]
