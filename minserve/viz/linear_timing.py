"""A decode step's linears on a CPU: oneDNN, MKL's F.linear and the few-row C kernel, side by
side, timed as one pass over a model's layers at each row count (the paths in turns, so
that drift favours none; medians kept). Chapter 02 and `benchmarks/linear_rows.py`."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from minserve.kernels import cpu_ops
from minserve.platforms.cpu.packed_linear import PackedLinear

LinearPath = Callable[[PackedLinear, torch.Tensor], torch.Tensor]
PATHS: dict[str, LinearPath] = {
    "oneDNN": lambda layer, x: torch.ops.mkldnn._linear_pointwise(
        x, layer.packed, layer._bias, "none", [], ""
    ),
    "MKL F.linear": lambda layer, x: F.linear(x, layer.weight, layer.bias),
    "few-row kernel": lambda layer, x: cpu_ops.linear_rows(x, layer._weight, layer._bias),
}


def time_linear_paths(
    linears: Sequence[PackedLinear], rows: Sequence[int], passes: int = 12
) -> dict[str, dict[int, float]]:
    """Median ms of one pass over `linears`, {path: {row count: ms}} (fp32 layers)."""
    result: dict[str, dict[int, float]] = {name: {} for name in PATHS}
    with torch.inference_mode():
        for count in rows:
            xs = [torch.randn(count, layer.in_features) for layer in linears]
            samples: dict[str, list[float]] = {name: [] for name in PATHS}
            for i in range(passes + 1):
                for name in list(PATHS)[:: 1 if i % 2 else -1]:
                    start = time.perf_counter()
                    for layer, x in zip(linears, xs):
                        PATHS[name](layer, x)
                    if i:  # the first pass warms (oneDNN builds its kernel for this row count)
                        samples[name].append((time.perf_counter() - start) * 1e3)
            for name, ms in samples.items():
                result[name][count] = round(statistics.median(ms), 2)
    return result
