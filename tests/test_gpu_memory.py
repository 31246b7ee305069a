"""Sizing the KV pool from device memory (vLLM's gpu_memory_utilization rule).

The rule is plain arithmetic, checked with numbers; the profile that measures the largest
step's activations runs here on the CPU (the measuring itself needs a GPU).
"""

from __future__ import annotations

import logging

import pytest
import torch

from minserve import LLM
from minserve.config import CacheConfig
from minserve.worker.memory import GIB, kv_cache_budget, profile_forward


def test_the_pool_gets_what_the_utilization_leaves() -> None:
    # 80 GiB at 0.9 = 72 GiB; weights + activations 17 GiB; the CUDA context 1 GiB
    assert kv_cache_budget(80 * GIB, 0.9, 17 * GIB, 1 * GIB) == 54 * GIB


def test_no_room_left_is_an_error_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"allows 7\.20 GiB of 8\.00 GiB.*take 7\.50 GiB"):
        kv_cache_budget(8 * GIB, 0.9, int(7.5 * GIB), 0)


def test_the_utilization_is_a_share() -> None:
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            CacheConfig(gpu_memory_utilization=bad)


def test_the_profile_runs_the_largest_step(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), num_blocks=16)
    model = llm.loaded.model
    calls = []
    model.register_forward_hook(lambda _m, args, out: calls.append((args[0].shape, out.shape)))
    profile_forward(model, num_tokens=96, num_logits=8)
    ((input_shape, hidden_shape),) = calls
    assert input_shape == (96,) and hidden_shape[0] == 96


def test_a_capped_max_model_len_is_said(tiny_model, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="minserve"):
        llm = LLM(tiny_model("llama"), num_blocks=4, block_size=4)
    assert llm.max_model_len == 16
    said = [r.getMessage() for r in caplog.records]
    assert "KV pool: 4 blocks of 4 tokens = 16 tokens, 0.00 GiB, stored as float32" in said
    assert any(m.startswith("max_model_len 16: capped by the KV pool's size") for m in said)
    assert torch.device("cpu") == next(llm.loaded.model.parameters()).device


def test_the_profiles_attention_is_causal_gqa_attention() -> None:
    """The oracle: chapter 00's contiguous attention (scores in fp32, masked, softmaxed)."""
    from minserve.attention.contiguous import attend
    from minserve.worker.memory import profile_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(37, 6, 16, generator=g)  # [T, Hq, D]
    k, v = torch.randn(2, 37, 2, 16, generator=g)  # [T, Hkv, D] each: 3 query heads share one
    torch.testing.assert_close(profile_attention(0, q, k, v), attend(q, k, v, 0))


def test_the_profile_builds_no_tokens_by_tokens_matrix(tiny_model) -> None:
    """At 8k-16k tokens a T x T score matrix no longer fits a GPU: the profile must measure
    the step the engine runs (flash-style attention), not one that runs out of memory."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from minserve.loader import build_model
    from minserve.model.hf_loader import config_from_hf, weights_from_hf

    class LargestOutput(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    folder = tiny_model("llama")
    config = config_from_hf(folder)
    model = build_model(config, weights_from_hf(folder), torch.float32, torch.device("cpu"))
    num_tokens = 2048
    with LargestOutput() as largest:
        profile_forward(model, num_tokens=num_tokens, num_logits=8)
    assert 8 * config.vocab_size <= largest.numel < num_tokens * num_tokens  # logits are seen
