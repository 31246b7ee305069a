"""Attention backends chosen by name in config: each is built per step as
`Backend(kv, metadata, scale=None)` and called per layer as an `AttentionFn`."""

from __future__ import annotations

from minserve.attention.paged_torch import TorchPagedAttention

ATTENTION_BACKENDS: dict[str, type] = {"torch": TorchPagedAttention}


def get_attention_backend(name: str) -> type:
    """The backend class registered under `name`."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[name]
