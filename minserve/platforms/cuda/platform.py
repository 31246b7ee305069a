"""The CUDA platform: Triton kernels compiled, step inputs staged in page-locked memory.

Decided once, at load: the layers compute with minserve's torch ops (one fused kernel
each is torch's business on a GPU), a GGUF layer's blocks are widened inside Triton's
matrix product (`triton_quant.py`) at every row count, attention is the Triton
backend (`attention/backends.py`), and the runner stages each step's host values in
page-locked memory (`staging.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from minserve.attention.metadata import PagedKVCache
from minserve.execution import ExecutionConfig
from minserve.kernels.linear_kernels import NO_KERNELS, KernelLinear, LinearPlan, with_bias
from minserve.model.llama import CausalLM
from minserve.model.ops import MODEL_OPS
from minserve.model.quantized_linear import QuantizedLinear
from minserve.model.runner import ModelRunner
from minserve.platforms.base import Platform
from minserve.platforms.cuda.runner import CudaModelRunner
from minserve.platforms.cuda.triton_quant import quant_matmul


@dataclass(frozen=True)
class CudaPlatform(Platform):
    """A GPU model's decisions: torch ops, Triton for quantized layers, the staging runner."""

    name: str = "cuda"

    def runner(self, model: CausalLM, kv: PagedKVCache, backend: type) -> ModelRunner:
        return CudaModelRunner(model, kv, backend)

    def plan_new_layers(self, model: CausalLM) -> int:
        layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        unplanned = [m for m in layers if m.plan is NO_KERNELS]
        for layer in unplanned:
            layer.plan = triton_plan(layer)
        return len(unplanned)


def triton_linear(kernel: KernelLinear, rows: torch.Tensor) -> torch.Tensor:
    """rows [N, in] through the blocks, widened inside Triton's product (fp32 sums), the
    bias added in fp32 -> [N, out] in the rows' dtype."""
    return with_bias(quant_matmul(rows, kernel.weight, kernel.quant), kernel.bias).to(rows.dtype)


def triton_plan(layer: QuantizedLinear) -> LinearPlan:
    """Every row count through the Triton kernel that widens the blocks as it multiplies."""
    bias = None if layer.bias is None else layer.bias.detach()
    shape = (layer.out_features, layer.in_features)
    kernel = KernelLinear(f"{layer.quant} triton", layer.blocks, *shape, bias, call=triton_linear)
    return LinearPlan(many=kernel)


def plan_triton_linears(model: nn.Module) -> int:
    """Give every GGUF-quantized layer of `model` its Triton plan; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for layer in layers:
        layer.plan = triton_plan(layer)
    return len(layers)


def set_up_cuda(net: CausalLM, execution: ExecutionConfig) -> tuple[ExecutionConfig, CudaPlatform]:
    """Give `net` the GPU paths; return the config with what was chosen."""
    net.use_ops(MODEL_OPS)
    plan_triton_linears(net)
    return replace(execution, ops="torch"), CudaPlatform()
