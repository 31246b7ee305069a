"""The CPU platform: C kernels where they are built and win, torch's oneDNN elsewhere.

Decided once, at load, from the execution config (`minserve/execution.py`: the C library
built, the dtype, the environment's switches) and from what this CPU has:

- ops: the C kernels' RMSNorm, RoPE and SwiGLU (`ops.py`) for fp32 and bfloat16 models,
  else minserve's torch ops;
- linears: each weight packed once, for oneDNN or, on a CPU with AVX512-BF16 but no AMX, in
  panels of bfloat16 pairs for minserve's own kernel (on AMX oneDNN's tiles multiply
  faster); on a CPU with neither, a bfloat16 weight is widened to fp32 for each product of
  many rows (oneDNN only emulates bfloat16 there); a decode's few rows go to the few-row
  kernel up to a row count measured once per machine (`linear_choice.py`); quantized
  layers read their blocks in C (`linears.py`);
- runner: `CpuModelRunner`, with the C decode loop and the greedy head screen.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from minserve.attention.metadata import PagedKVCache
from minserve.device import native_bf16
from minserve.execution import ExecutionConfig
from minserve.kernels.cpu_ops import KERNEL_DTYPES
from minserve.model.llama import CausalLM
from minserve.model.ops import MODEL_OPS
from minserve.model.runner import ModelRunner
from minserve.platforms.base import Platform
from minserve.platforms.cpu.fused_decode import FusedDecode
from minserve.platforms.cpu.greedy_head import GreedyScreen, greedy_screen_for
from minserve.platforms.cpu.linear_choice import ChoiceCache, Shape, tune_kernel_rows
from minserve.platforms.cpu.linears import plan_quantized_linears
from minserve.platforms.cpu.ops import C_KERNEL_OPS
from minserve.platforms.cpu.packed_linear import PackedLinear, prepack_linears
from minserve.platforms.cpu.runner import CpuModelRunner

AMX = "AMX-BF16"


@dataclass(frozen=True)
class CpuPlatform(Platform):
    """A CPU model's decisions: its ops, whether decode steps run the C loop, its screen."""

    name: str = "cpu"
    fused: bool = False
    screen: GreedyScreen | None = None
    c_kernels: bool = False  # the C kernels are built here: quantized layers read blocks

    def runner(self, model: CausalLM, kv: PagedKVCache, backend: type) -> ModelRunner:
        return CpuModelRunner(model, kv, backend, self.fused, self.screen)

    def plan_new_layers(self, model: CausalLM) -> int:
        if not self.c_kernels:
            return 0
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        return plan_quantized_linears(model, dtype, unplanned_only=True)


def panels_win(cpu_bf16: str | None) -> bool:
    """minserve's bfloat16 panel kernel beats oneDNN on a CPU with AVX512-BF16 and no AMX
    (1.2-1.5x offline on the EPYC, `benchmarks/bf16_panels.md`); with AMX, oneDNN's tile
    kernels are faster (446 against 334 tok/s offline on a Xeon)."""
    return cpu_bf16 is not None and cpu_bf16 != AMX


def set_up_cpu(net: CausalLM, execution: ExecutionConfig) -> tuple[ExecutionConfig, CpuPlatform]:
    """Give `net` the CPU paths `execution` allows; return the config with what was chosen."""
    dtype = next(p.dtype for p in net.parameters() if p.is_floating_point())
    c_ops = execution.c_kernels and dtype in KERNEL_DTYPES
    ops = C_KERNEL_OPS if c_ops else MODEL_OPS
    net.use_ops(ops)
    if execution.c_kernels:
        plan_quantized_linears(net, dtype)
    execution = replace(execution, ops="c-kernels" if c_ops else "torch")
    if not execution.prepack:
        return execution, CpuPlatform(ops=ops, c_kernels=execution.c_kernels)
    native = native_bf16()
    prepack_linears(net, panels=execution.c_kernels and panels_win(native), widen=native is None)
    # oneDNN or the few-row C kernel for a decode's rows, per layer shape, on this CPU
    # (layers packed in panels take their own kernel at every row count)
    cache = ChoiceCache(execution.kernel_cache / "linear_rows.json")
    rows = tune_kernel_rows(net, execution.linear_rows, cache)
    screen = greedy_screen_for(net) if execution.greedy_screen else None
    fused = execution.c_kernels and FusedDecode.fits(net)
    execution = replace(
        execution,
        fused_decode=fused,
        rows_by_shape=tuple((shape_name(shape), n) for shape, n in rows.items()),
        packed_as=packed_as(net),
        greedy_screen=screen is not None,
    )
    return execution, CpuPlatform(
        ops=ops, fused=fused, screen=screen, c_kernels=execution.c_kernels
    )


def packed_as(net: torch.nn.Module) -> str:
    """How the linears were packed: "panels", "widen", "oneDNN" or a mix ("panels+oneDNN")."""
    kinds = {m.packed_as for m in net.modules() if isinstance(m, PackedLinear)}
    return "+".join(name for name in ("panels", "widen", "oneDNN") if name in kinds)


def shape_name(shape: Shape) -> str:
    """A linear's shape as the execution summary shows it: "576x1536", "+bias" if any."""
    in_features, out_features, _, bias = shape
    return f"{in_features}x{out_features}" + ("+bias" if bias else "")
