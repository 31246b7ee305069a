"""Which device runs the engine, and why.

"auto" takes the GPU when torch can use one, else the CPU, and says which reason decided
it. An explicit "cuda" (or "cuda:N") that cannot be used is an error naming the reason: a
torch build without CUDA, no device visible (no driver, a driver too old for this torch's
CUDA, or `CUDA_VISIBLE_DEVICES` hiding them), or an index past the last device.

`native_bf16` names the CPU instructions that multiply bfloat16 natively (AVX512-BF16, AMX),
which decide whether "auto" serves bfloat16 on a CPU (`minserve/execution.py`).

Each process drives one GPU: `use_device` makes it the current CUDA device, so kernels
that launch on "the current device" (Triton, cuBLAS handles) run where the tensors are.
Tensor-parallel ranks get one GPU each (`rank_device`); more ranks than GPUs on a node is
an error, since NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

BF16_FLAGS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}  # /proc/cpuinfo -> name


@dataclass(frozen=True)
class DeviceChoice:
    """The device the engine runs on, and why it is that one (for the start-up line)."""

    device: torch.device
    why: str


def cuda_unusable_reason() -> str | None:
    """Why torch cannot run on a GPU here, or None when it can."""
    if torch.version.cuda is None:
        return "this torch build has no CUDA support"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return (
            f"no CUDA device is usable: no GPU, no driver, a driver too old for this "
            f"torch's CUDA {torch.version.cuda}, or CUDA_VISIBLE_DEVICES hides them"
        )
    return None


def choose_device(device: str | torch.device = "auto") -> DeviceChoice:
    """`device` resolved: "auto" is the GPU when one is usable, else the CPU. A GPU always
    carries its index (`torch.cuda.set_device` refuses a bare "cuda"): "auto" and "cuda"
    take this thread's current GPU, GPU 0 unless the process chose another (a P/D
    instance on its own GPU)."""
    unusable = cuda_unusable_reason()
    if device == "auto":
        if unusable is None:
            gpu = torch.device("cuda", torch.cuda.current_device())
            return DeviceChoice(gpu, f"auto: {_describe_gpu(gpu.index)}")
        return DeviceChoice(torch.device("cpu"), f"auto: {unusable}")
    target = torch.device(device)
    if target.type != "cuda":
        return DeviceChoice(target, "as asked")
    if unusable is not None:
        raise ValueError(f"device={str(device)!r} cannot be used: {unusable}")
    index = torch.cuda.current_device() if target.index is None else target.index
    check_gpu_index(index, f"device={str(device)!r}")
    return DeviceChoice(torch.device("cuda", index), f"as asked: {_describe_gpu(index)}")


def rank_device(device: str, rank: int, local_rank: int | None = None) -> torch.device:
    """The device of tensor-parallel rank `rank`: the CPU, or its own GPU on its node
    (GPU `local_rank`, which torchrun sets; else `rank`, all ranks on one node)."""
    target = choose_device(device).device
    if target.type != "cuda":
        return target
    index = rank if local_rank is None else local_rank
    check_gpu_index(index, f"tensor-parallel rank {rank}")
    return torch.device("cuda", index)


def check_gpu_index(index: int, who: str) -> None:
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(
            f"{who} needs GPU {index}, but this machine has {count} CUDA device(s) "
            f"(one GPU per process: use at most {count} ranks per node)"
        )


def use_device(device: torch.device) -> None:
    """Make `device` the current CUDA device of this process (nothing to do on a CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _describe_gpu(index: int) -> str:
    return f"GPU {index} of {torch.cuda.device_count()} ({torch.cuda.get_device_name(index)})"


def native_bf16(flags: str | None = None) -> str | None:
    """The CPU's native bfloat16 instructions ("AMX-BF16" or "AVX512-BF16"), None where it
    has neither or they cannot be read; `flags` is /proc/cpuinfo's flags line unless given."""
    words = set((_cpu_flags() if flags is None else flags).split())
    return next((name for flag, name in BF16_FLAGS.items() if flag in words), None)


def _cpu_flags() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: unknown, so no claim
        return ""
    return next((line for line in lines if line.startswith("flags")), "")
