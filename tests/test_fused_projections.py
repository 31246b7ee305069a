"""Fused q/k/v and gate/up projections against the separate linears they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from minserve.llm import LLM
from minserve.loader import load_model
from minserve.model.fused_projections import concat_linears
from minserve.sampling_params import SamplingParams


@pytest.mark.parametrize("bias", [False, True])
def test_concat_linears_outputs_the_parts_side_by_side(bias):
    torch.manual_seed(0)
    parts = [nn.Linear(32, n, bias=bias) for n in (48, 16, 16)]
    x = torch.randn(5, 32)
    fused = concat_linears(parts)
    with torch.inference_mode():
        expected = torch.cat([p(x) for p in parts], dim=-1)  # [5, 80]
        torch.testing.assert_close(fused(x), expected, rtol=1e-6, atol=1e-6)
    assert not fused.weight.requires_grad and (fused.bias is not None) == bias


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, q/k/v bias, q/k norm
def test_fused_model_generates_what_the_unfused_one_does(tiny_model, arch):
    path = tiny_model(arch)
    fused, plain = load_model(path, prepack=False), load_model(path, prepack=False, fuse=False)
    attn = fused.model.model.layers[0].self_attn
    assert attn.qkv_proj is not None and not hasattr(attn, "q_proj")
    assert plain.model.model.layers[0].self_attn.qkv_proj is None
    count = [sum(p.numel() for p in lm.model.parameters()) for lm in (fused, plain)]
    assert count[0] == count[1]  # the same weights, regrouped
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [[1, 5, 9, 200, 17, 3000], [7] * 30]
    runs = [LLM(lm).generate(prompts, params, use_tqdm=False) for lm in (fused, plain)]
    for got, expected in zip(*runs):
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, expected.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
