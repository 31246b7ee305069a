"""The bfloat16 panel kernel (`kernels/bf16_panels.c`) against the same products summed
exactly (fp64): every row remainder of its tiles (8 rows at a time, then 7 .. 1), one and
several panel pairs, inputs from 2 to 1536 features, with and without a bias; the packed
layout itself; and a bfloat16 model's log-probabilities along one greedy path with its
linears on the kernel and on torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from teacher_forced import assert_paths_agree

from minserve.kernels import cpu_ops
from minserve.kernels.build import cpu_kernels
from minserve.llm import LLM
from minserve.platforms.cpu.packed_linear import PackedLinear

NATIVE = cpu_kernels() is not None and cpu_kernels().bf16_panels_native() == 1
pytestmark = pytest.mark.skipif(
    not NATIVE, reason="the panel kernel needs a CPU with AVX512-BF16 (the C kernels use none)"
)
GEN = torch.Generator().manual_seed(0)


def bf16_randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=GEN) * scale).bfloat16()


def assert_within_one_rounding(got: torch.Tensor, x, weight, bias) -> None:
    """fp32 sums of exact products, then one rounding to bfloat16 (8 significant bits)."""
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    scale = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        scale = scale + bias.double().abs()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.double() - want).abs() <= 2**-8 * scale + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 23, 64])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(32, 2), (96, 38), (64, 576), (576, 1536)]
)
def test_panels_give_the_fp32_sums_of_the_products(rows, out_features, in_features) -> None:
    x, weight = bf16_randn(rows, in_features), bf16_randn(out_features, in_features, scale=0.05)
    got = cpu_ops.linear_panels(x, cpu_ops.pack_panels(weight), None)
    assert_within_one_rounding(got, x, weight, None)


@pytest.mark.parametrize("rows", [1, 11])
def test_the_bias_is_added_to_every_row(rows: int) -> None:
    x, weight = bf16_randn(rows, 64), bf16_randn(64, 64, scale=0.05)
    bias = bf16_randn(64, scale=4.0)  # larger than the sums: a bias left out shows
    got = cpu_ops.linear_panels(x, cpu_ops.pack_panels(weight), bias)
    assert_within_one_rounding(got, x, weight, bias)


def test_the_packed_layout_puts_a_panels_pairs_side_by_side() -> None:
    weight = torch.arange(64 * 6).view(64, 6).remainder(200).bfloat16()
    packed = cpu_ops.pack_panels(weight)  # [4, 3, 16, 2]
    assert packed.shape == (4, 3, 16, 2)
    for column in (0, 17, 63):
        for pair in range(3):
            panel, lane = divmod(column, 16)
            assert (
                packed[panel, pair].tolist()[lane]
                == weight[column, 2 * pair : 2 * pair + 2].tolist()
            )


def test_only_bfloat16_weights_of_whole_panel_pairs_are_packed() -> None:
    assert cpu_ops.panels_apply(bf16_randn(64, 576))
    assert not cpu_ops.panels_apply(bf16_randn(48, 576))  # 48 columns: one and a half pairs
    assert not cpu_ops.panels_apply(bf16_randn(64, 7))  # an odd number of inputs
    assert not cpu_ops.panels_apply(torch.randn(64, 576))  # fp32 keeps oneDNN


def test_rows_of_the_wrong_width_are_refused() -> None:
    packed = cpu_ops.pack_panels(bf16_randn(32, 8))
    with pytest.raises(ValueError, match="bfloat16 rows of 8 features"):
        cpu_ops.linear_panels(bf16_randn(2, 10), packed, None)


def test_a_bfloat16_model_scores_one_greedy_path_alike_on_panels_and_on_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Teacher-forced along the panel model's greedy paths, its decode steps and its
    prefill give every token's log-probability within bfloat16's rounding of torch's
    (`teacher_forced.py` states the tolerance); the tokens themselves may part at a near
    tie, as any two kernels' may (they did at token 18 on an AMX Xeon)."""
    panels = LLM(dtype="bfloat16", max_num_seqs=6)
    linears = [m for m in panels.loaded.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.panels for m in linears)
    assert "prepack=on(panels)" in panels.get_execution_config().summary()
    monkeypatch.setenv("MINSERVE_C_KERNELS", "0")  # F.linear (oneDNN) and torch everywhere
    torch_llm = LLM(dtype="bfloat16", max_num_seqs=6)
    assert "panels" not in torch_llm.get_execution_config().summary()
    assert_paths_agree(panels, torch_llm, max_tokens=24)
