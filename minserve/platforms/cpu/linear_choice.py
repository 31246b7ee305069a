"""Which kernel a decode step's few rows should use: measured once per machine, on this CPU.

`PackedLinear` runs oneDNN on a prepacked weight, the right choice for a prefill's hundreds
of rows. For a decode's few rows the product is memory-bound, and the few-row C kernel
(`kernels/linear_rows.c`), which streams the row-major weight, was faster on the Xeon we
measured: 1.1-1.3x per pass over SmolLM2's layers at 1 to 12 rows, even at 16 rows, and
beating MKL's `F.linear` at 1 to 3 rows as well (`benchmarks/linear_rows.md`). Where it
stops winning depends on the CPU and on the layer's shape. So the CPU platform times both on
the model's own linears, each shape apart, a few passes each, taking turns, and gives each
layer a plan whose few-row limit is the largest row count up to which the kernel won
clearly (`PackedLinear.use_rows_kernel`).

The answer is kept on disk, in the kernel cache, by CPU model, torch's threads and layer
shape (`ChoiceCache`): measured once per machine, it is the same in every process that
loads the model there (tensor-parallel ranks, prefill and decode instances, a restarted
server), so they all round alike and give the same tokens. The execution config can fix
the row count instead (`linear_rows`, from the environment).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from minserve.environment import MEASURED, LinearRows
from minserve.kernels import cpu_ops
from minserve.platforms.cpu.packed_linear import PackedLinear

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
    """Median seconds of one pass over the layers: (the kernel for many rows: oneDNN packed
    or the widened product, few-row kernel), in turns."""
    xs = [torch.randn(rows, layer.in_features, dtype=layer.weight.dtype) for layer in linears]

    def packed() -> None:
        for layer, x in zip(linears, xs):
            layer.many_rows(x)

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


def choice_key(shape: Shape, against: str = "oneDNN") -> str:
    """What a measured choice depends on: the CPU, torch's threads, the layer's shape, and
    the kernel for many rows the few-row kernel was timed against (oneDNN unless named)."""
    in_features, out_features, dtype, bias = shape
    layer = f"{in_features}x{out_features}:{str(dtype).removeprefix('torch.')}:{int(bias)}"
    versus = "" if against == "oneDNN" else f"|vs={against}"
    return f"{cpu_model()}|threads={torch.get_num_threads()}|{layer}{versus}"


def cpu_model() -> str:
    """/proc/cpuinfo's model name ("unknown" where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    names = (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    return next(names, "unknown")


class ChoiceCache:
    """Measured row counts kept in one JSON file per kernel cache (a machine's choices):
    every process that loads a model of these shapes on this CPU, a tensor-parallel rank or
    a prefill or decode instance, reads the same answer and so rounds the same way."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in json.loads(self.path.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            return {}

    def add(self, key: str, rows: int) -> None:
        """Record one choice; written whole to a temporary file, then renamed (atomic)."""
        chosen = self.read() | {key: rows}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False) as f:
            json.dump(chosen, f, indent=1, sort_keys=True)
        os.replace(f.name, self.path)


def tune_kernel_rows(
    model: nn.Module, rows: LinearRows = MEASURED, cache: ChoiceCache | None = None
) -> dict[Shape, int]:
    """Give every `PackedLinear` in `model` its few-row limit, per layer shape: `rows`
    where it is a number, else measured on this machine once (kept in `cache`)."""
    groups: dict[Shape, list[PackedLinear]] = defaultdict(list)
    for m in model.modules():
        if isinstance(m, PackedLinear) and not m.panels:  # panels: one kernel for all rows
            groups[shape_of(m)].append(m)
    known = cache.read() if cache is not None else {}
    chosen = {}
    for shape, linears in groups.items():
        key = choice_key(shape, linears[0].packed_as)
        if not kernel_applies(linears[0]):
            chosen[shape] = 0
        elif rows != MEASURED:
            chosen[shape] = rows
        elif key in known:
            chosen[shape] = known[key]
        else:
            with torch.inference_mode():
                timed = {n: measure(linears, n) for n in CANDIDATE_ROWS}
            chosen[shape] = choose_kernel_rows(timed)
            if cache is not None:
                cache.add(key, chosen[shape])
        for m in linears:
            m.use_rows_kernel(chosen[shape])
    return chosen
