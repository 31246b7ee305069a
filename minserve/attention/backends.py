"""Attention backends, and the one function that chooses which serves an engine.

Each backend is built per step as `Backend(kv, metadata, scale=None)` and called per layer
as an `AttentionFn`; each declares what it serves (`BackendSupport`: devices, KV cache
formats, whether it reads an int8 cache through a `kv_codec`, whether it needs the C
library). `choose_attention` settles the backend once, at load, from what was asked, the
device and the KV format, and says what to change when the combination cannot run:

- "auto": Triton on a GPU; on a CPU the C backend where the C kernels run, else torch (the
  Triton interpreter is for correctness, not speed); torch wherever a `kv_codec` must be
  called (the only backend that calls it);
- a student's `attend` (chapter 00) runs once per sequence over its gathered K/V;
- a student's Triton `decode_kernels` (chapter 02) replace the Triton backend's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from minserve.attention.contiguous import Attend
from minserve.attention.paged_cpu import CpuPagedAttention
from minserve.attention.paged_torch import TorchPagedAttention
from minserve.attention.per_sequence import PerSequenceAttention
from minserve.attention.triton_backend import TritonPagedAttention
from minserve.attention.triton_decode import DecodeKernels
from minserve.config import KV_CACHE_DTYPES
from minserve.kernels.build import build_error


@dataclass(frozen=True)
class BackendSupport:
    """What an attention backend serves."""

    devices: tuple[str, ...]
    kv_cache_dtypes: tuple[str, ...] = KV_CACHE_DTYPES  # every format, 8-bit included
    kv_codec: bool = False  # reads an int8 cache through a kv_codec's functions
    c_library: bool = False  # needs the C kernels built


@dataclass(frozen=True)
class Backend:
    """A registered backend: its class and what it serves."""

    cls: type
    support: BackendSupport


ATTENTION_BACKENDS: dict[str, Backend] = {
    # the C kernels: int8 rows in C, fp8 converted in torch
    "cpu": Backend(CpuPagedAttention, BackendSupport(("cpu",), c_library=True)),
    # plain torch: the reference, and the one that calls a kv_codec
    "torch": Backend(TorchPagedAttention, BackendSupport(("cpu", "cuda"), kv_codec=True)),
    # Triton: compiled on a GPU, interpreted on a CPU (for checking)
    "triton": Backend(TritonPagedAttention, BackendSupport(("cpu", "cuda"))),
}
PER_SEQUENCE = BackendSupport(("cpu", "cuda"), kv_codec=True)  # a student's `attend`


@dataclass(frozen=True)
class AttentionChoice:
    """The backend an engine runs: its name (for the execution config) and its factory."""

    name: str
    backend: Any  # called as backend(kv, metadata) each step


def choose_attention(
    requested: str = "auto",
    device: torch.device | str = "cpu",
    c_kernels: bool = True,
    kv_cache_dtype: str = "auto",
    kv_codec: bool = False,
    decode_kernels: DecodeKernels | None = None,
    attend: Attend | None = None,
) -> AttentionChoice:
    """The attention backend for these facts (see the module docstring); ValueError naming
    what to change where they cannot go together."""
    device = torch.device(device)
    if decode_kernels is not None and attend is not None:
        raise ValueError("give decode_kernels (chapter 02) or attend (chapter 00), not both")
    if attend is not None:
        if requested != "auto":
            raise ValueError("give attention_backend or attend, not both")
        check_support("per-sequence", PER_SEQUENCE, device, kv_cache_dtype, kv_codec)
        return AttentionChoice("per-sequence", partial(PerSequenceAttention, attend=attend))
    if decode_kernels is not None and kv_codec:
        raise ValueError(
            "kv_codec runs the int8 KV cache through torch attention; decode_kernels are "
            "Triton kernels with their own int8 arithmetic: give one or the other"
        )
    name = default_backend(device, c_kernels, kv_codec) if requested == "auto" else requested
    backend = registered(name)
    check_support(name, backend.support, device, kv_cache_dtype, kv_codec)
    if decode_kernels is None:
        return AttentionChoice(name, backend.cls)
    if name != "triton":
        raise ValueError(
            f"decode_kernels are Triton kernels, but the attention backend is {name!r}; "
            "pass attention_backend='triton' as well"
        )
    return AttentionChoice(name, partial(TritonPagedAttention, decode_kernels=decode_kernels))


def default_backend(device: torch.device, c_kernels: bool, kv_codec: bool = False) -> str:
    """What "auto" means: torch for a codec, Triton on a GPU, C on a CPU where it runs."""
    if kv_codec:
        return "torch"
    if device.type == "cuda":
        return "triton"
    return "cpu" if c_kernels else "torch"


def registered(name: str) -> Backend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: auto, {', '.join(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[name]


def check_support(
    name: str, support: BackendSupport, device: torch.device, kv_cache_dtype: str, kv_codec: bool
) -> None:
    """Refuse, naming the alternative, what the backend `name` does not serve."""
    if device.type not in support.devices:
        raise ValueError(
            f"attention backend {name!r} runs on {', '.join(support.devices)}, not {device.type}"
        )
    if support.c_library and (why := build_error()) is not None:
        raise ValueError(f"attention backend {name!r} is unavailable: {why}; use 'torch'")
    if kv_cache_dtype not in support.kv_cache_dtypes:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not served by the {name!r} backend; it "
            f"reads {', '.join(support.kv_cache_dtypes)}"
        )
    if kv_codec and not support.kv_codec:
        raise ValueError(
            f"kv_codec runs on attention_backend='torch' (or 'auto'); the {name!r} "
            "backend's int8 kernels are minserve's own and would bypass the codec"
        )


def get_attention_backend(name: str, device: torch.device | str = "cpu") -> type:
    """The backend class `choose_attention` picks for `name` on `device` (no plug-ins)."""
    return choose_attention(name, device, build_error() is None).backend


def resolve_c_kernels(wanted: bool, device: torch.device) -> tuple[bool, str | None]:
    """Whether the C kernels run (on a CPU, switched on, the library built), and why not
    when they were wanted but cannot build. A GPU never builds them."""
    if not wanted or device.type != "cpu":
        return False, None
    missing = build_error()
    return missing is None, missing
