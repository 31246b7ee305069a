"""The C side of running a decode step's decoder layers in one call (`decode_layers.c`).

Three structs mirror the C ones: `CLinear` (which kernel a linear layer runs, and what it
reads), `CLayer` (a layer's norms, four linears and KV pool) and `CStep` (the model's sizes
and this step's rotation and attention metadata). `platforms/cpu/fused_decode.py` fills them
from the model's modules (each linear's plan says which kernel it runs, `KernelLinear`) and
from the step's attention (`DecodeAttention`, given by `CpuPagedAttention.kernel_decode`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minserve.kernels.build import cpu_kernels
from minserve.kernels.linear_kernels import KernelLinear

_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

LINEAR_KINDS = {  # `decode_layers.c`'s enum: the kernel a linear layer runs
    "rows": 1,  # few rows on the row-major weight (`linear_rows.c`)
    "panels": 2,  # bfloat16 pair panels (`bf16_panels.c`)
    "Q8_0 rows": 3,  # GGUF blocks, few rows (`quant_rows.c`)
    "Q4_0 rows": 4,
    "Q4_1 rows": 5,
    "Q8_0 panels": 6,  # GGUF blocks widened into panels (bfloat16, many rows)
    "Q4_0 panels": 7,
    "Q4_1 panels": 8,
    "int8 rows": 9,  # int8 weights with a scale per output (`quant_rows.c`)
}


class CLinear(ctypes.Structure):
    _fields_ = [
        ("kind", _i64), ("weight", _ptr), ("scales", _ptr), ("bias", _ptr),
        ("out_features", _i64), ("in_features", _i64),
    ]  # fmt: skip


class CLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr), ("post_norm", _ptr),
        ("qkv", CLinear), ("o", CLinear), ("gate_up", CLinear), ("down", CLinear),
        ("k_cache", _ptr), ("v_cache", _ptr),
    ]  # fmt: skip


class CStep(ctypes.Structure):
    _fields_ = [
        ("bf16", _i64), ("kv_int8", _i64),
        ("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64),
        ("inner", _i64), ("eps", _f32), ("scale", _f32),
        ("cos", _ptr), ("sin", _ptr), ("slots", _ptr), ("tables", _ptr), ("context_lens", _ptr),
        ("decode_seqs", _ptr), ("decode_rows", _ptr), ("table_stride", _i64), ("block_size", _i64),
    ]  # fmt: skip


def c_linear(kernel: KernelLinear) -> CLinear:
    """A linear layer's kernel (`linear_kernels.py`) as `decode_layers.c` reads it."""
    if kernel.kind not in LINEAR_KINDS:
        raise ValueError(f"no C linear kernel {kernel.kind!r}; known: {', '.join(LINEAR_KINDS)}")
    return CLinear(
        LINEAR_KINDS[kernel.kind], kernel.weight.data_ptr(),
        None if kernel.scales is None else kernel.scales.data_ptr(),
        None if kernel.bias is None else kernel.bias.data_ptr(),
        kernel.out_features, kernel.in_features,
    )  # fmt: skip


@dataclass(frozen=True)
class DecodeAttention:
    """A step in which every row is one sequence's next token, as the C layers attend: each
    row's slot, its sequence's block table and context, and each layer's pool."""

    slots: torch.Tensor  # [m] int64: where each row's k and v go
    tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [m] int32: row i's keys, its new one included
    seqs: torch.Tensor  # [m] int64: row i's sequence
    rows: torch.Tensor  # [m] int64: 0 .. m - 1
    block_size: int
    scale: float | None  # None: 1 / sqrt(head_dim)
    kv_int8: bool  # an int8 pool (its rows encoded by the store kernel), else the model's dtype
    caches: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # layer -> (k, v) pool


def run_decode_layers(
    x: torch.Tensor, layers: ctypes.Array[CLayer], num_layers: int, step: CStep
) -> None:
    """x [m, hidden] (contiguous, fp32 or bfloat16) through the first `num_layers` layers,
    in place."""
    status = cpu_kernels().decode_layers(
        x.data_ptr(), layers, num_layers, ctypes.byref(step), x.shape[0]
    )
    if status == -1:
        raise MemoryError(f"decode_layers could not allocate scratch for {x.shape[0]} rows")
    if status:
        raise RuntimeError(f"a kernel inside decode_layers failed (status {status})")
