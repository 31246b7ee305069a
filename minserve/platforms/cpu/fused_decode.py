"""A decode step's decoder layers in one C call, where every piece of them runs in C anyway.

`CausalLM.forward` walks the layers in Python: per layer about twenty calls (two norms, four
linears, RoPE, the KV store, attention, two residual adds, the views between them). On a
CPU with the C kernels, each of those calls is one kernel, and at batch 1 the kernels of
SmolLM2's 30 layers take about 10 ms while the walk around them takes 3 to 4 ms more.
`FusedDecode` hands the walk to C (`kernels/decode_layers.c`): the same kernels, in the same
order, on the same tensors, so the hidden states are bit for bit what the Python loop gives
(`tests/test_decode_layers.py` checks it for every linear and KV format). It is what a CUDA
graph does for a GPU's decode step: the launches without the interpreter between them.

It takes a step when every row is a decode on the C attention backend (a bfloat16, fp32 or
int8 pool), the model computes with the C ops (`platforms/cpu/ops.py`), and each linear
layer's plan runs a C kernel for that many rows (`kernel(num_rows)` on `PackedLinear`,
`QuantizedLinear` and `Int8Linear`: the same answer their forward acts on); otherwise
`__call__` returns None and the Python loop runs. The CPU runner owns it
(`platforms/cpu/runner.py`). The structs for a row count are built once and kept.
"""

from __future__ import annotations

import torch
from torch import nn

from minserve.kernels.build import cpu_kernels
from minserve.kernels.decode_layers import (
    LINEAR_KINDS,
    CLayer,
    CStep,
    DecodeAttention,
    c_linear,
    run_decode_layers,
)
from minserve.kernels.linear_kernels import KernelLinear
from minserve.model.int8_linear import Int8Linear
from minserve.model.llama import CausalLM
from minserve.model.quantized_linear import QuantizedLinear
from minserve.model_config import ModelConfig
from minserve.platforms.cpu.packed_linear import PackedLinear

KERNEL_LINEARS = (PackedLinear, QuantizedLinear, Int8Linear)  # the linears with a plan


class KernelLayers:
    """One row count's layers as C structs, with the tensors they point into kept alive."""

    def __init__(self, layers: list[nn.Module], num_rows: int, dtype: torch.dtype) -> None:
        self.linears: list[KernelLinear] = []  # the converted biases live as long as this
        self.structs = (CLayer * len(layers))()  # ctypes array
        self.pools: tuple[int, int] | None = None  # layer 0's pool pointers the structs hold
        for struct, layer in zip(self.structs, layers, strict=True):
            struct.input_norm = layer.input_layernorm.weight.data_ptr()
            struct.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            for name, linear in linears_of(layer).items():
                kernel = c_kernel(linear, num_rows)
                self.linears.append(kernel)
                setattr(struct, name, c_linear(kernel))

    def point_at(self, attention: DecodeAttention) -> None:
        """Each layer's struct at its KV pool (again only when the pool moved)."""
        k0, v0 = attention.caches(0)
        if self.pools == (k0.data_ptr(), v0.data_ptr()):
            return
        for layer, struct in enumerate(self.structs):
            k, v = attention.caches(layer)
            struct.k_cache, struct.v_cache = k.data_ptr(), v.data_ptr()
        self.pools = (k0.data_ptr(), v0.data_ptr())


class FusedDecode:
    """The model's decoder layers run from C for decode steps (see the module docstring)."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        self.layers = list(model.model.layers)
        self.by_rows: dict[tuple[int, torch.dtype], KernelLayers | None] = {}
        self.revision = model.revision  # the model's layers as the structs saw them

    @staticmethod
    def fits(model: CausalLM) -> bool:
        """Layers whose shape the C loop runs: q/k/v and gate/up fused, no q/k norms, CPU."""
        return (
            not model.config.qk_norm
            and cpu_kernels() is not None
            and all(
                layer.self_attn.qkv_proj is not None
                and layer.mlp.gate_up_proj is not None
                and layer.input_layernorm.weight.is_cpu
                for layer in model.model.layers
            )
        )

    def kernel_layers(self, num_rows: int, dtype: torch.dtype) -> KernelLayers | None:
        """The structs for `num_rows` rows of `dtype`, or None where some layer would run
        torch (a linear without a C kernel for that many rows, or norms in another dtype).
        Built again when the model's layers changed what they compute with (a codec)."""
        if self.revision != self.model.revision:
            self.by_rows.clear()
            self.revision = self.model.revision
        key = (num_rows, dtype)
        if key not in self.by_rows:
            fits = all(
                layer.input_layernorm.weight.dtype is dtype
                and layer.post_attention_layernorm.weight.dtype is dtype
                and all(
                    c_kernel(linear, num_rows) is not None for linear in linears_of(layer).values()
                )
                for layer in self.layers
            )
            self.by_rows[key] = KernelLayers(self.layers, num_rows, dtype) if fits else None
        return self.by_rows[key]

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: object
    ) -> torch.Tensor | None:
        """x [m, hidden] (embedded), cos/sin [m, 1, head_dim] -> the hidden states after every
        layer [m, hidden], or None where this step is not one the C loop runs."""
        kernel_decode = getattr(attention, "kernel_decode", None)
        if kernel_decode is None or torch.is_grad_enabled() or not x.is_cpu:
            return None
        step_attention: DecodeAttention | None = kernel_decode(x.dtype)
        if step_attention is None:
            return None
        layers = self.kernel_layers(x.shape[0], x.dtype)
        if layers is None:
            return None
        layers.point_at(step_attention)
        cos, sin = (
            cos.reshape(x.shape[0], -1).contiguous(),
            sin.reshape(x.shape[0], -1).contiguous(),
        )
        step = self.step(x.dtype, cos, sin, step_attention)
        hidden = x.contiguous().clone()  # [m, hidden]: the residual stream, updated in place
        run_decode_layers(hidden, layers.structs, len(self.layers), step)
        return hidden

    def step(
        self, dtype: torch.dtype, cos: torch.Tensor, sin: torch.Tensor, a: DecodeAttention
    ) -> CStep:
        """The model's sizes and this step's rotation and attention metadata."""
        c = self.config
        return CStep(
            int(dtype is torch.bfloat16), int(a.kv_int8),
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.rms_norm_eps, a.scale if a.scale is not None else c.head_dim**-0.5,
            cos.data_ptr(), sin.data_ptr(), a.slots.data_ptr(), a.tables.data_ptr(),
            a.context_lens.data_ptr(), a.seqs.data_ptr(), a.rows.data_ptr(),
            a.tables.stride(0), a.block_size,
        )  # fmt: skip


def c_kernel(linear: nn.Module, num_rows: int) -> KernelLinear | None:
    """The kernel a linear layer's forward runs on `num_rows` rows where C can run it."""
    if not isinstance(linear, KERNEL_LINEARS):
        return None
    kernel = linear.kernel(num_rows)
    return kernel if kernel is not None and kernel.kind in LINEAR_KINDS else None


def linears_of(layer: nn.Module) -> dict[str, nn.Module]:
    """A decoder layer's four linears by their names in `CLayer` (q/k/v and gate/up fused)."""
    attention, mlp = layer.self_attn, layer.mlp
    return {
        "qkv": attention.qkv_proj, "o": attention.o_proj,
        "gate_up": mlp.gate_up_proj, "down": mlp.down_proj,
    }  # fmt: skip
