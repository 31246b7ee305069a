"""Attention backends chosen by name in config: each is built per step as
`Backend(kv, metadata, scale=None)` and called per layer as an `AttentionFn`.

"auto" picks the C kernels on a CPU (plain torch where they cannot be built or are
switched off; the Triton interpreter is for correctness, not speed) and the Triton kernels
on a GPU (`resolve_attention`; the execution config, `minserve/execution.py`, records
what was resolved)."""

from __future__ import annotations

from functools import partial

import torch

from minserve.attention.paged_cpu import CpuPagedAttention
from minserve.attention.paged_torch import TorchPagedAttention
from minserve.attention.triton_backend import TritonPagedAttention
from minserve.attention.triton_decode import DecodeKernels
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


def resolve_c_kernels(wanted: bool, device: torch.device) -> tuple[bool, str | None]:
    """Whether the C kernels run (on a CPU, switched on, the library built), and why not
    when they were wanted but cannot build. A GPU never builds them."""
    if not wanted or device.type != "cpu":
        return False, None
    missing = build_error()
    return missing is None, missing


def resolve_attention(name: str, device: torch.device, c_kernels: bool) -> str:
    """ "auto": Triton on a GPU; on a CPU the C backend where the C kernels run, else torch.
    Other names pass through (`get_attention_backend` checks them)."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "triton"
    return "cpu" if c_kernels else "torch"


def with_decode_kernels(name: str, kernels: DecodeKernels) -> partial:
    """The Triton backend launching `kernels` (chapter 02's exercises) at every decode step;
    `name` is the backend the engine resolved, which must be "triton"."""
    if name != "triton":
        raise ValueError(
            f"decode_kernels are Triton kernels, but the attention backend is {name!r}; "
            "pass attention_backend='triton' as well"
        )
    return partial(TritonPagedAttention, decode_kernels=kernels)
