"""Attention backends chosen by name in config: each is built per step as
`Backend(kv, metadata, scale=None)` and called per layer as an `AttentionFn`.

"auto" picks the C kernels on a CPU (plain torch where they cannot be built or are
switched off; the Triton interpreter is for correctness, not speed) and the Triton kernels
on a GPU: the execution config resolves it (`minserve/execution.py`)."""

from __future__ import annotations

import torch

from minserve.attention.paged_cpu import CpuPagedAttention
from minserve.attention.paged_torch import TorchPagedAttention
from minserve.attention.triton_backend import TritonPagedAttention
from minserve.execution import resolve_attention, resolve_c_kernels
from minserve.kernels.build import build_error

ATTENTION_BACKENDS: dict[str, type] = {
    "cpu": CpuPagedAttention,
    "torch": TorchPagedAttention,
    "triton": TritonPagedAttention,
}


def get_attention_backend(name: str, device: torch.device | str = "cpu") -> type:
    """The backend class registered under `name` ("auto": the best one for `device`)."""
    if name == "auto":
        name = auto_backend(torch.device(device))
    if name == "cpu" and (why := build_error()) is not None:
        raise ValueError(f"attention backend 'cpu' is unavailable: {why}; use 'torch'")
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: auto, {', '.join(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[name]


def auto_backend(device: torch.device) -> str:
    """What "auto" means on `device` with the C kernels switched on where they build."""
    return resolve_attention("auto", device, resolve_c_kernels(True, device)[0])
