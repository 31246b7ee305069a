"""Prepacked linear layers: each weight reordered once into oneDNN's blocked layout (CPU).

`F.linear` on a CPU gives the GEMM a plain row-major weight on every call, and the GEMM
copies it into cache-sized panels as it goes. A decode step has a handful of activation
rows, so that repacking, not the arithmetic, is much of a linear's cost. oneDNN can do the
reorder once, at load time; each call then streams the packed weight (vLLM's CPU backend
does the same with its `onednn_mm`). The sums are the same, taken in another order: the
outputs differ from `F.linear` by rounding (about 1e-6 relative in fp32).

oneDNN builds (JIT-compiles) a kernel for every new number of rows, about 1 ms per layer
shape: a step whose token count the process has not seen yet would pay ~0.1 s for
SmolLM2's 121 linears. Row counts above 32 are therefore padded up to one of 16 sizes per
doubling (at most 1/16 more rows), so a server meets few distinct shapes and keeps each
kernel in oneDNN's cache.

A decode step's few rows are another matter: there the product is memory-bound, and a
plain C loop that streams the row-major weight (`kernels/linear_rows.c`) beat both oneDNN and
MKL on the Xeon we measured. The layer's `plan` says up to how many rows it takes over;
the CPU platform measures that per layer shape on the machine (`linear_choice.py`).

A bfloat16 weight on a CPU with AVX512-BF16 is packed another way: into panels of bfloat16
pairs (`cpu_ops.pack_panels`), which minserve's own kernel (`kernels/bf16_panels.c`)
multiplies for any number of rows, one row to a prefill's thousands. Over SmolLM2's layer
linears it beat oneDNN's packed kernel at every row count measured (1 to 2048), most at a
decode's 8 to 64 rows (the head alone: even from 512 rows, slower at 2048); nor does it
build a kernel per row count.

A bfloat16 weight on a CPU with neither AVX512-BF16 nor AMX has no fast bfloat16 product at
all: oneDNN emulates it, about a quarter of its fp32 speed. There the layer keeps its
bfloat16 weight and widens it for each call of many rows (`widen`: the weight and the rows
to fp32, one fp32 product, the result rounded back), as fast as an fp32 weight from a few
dozen rows on, with the bfloat16 model's memory; a decode's few rows still stream the
bfloat16 weight through the few-row kernel. The sums are taken in fp32, as oneDNN's
bfloat16 product takes them.

`benchmarks/packed_linear.md`, `benchmarks/linear_rows.md`, `benchmarks/bf16_panels.md` and
`benchmarks/bf16_widen.md` have the speed-ups measured.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minserve.kernels import cpu_ops
from minserve.kernels.linear_kernels import KernelLinear, LinearPlan


class PackedLinear(nn.Module):
    """`nn.Linear` whose forward runs oneDNN's inner product on a prepacked weight.

    `weight` and `bias` stay as they were (a tied embedding shares the weight, and
    `state_dict()` still names it); `packed` is the reordered copy oneDNN reads. `plan`
    (set at load, `linear_choice.py`) sends a decode's few rows to the few-row C kernel on
    `weight` instead. With `panels` (a bfloat16 weight the panel kernel takes,
    `cpu_ops.panels_apply`), `packed` holds the weight in panels of pairs instead, and the
    plan sends every row count to `cpu_ops.linear_panels`. With `widen` (a bfloat16 weight
    on a CPU without a native bfloat16 product), nothing is packed: the plan's kernel for
    many rows widens the weight to fp32 for each call (`KernelLinear` "widen").
    """

    def __init__(self, linear: nn.Linear, panels: bool = False, widen: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out, in]
        self.bias = linear.bias
        self.panels = panels and cpu_ops.panels_apply(linear.weight)
        self.widen = widen and not self.panels and linear.weight.dtype == torch.bfloat16
        # detached once here, not on every call (the same storage as `weight` and `bias`)
        self._weight = linear.weight.detach().contiguous()  # [out, in], row-major
        self._bias = None if linear.bias is None else linear.bias.detach()
        packed: torch.Tensor | None = None
        if self.panels:
            packed = cpu_ops.pack_panels(linear.weight)  # [out / 16, in / 2, 16, 2]
        elif not self.widen:
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.register_buffer("packed", packed, persistent=False)
        many = self.panels_kernel() if self.panels else self.widen_kernel() if self.widen else None
        self.plan = LinearPlan(many=many)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # [N, in]
        num_rows = rows.shape[0]
        kernel = self.plan.kernel(num_rows)
        if kernel is not None:
            out = kernel(rows)  # [N, out]
            return out if rows is x else out.view(*x.shape[:-1], self.out_features)
        return self.onednn(rows, x)

    def onednn(self, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's product on the packed weight, the rows padded to a size it has built."""
        num_rows = rows.shape[0]
        padded = padded_rows(num_rows)
        if padded != num_rows:
            rows = F.pad(rows, (0, 0, 0, padded - num_rows))  # [padded, in], zero rows last
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self._bias, "none", [], "")
        if rows is x:  # a decode step's usual case: nothing to cut or reshape
            return out
        return out[:num_rows].view(*x.shape[:-1], self.out_features)  # [..., out]

    def kernel(self, num_rows: int) -> KernelLinear | None:
        """The C kernel `forward` runs on `num_rows` rows; None where it runs oneDNN."""
        return self.plan.kernel(num_rows)

    def many_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N, in] -> [N, out] as `forward` computes them above the few-row limit."""
        many = self.plan.many
        return many(rows) if many is not None else self.onednn(rows, rows)

    def widen_kernel(self) -> KernelLinear:
        """The fp32 product on the bfloat16 weight, widened for each call."""
        return KernelLinear("widen", self._weight, self.out_features, self.in_features, self._bias)

    def rows_kernel(self) -> KernelLinear:
        """The few-row kernel on the row-major weight, the bias in the weight's dtype."""
        bias = None if self._bias is None else self._bias.to(self._weight.dtype).contiguous()
        return KernelLinear("rows", self._weight, self.out_features, self.in_features, bias)

    def panels_kernel(self) -> KernelLinear:
        """The panel kernel on the packed pairs, the bias in bfloat16."""
        bias = None if self._bias is None else self._bias.to(torch.bfloat16).contiguous()
        return KernelLinear("panels", self.packed, self.out_features, self.in_features, bias)

    def use_rows_kernel(self, up_to: int) -> None:
        """Send up to `up_to` rows to the few-row kernel (0: none); the plan's kernel for many
        rows (oneDNN where it has none) takes the rest."""
        if not self.panels:
            few = self.rows_kernel() if up_to else None
            self.plan = LinearPlan(few, up_to if few is not None else 0, self.plan.many)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, bias={self.bias is not None}, {self.packed_as}"

    @property
    def packed_as(self) -> str:
        """ "panels", "widen" or "oneDNN": what runs a step's many rows."""
        return "panels" if self.panels else "widen" if self.widen else "oneDNN"


def padded_rows(num_rows: int) -> int:
    """The row count oneDNN sees: exact up to 32, then rounded up to a multiple of 1/16
    of the power of two below it (129 -> 136, 1000 -> 1024): 16 sizes per doubling."""
    unit = max(1, 2 ** (num_rows.bit_length() - 5))
    return -(-num_rows // unit) * unit


def prepack_linears(model: nn.Module, panels: bool = False, widen: bool = False) -> int:
    """Replace every `nn.Linear` inside `model` by a `PackedLinear` (bfloat16 pair panels
    where `panels` is set and the weight allows; a bfloat16 weight widened for each call
    where `widen` is set; else oneDNN's layout); return how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, panels, widen))
    return len(targets)
