"""Attention backends chosen by name in config: each is built per step as
`Backend(kv, metadata, scale=None)` and called per layer as an `AttentionFn`.

"auto" picks plain torch on a CPU (the Triton interpreter is for correctness, not speed)
and the Triton kernels on a GPU."""

from __future__ import annotations

import torch

from minserve.attention.paged_torch import TorchPagedAttention
from minserve.attention.triton_backend import TritonPagedAttention

ATTENTION_BACKENDS: dict[str, type] = {
    "torch": TorchPagedAttention,
    "triton": TritonPagedAttention,
}


def get_attention_backend(name: str, device: torch.device | str = "cpu") -> type:
    """The backend class registered under `name` ("auto": the best one for `device`)."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: auto, {', '.join(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[name]
