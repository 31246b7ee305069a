"""Which kernel a linear layer runs, decided once at load: `KernelLinear` and `LinearPlan`.

A platform (`minserve/platforms/`) looks at each linear layer once, when the model is loaded,
and gives it a `LinearPlan`: the kernel for a decode's few rows, up to how many rows that
one wins, and the kernel for more. The layer's `forward` asks `plan.kernel(num_rows)` and
runs what it gets (or its own torch code on None); the CPU's fused decode loop asks the
same question and hands the same kernel to C. One decision, read by both.

`KernelLinear` is a kernel together with what it reads, each tensor in the form and dtype
that kernel takes (a row-major or panel-packed weight, GGUF blocks, int8 rows and their
scales, the bias already converted), so a call converts nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minserve.kernels import cpu_ops


@dataclass(frozen=True)
class KernelLinear:
    """A linear layer as one kernel sees it: the kernel's name and the tensors it reads.

    Names: "rows", "panels" (`linear_rows.c`, `bf16_panels.c`); "Q8_0 rows", "Q4_1 panels",
    ... (GGUF blocks, `quant_rows.c`); "int8 rows"; "Q4_1 widen" (blocks widened in C, then
    one matrix product); "widen" (a bfloat16 weight and its rows widened to fp32, one fp32
    product). A kernel of another name brings its own `call` (the GPU's Triton
    product, `platforms/cuda/triton_quant.py`)."""

    kind: str
    weight: torch.Tensor  # row-major, panels, GGUF blocks or int8, as the kernel reads it
    out_features: int
    in_features: int
    bias: torch.Tensor | None = None  # [out], in the dtype the kernel adds it in
    scales: torch.Tensor | None = None  # [out] fp32 ("int8 rows")
    call: Callable[[KernelLinear, torch.Tensor], torch.Tensor] | None = None  # else by name

    def __post_init__(self) -> None:
        if self.call is None and _family(self.kind) not in _RUNS:
            raise ValueError(f"no linear kernel {self.kind!r}; known: {', '.join(_RUNS)}")

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N, in] -> [N, out] in the rows' dtype, the bias added."""
        return (self.call or _RUNS[_family(self.kind)])(self, rows)

    @property
    def quant(self) -> str:
        """The GGUF format of a blocks kernel ("Q4_1 rows" -> "Q4_1")."""
        return self.kind.split()[0]


@dataclass(frozen=True)
class LinearPlan:
    """A linear layer's kernels by row count: `few` up to `few_rows` rows, `many` above
    (None: the layer's own torch code runs)."""

    few: KernelLinear | None = None
    few_rows: int = 0
    many: KernelLinear | None = None

    def kernel(self, num_rows: int) -> KernelLinear | None:
        """The kernel for `num_rows` rows, or None where the layer's torch code runs."""
        return self.few if num_rows <= self.few_rows else self.many


NO_KERNELS = LinearPlan()  # every row count runs the layer's torch code


def _family(kind: str) -> str:
    """ "Q4_1 rows" -> "blocks rows"; "rows" stays "rows"."""
    first, _, rest = kind.partition(" ")
    return f"blocks {rest}" if first in cpu_ops.QUANT_BLOCK_BYTES else kind


def _rows(k: KernelLinear, rows: torch.Tensor) -> torch.Tensor:
    return cpu_ops.linear_rows(rows, k.weight, k.bias)


def _panels(k: KernelLinear, rows: torch.Tensor) -> torch.Tensor:
    return cpu_ops.linear_panels(rows, k.weight, k.bias)


def _block_rows(k: KernelLinear, rows: torch.Tensor) -> torch.Tensor:
    return cpu_ops.quant_rows(rows, k.weight, k.quant, k.bias)


def _block_panels(k: KernelLinear, rows: torch.Tensor) -> torch.Tensor:
    return cpu_ops.quant_panels(rows, k.weight, k.quant, k.bias)


def _int8_rows(k: KernelLinear, rows: torch.Tensor) -> torch.Tensor:
    return cpu_ops.int8_rows(rows, k.weight, k.scales, k.bias)


def _block_widen(k: KernelLinear, rows: torch.Tensor) -> torch.Tensor:
    """Many rows: the weight widened once for this call (in C) to the rows' dtype where it
    is bfloat16 (rounded as a dense bfloat16 model's), else fp32; one matrix product in
    that dtype ("widen") or in fp32 ("widen32": a CPU without a bfloat16 product); the bias
    added in fp32."""
    dtype = torch.bfloat16 if rows.dtype == torch.bfloat16 else torch.float32
    weight = cpu_ops.dequantize_blocks(k.weight, k.quant, dtype)  # [out, in]
    if k.kind.endswith("widen32"):
        out = F.linear(rows.float(), weight.float())
    else:
        out = F.linear(rows.to(dtype), weight)
    return with_bias(out, k.bias).to(rows.dtype)


WIDEN_TILE_BYTES = 8 << 20  # widened weight rows per product: about 8 MiB of fp32


def _widen(k: KernelLinear, rows: torch.Tensor) -> torch.Tensor:
    """Many rows on a bfloat16 weight where the CPU has no bfloat16 product: both widened to
    fp32 for this call, fp32 products (fp32 sums, as a bfloat16 GEMM takes them). A large
    weight (an LM head) is widened a tile of output rows at a time, each tile used while it
    is still in cache (3x faster than widening 49152 x 576 at once)."""
    x = rows.float()  # [N, in]
    tile = max(256, WIDEN_TILE_BYTES // (4 * k.in_features))
    if k.out_features <= tile:
        out = F.linear(x, k.weight.float())  # [N, out] fp32
    else:
        out = torch.empty(x.shape[0], k.out_features)  # [N, out] fp32
        scratch = torch.empty(tile, k.in_features)  # [tile, in] fp32, reused by every tile
        for start in range(0, k.out_features, tile):
            stop = min(start + tile, k.out_features)
            part = scratch[: stop - start]
            part.copy_(k.weight[start:stop])  # widened into the scratch rows
            torch.mm(x, part.t(), out=out[:, start:stop])
    return with_bias(out, k.bias).to(rows.dtype)


def with_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias.float()


_RUNS: dict[str, Callable[[KernelLinear, torch.Tensor], torch.Tensor]] = {
    "rows": _rows,
    "panels": _panels,
    "blocks rows": _block_rows,
    "blocks panels": _block_panels,
    "blocks widen": _block_widen,
    "blocks widen32": _block_widen,
    "int8 rows": _int8_rows,
    "widen": _widen,
}
