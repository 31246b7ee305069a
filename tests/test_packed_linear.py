"""Prepacked oneDNN linears against `F.linear`, and the loader's use of them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minserve.kernels.onednn import can_prepack
from minserve.llm import LLM
from minserve.loader import load_model
from minserve.platforms.cpu.packed_linear import PackedLinear, padded_rows, prepack_linears
from minserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)

TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}  # (rtol, atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 61, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, rows, bias):
    if not can_prepack(torch.device("cpu"), dtype):
        pytest.skip(
            f"this CPU has no oneDNN {dtype} path (needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)"
        )
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    with torch.inference_mode():
        expected = F.linear(x, linear.weight, linear.bias)
        got = PackedLinear(linear)(x)
    rtol, atol = TOLERANCE[dtype]
    assert got.dtype == dtype and got.shape == (rows, 200)
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


def test_packed_linear_keeps_leading_dims_and_the_weight():
    linear = nn.Linear(16, 24)
    packed = PackedLinear(linear)
    x = torch.randn(2, 5, 16)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=2e-5, atol=1e-5)
    assert packed.weight is linear.weight and "packed" not in packed.state_dict()


def test_prepack_replaces_every_linear_and_keeps_tied_weights():
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    assert prepack_linears(net) == 2
    assert isinstance(net[0], PackedLinear) and isinstance(net[2][0], PackedLinear)
    assert prepack_linears(net) == 0  # already packed


def test_loader_packs_on_cpu_and_output_is_unchanged(tiny_model):
    path = tiny_model("llama")
    packed, plain = load_model(path), load_model(path, prepack=False)
    assert can_prepack(torch.device("cpu"), torch.float32)
    assert isinstance(packed.model.lm_head, PackedLinear)
    assert packed.model.lm_head.weight is packed.model.model.embed_tokens.weight  # still tied
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [[1, 5, 9, 200, 17, 3000], [7] * 40]
    runs = [LLM(lm).generate(prompts, params, use_tqdm=False) for lm in (packed, plain)]
    for got, expected in zip(*runs):
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, expected.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_can_prepack_agrees_with_onednn_on_this_cpu():
    """bf16 is packable exactly where oneDNN's reorder accepts it; elsewhere it would raise."""
    weight = torch.randn(24, 16, dtype=torch.bfloat16)
    try:
        torch.ops.mkldnn._reorder_linear_weight(weight, None)
        reorder_works = True
    except RuntimeError:
        reorder_works = False
    assert can_prepack(torch.device("cpu"), torch.bfloat16) == reorder_works
    assert can_prepack(torch.device("cpu"), torch.float32)
    assert not can_prepack(torch.device("cpu"), torch.float16)
    assert not can_prepack(torch.device("meta"), torch.float32)


def test_loader_in_bf16_packs_only_where_the_cpu_can(tiny_model):
    loaded = load_model(tiny_model("llama"), dtype="bfloat16")
    packed = isinstance(loaded.model.lm_head, PackedLinear)
    assert packed == can_prepack(torch.device("cpu"), torch.bfloat16)
    out = LLM(loaded).generate(
        [[1, 5, 9]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4


def test_row_counts_are_padded_to_few_shapes_by_at_most_a_sixteenth():
    sizes = [padded_rows(n) for n in range(1, 8193)]
    assert sizes[:32] == list(range(1, 33))  # decode batches: exact
    assert all(n <= p < n * (1 + 1 / 16) for n, p in zip(range(1, 8193), sizes))
    assert len(set(sizes)) <= 32 + 16 * 8  # 16 per doubling from 32 to 8192
    assert padded_rows(129) == 136 and padded_rows(1000) == 1024


def test_padded_rows_do_not_change_the_real_rows():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    packed = PackedLinear(linear)
    x = torch.randn(129, 64)  # padded to 136 inside
    with torch.inference_mode():
        out = packed(x)
        torch.testing.assert_close(
            out, F.linear(x, linear.weight, linear.bias), rtol=2e-5, atol=1e-5
        )
        torch.testing.assert_close(out[:100], packed(x[:100]), rtol=2e-5, atol=1e-5)
    assert out.shape == (129, 48) and out.is_contiguous()


@pytest.mark.parametrize("rows", [1, 40, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_widened_bfloat16_linear_is_the_fp32_product_of_its_bfloat16_values(rows, bias):
    """Without a native bfloat16 product the layer widens its bfloat16 weight for each call:
    exactly the fp32 product of the same values, rounded once; within bfloat16's rounding
    of torch's own bfloat16 product; its memory stays the bfloat16 weight."""
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    layer = PackedLinear(linear, widen=True)
    assert layer.widen and layer.packed is None and layer.packed_as == "widen"
    with torch.inference_mode():
        got = layer(x)
        exact = F.linear(x.float(), linear.weight.float())
        if bias:
            exact = exact + linear.bias.float()
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, exact.to(torch.bfloat16), rtol=0, atol=0)
        rtol, atol = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(
            got, F.linear(x, linear.weight, linear.bias), rtol=rtol, atol=atol
        )


def test_widen_leaves_fp32_weights_to_onednn_and_keeps_the_few_row_kernel():
    fp32 = PackedLinear(nn.Linear(64, 64), widen=True)
    assert not fp32.widen and fp32.packed_as == "oneDNN"
    bf16 = PackedLinear(nn.Linear(64, 64).to(torch.bfloat16), widen=True)
    bf16.use_rows_kernel(8)
    assert bf16.kernel(8).kind == "rows" and bf16.kernel(9).kind == "widen"
    bf16.use_rows_kernel(0)
    assert bf16.kernel(1).kind == "widen"  # many rows' kernel kept for every count


def test_a_large_widened_weight_is_widened_a_tile_at_a_time_with_the_same_product(monkeypatch):
    from minserve.kernels import linear_kernels

    torch.manual_seed(0)
    linear = nn.Linear(64, 1000, bias=True).to(torch.bfloat16)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    layer = PackedLinear(linear, widen=True)
    with torch.inference_mode():
        whole = layer(x)
        monkeypatch.setattr(linear_kernels, "WIDEN_TILE_BYTES", 256 * 4 * 64)  # 4 tiles
        tiled = layer(x)
    torch.testing.assert_close(tiled, whole, rtol=8e-3, atol=1e-5)  # one bf16 ulp at most
