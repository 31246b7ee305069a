"""How the engine runs on this machine: one `ExecutionConfig`, resolved once at load.

The arguments say what the user asked for ("auto" where nothing), the machine says what can
run (a GPU, a C compiler, oneDNN), and a few environment variables switch a CPU path off to
compare it with another (read in `minserve/environment.py` only).
`LLM(...)` logs the resolved config in one line
(`summary()`) and returns it from `llm.get_execution_config()`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from minserve.attention.backends import choose_attention, resolve_c_kernels
from minserve.device import choose_device, native_bf16
from minserve.environment import (
    C_KERNELS,
    CPU_BF16,
    GREEDY_SCREEN,
    MEASURED,
    LinearRows,
    env_linear_rows,
    env_switch,
    kernel_cache_dir,
)
from minserve.kernels.cpu_ops import KERNEL_DTYPES
from minserve.kernels.onednn import can_prepack
from minserve.kvcache.kv_format import KVFormat, check_kv_cache_dtype, kv_format
from minserve.openmp_env import openmp_waits

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NO_NATIVE_BF16 = "no native bfloat16 on this CPU (AVX512-BF16 or AMX)"


@dataclass(frozen=True)
class ExecutionConfig:
    """Which path each part of a step takes: what the loader set up and the engine runs.

    `c_kernels`: the C kernels of the decoder layers run (RMSNorm, RoPE, SiLU-and-mul,
    few-row linear, head screen): switched on, on a CPU, the library built. They take fp32
    tensors, the few-row linear bfloat16 weights too; anything else runs the layers' torch
    code.
    """

    device: torch.device
    dtype: torch.dtype
    attention: str  # the attention backend: "cpu", "torch" or "triton" (never "auto")
    c_kernels: bool
    prepack: bool  # linear weights reordered once: oneDNN's layout, or bf16 pair panels (CPU)
    linear_rows: LinearRows  # few-row kernel up to this many rows (0: off), or measured
    greedy_screen: bool
    kernel_cache: Path
    rows_by_shape: tuple[tuple[str, int], ...] = ()  # what the loader set: ("576x576", 16)
    c_kernels_missing: str | None = None  # why they are off although switched on
    device_why: str = ""  # why this device: "auto: no CUDA device is usable: ..."
    dtype_why: str = ""  # why this dtype: "auto: the CPU has AVX512-BF16"
    quantization: str = "none"  # "gguf(Q4_1:210,Q8_0:1; weights 97.1 MiB)": kept as stored
    openmp_waits: str = "spin(10000)-then-sleep"  # how OpenMP threads wait (openmp_env.py)
    kv_cache_dtype: str = "auto"  # canonical name: "fp8" is recorded as "fp8_e4m3"
    packed_as: str = ""  # what the loader packed: "panels", "oneDNN" or "panels+oneDNN"
    fused_decode: bool = False  # decode steps run the layers from one C call (fused_decode.py)
    ops: str = "torch"  # what the layers compute with: "torch", "c-kernels" or "yours"
    platform: str = ""  # whose decisions: "cpu", "cuda" (`minserve/platforms/`)

    def with_kv_cache(self, name: str) -> ExecutionConfig:
        """This config with the KV cache stored as `name` (vLLM's `kv_cache_dtype`;
        `attention/backends.py` checks that the backend serves it)."""
        return replace(self, kv_cache_dtype=check_kv_cache_dtype(name))

    @property
    def kv_format(self) -> KVFormat:
        """The KV pool's format: `kv_cache_dtype` over this config's model dtype."""
        return kv_format(self.kv_cache_dtype, self.dtype)

    def summary(self) -> str:
        """One line: every choice, e.g. `execution: device=cpu dtype=float32 ...`."""
        fields = {
            "platform": self.platform or self.device.type,
            "device": _with_why(str(self.device), self.device_why),
            "dtype": _with_why(str(self.dtype).removeprefix("torch."), self.dtype_why),
            "attention": self.attention,
            "ops": self.ops,
            "c_kernels": _on_off(self.c_kernels, self.c_kernels_missing),
            "prepack": _on_off(self.prepack) + (f"({self.packed_as})" if self.packed_as else ""),
            "linear_rows": self._rows_text(),
            "greedy_screen": _on_off(self.greedy_screen),
            "fused_decode": _on_off(self.fused_decode),
            "quantization": self.quantization,
            "openmp_waits": self.openmp_waits,
            "kv_cache": self.kv_format.name,
            "kernel_cache": str(self.kernel_cache),
        }
        return "execution: " + " ".join(f"{k}={v}" for k, v in fields.items())

    def _rows_text(self) -> str:
        if self.packed_as == "panels":
            return "panels"  # the panel kernel takes every row count
        if self.linear_rows == MEASURED:
            shapes = ",".join(f"{shape}:{rows}" for shape, rows in self.rows_by_shape)
            return f"{MEASURED}({shapes})"
        return str(self.linear_rows) if self.linear_rows else "off"


def _cpu_bf16(wanted: bool, c_kernels: bool, device: torch.device) -> tuple[str | None, str]:
    """The CPU's native bfloat16 instructions where "auto" may serve bf16 with them, else
    None and why not."""
    if device.type != "cpu":
        return None, "not a CPU"
    if not wanted:
        return None, f"{CPU_BF16}=0"
    feature = native_bf16()
    if feature is None:
        return None, NO_NATIVE_BF16
    if not c_kernels:
        return None, "the C kernels that serve bfloat16 are off"
    if not can_prepack(device, torch.bfloat16):
        return None, "oneDNN cannot pack bfloat16 weights here"
    return feature, ""


def _with_why(choice: str, why: str) -> str:
    return f"{choice}({why})" if why else choice


def _on_off(on: bool, why_off: str | None = None) -> str:
    if on:
        return "on"
    return "off" if why_off is None else f"off({why_off.splitlines()[0]})"


def resolve_execution(
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    attention: str = "auto",
    prepack: bool = True,
    environ: Mapping[str, str] | None = None,
) -> ExecutionConfig:
    """Decide every path from the arguments, this machine and the environment (os.environ
    unless `environ` is given). Invalid values raise ValueError naming what to change."""
    env = os.environ if environ is None else environ
    wanted, screen = env_switch(env, C_KERNELS), env_switch(env, GREEDY_SCREEN)
    bf16_wanted = env_switch(env, CPU_BF16)
    rows = env_linear_rows(env)  # every variable checked, on any device
    choice = choose_device(device)
    target = choice.device
    c_kernels, missing = resolve_c_kernels(wanted, target)
    cpu_bf16 = _cpu_bf16(bf16_wanted, c_kernels, target)
    torch_dtype, dtype_why = resolve_dtype(dtype, target, *cpu_bf16)
    packed = prepack and can_prepack(target, torch_dtype)
    few_rows = packed and c_kernels and torch_dtype in KERNEL_DTYPES
    exact_head = few_rows and torch_dtype == torch.float32  # the screen serves fp32 heads
    return ExecutionConfig(
        device=target,
        dtype=torch_dtype,
        attention=choose_attention(attention, target, c_kernels).name,
        c_kernels=c_kernels,
        prepack=packed,
        linear_rows=rows if few_rows else 0,
        greedy_screen=exact_head and screen,
        kernel_cache=kernel_cache_dir(env),
        c_kernels_missing=missing,
        device_why=choice.why,
        dtype_why=dtype_why,
        openmp_waits=openmp_waits(),
    )


def resolve_dtype(
    dtype: str | torch.dtype,
    device: torch.device,
    cpu_bf16: str | None = None,
    why_not_bf16: str = NO_NATIVE_BF16,
) -> tuple[torch.dtype, str]:
    """`dtype` and why it is that one. "auto" is bf16 on a GPU, and on a CPU whose native
    bfloat16 instructions `cpu_bf16` names ("AVX512-BF16", "AMX-BF16") where the C kernels
    and oneDNN serve bf16: the faster path there (half the bytes a step reads, the matrix
    products at least as fast). Elsewhere fp32, which such CPUs multiply faster."""
    if isinstance(dtype, torch.dtype):
        return dtype, "as asked"
    if dtype == "auto":
        if device.type != "cpu":
            return torch.bfloat16, "auto: a GPU"
        if cpu_bf16 is not None:
            return torch.bfloat16, f"auto: the CPU has {cpu_bf16}"
        return torch.float32, f"auto: {why_not_bf16}"
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype], "as asked"
