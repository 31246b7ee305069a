"""Which C kernel each quantized linear layer of a CPU model runs: planned once, at load.

`QuantizedLinear` (GGUF blocks) and `Int8Linear` (int8 rows) know only their torch
reference; the CPU platform gives each a `LinearPlan` here, from the model's dtype and what
the C library was built with. The numbers below were measured on the 2-core AMD EPYC
(`benchmarks/fewer_bytes.md`, `benchmarks/bf16_panels.md`).
"""

from __future__ import annotations

import torch
from torch import nn

from minserve.device import native_bf16
from minserve.kernels import cpu_ops
from minserve.kernels.linear_kernels import NO_KERNELS, KernelLinear, LinearPlan
from minserve.model.int8_linear import Int8Linear
from minserve.model.quantized_linear import QuantizedLinear

BLOCK_ROWS = 16  # up to this many rows the C kernel reads the blocks; more widen them once
# where the panel kernel takes a bfloat16 model's rows (AVX512-BF16), it takes them from this
# many: over SmolLM2's Q4_1 layer linears the few-row kernel took 0.86x the panels' time at
# 8 rows, 1.10x at 12 and 1.32x at 16
PANEL_FROM = 9
INT8_ROWS = 16  # up to this many rows the C kernel reads the int8 rows; more widen them once


def quantized_plan(layer: QuantizedLinear, dtype: torch.dtype) -> LinearPlan:
    """GGUF blocks: few rows read as stored, more widened (in panels where the CPU
    multiplies bfloat16 pairs, else the whole weight in C for one matrix product)."""
    if dtype not in cpu_ops.KERNEL_DTYPES:
        return NO_KERNELS
    shape = (layer.out_features, layer.in_features)
    bias = None if layer.bias is None else layer.bias.detach()
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    few = KernelLinear(f"{layer.quant} rows", layer.blocks, *shape, bias32)
    panels = dtype is torch.bfloat16 and layer.out_features % (2 * cpu_ops.PANEL) == 0
    if panels and cpu_ops.panels_native():
        bias16 = None if bias is None else bias.to(torch.bfloat16).contiguous()
        many = KernelLinear(f"{layer.quant} panels", layer.blocks, *shape, bias16)
        return LinearPlan(few, PANEL_FROM - 1, many)
    # a bfloat16 product where the CPU has one (AMX: oneDNN's tiles), else fp32 sums of the
    # same bfloat16-rounded weights (oneDNN only emulates bfloat16 there, 4x slower)
    widen = "widen" if dtype is torch.float32 or native_bf16() is not None else "widen32"
    return LinearPlan(
        few, BLOCK_ROWS, KernelLinear(f"{layer.quant} {widen}", layer.blocks, *shape, bias32)
    )


def int8_plan(layer: Int8Linear, dtype: torch.dtype) -> LinearPlan:
    """int8 rows: few rows read as stored (whole 32-weight groups); more widened in torch."""
    if dtype not in cpu_ops.KERNEL_DTYPES or layer.in_features % cpu_ops.QUANT_BLOCK:
        return NO_KERNELS
    bias = None if layer.bias is None else layer.bias.detach().to(torch.float32).contiguous()
    shape = (layer.out_features, layer.in_features)
    return LinearPlan(
        KernelLinear("int8 rows", layer.qweight, *shape, bias, layer.scales), INT8_ROWS
    )


def plan_quantized_linears(
    model: nn.Module, dtype: torch.dtype, unplanned_only: bool = False
) -> int:
    """Give every quantized linear layer of `model` (or those without kernels yet) its CPU
    plan; returns how many."""
    count = 0
    for m in model.modules():
        if not isinstance(m, QuantizedLinear | Int8Linear):
            continue
        if unplanned_only and m.plan is not NO_KERNELS:
            continue
        m.plan = quantized_plan(m, dtype) if isinstance(m, QuantizedLinear) else int8_plan(m, dtype)
        count += 1
    return count
