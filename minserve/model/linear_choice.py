"""Which kernel a decode step's few rows should use: measured once per process, on this CPU.

`PackedLinear` runs oneDNN on a prepacked weight, the right choice for a prefill's hundreds
of rows. For a decode's few rows the product is memory-bound, and the few-row C kernel
(`kernels/linear_rows.c`), which streams the row-major weight, was faster on the Xeon we
measured: 1.1-1.3x per pass over SmolLM2's layers at 1 to 12 rows, even at 16 rows, and
beating MKL's `F.linear` at 1 to 3 rows as well (`benchmarks/linear_rows.md`). Where it
stops winning depends on the CPU and on the layer's shape. So the loader times both on the
model's own linears, each shape apart, a few passes each, taking turns, and sets
`PackedLinear.kernel_rows` to the largest row count up to which the kernel won clearly.

The answer is cached per process (by the layers' shapes and torch's threads), so every
model loaded in one process makes the same choice and gives the same tokens. The execution
config can fix the row count instead (`linear_rows`, from the environment).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from minserve.environment import MEASURED, LinearRows
from minserve.kernels import cpu_ops
from minserve.model.packed_linear import PackedLinear

# decode batch sizes measured; the rows between two take the lower one's verdict
CANDIDATE_ROWS = (1, 4, 8, 12, 16)
MARGIN = 0.95  # the kernel must take at most 95% of oneDNN's time: noise does not flip it
PASSES = 3  # about 1.5 s for SmolLM2 in all

Shape = tuple[int, int, torch.dtype, bool]  # in, out, dtype, has a bias


def choose_kernel_rows(times: dict[int, tuple[float, float]], margin: float = MARGIN) -> int:
    """times {rows: (oneDNN seconds, kernel seconds)} -> the largest row count up to which
    the kernel won at every measured row count by the margin (0: never)."""
    chosen = 0
    for rows in sorted(times):
        packed, kernel = times[rows]
        if kernel > margin * packed:
            break
        chosen = rows
    return chosen


def time_pass(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(linears: list[PackedLinear], rows: int, passes: int = PASSES) -> tuple[float, float]:
    """Median seconds of one pass over the layers: (oneDNN packed, few-row kernel), in turns."""
    xs = [torch.randn(rows, layer.in_features, dtype=layer.weight.dtype) for layer in linears]

    def packed() -> None:
        for layer, x in zip(linears, xs):
            torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer._bias, "none", [], "")

    def kernel() -> None:
        for layer, x in zip(linears, xs):
            cpu_ops.linear_rows(x, layer._weight, layer._bias)

    packed(), kernel()  # warm: oneDNN builds its kernel for this row count
    samples = [(time_pass(packed), time_pass(kernel)) for _ in range(passes)]
    return statistics.median(p for p, _ in samples), statistics.median(k for _, k in samples)


def shape_of(layer: PackedLinear) -> Shape:
    return layer.in_features, layer.out_features, layer.weight.dtype, layer.bias is not None


def kernel_applies(layer: PackedLinear) -> bool:
    """fp32 or bfloat16 weights with the C kernels built (`cpu_ops.linear_applies`)."""
    return cpu_ops.linear_applies(layer._weight, layer._weight)


_chosen: dict[tuple, int] = {}  # per process: every model of these shapes chooses alike


def tune_kernel_rows(model: nn.Module, rows: LinearRows = MEASURED) -> dict[Shape, int]:
    """Set `kernel_rows` on every `PackedLinear` in `model`, per layer shape: `rows` where it
    is a number, else measured once per process, shape and thread count."""
    groups: dict[Shape, list[PackedLinear]] = defaultdict(list)
    for m in model.modules():
        if isinstance(m, PackedLinear) and not m.panels:  # panels: one kernel for all rows
            groups[shape_of(m)].append(m)
    chosen = {}
    for shape, linears in groups.items():
        key = (shape, torch.get_num_threads())
        if not kernel_applies(linears[0]):
            _chosen[key] = 0
        elif rows != MEASURED:
            _chosen[key] = rows
        elif key not in _chosen:
            with torch.inference_mode():
                timed = {n: measure(linears, n) for n in CANDIDATE_ROWS}
            _chosen[key] = choose_kernel_rows(timed)
        for m in linears:
            m.kernel_rows = _chosen[key]
        chosen[shape] = _chosen[key]
    return chosen
