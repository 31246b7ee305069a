"""The few-row linear kernel (`kernels/linear_rows.c`) against the same products summed
exactly (fp64), over every remainder it handles: rows of x in groups of four and the 3, 2,
1 left, weight rows in blocks of four and the rest, inputs with no whole 16-float vector at
the end; with and without a bias; bfloat16 weights (read as their bits, summed in fp32)
against the same sums; then a model with it on and off: fp32's greedy tokens, and bfloat16's
log-probabilities along one greedy path."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from teacher_forced import PROMPTS, assert_paths_agree

from minserve.kernels import cpu_ops
from minserve.kernels.build import cpu_kernels
from minserve.llm import LLM
from minserve.platforms.cpu.packed_linear import PackedLinear
from minserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C kernels could not be built")
GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=GEN)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 12, 17])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 576), (67, 37), (3, 16), (5, 1)])
def test_kernel_equals_the_exact_sums(rows: int, out_features: int, in_features: int) -> None:
    x, weight = randn(rows, in_features), randn(out_features, in_features) * 0.05
    got = cpu_ops.linear_rows(x, weight, None)
    want = F.linear(x.double(), weight.double())
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 6])
def test_bias_is_added_to_every_row(rows: int) -> None:
    x, weight, bias = randn(rows, 96), randn(130, 96) * 0.05, randn(130)
    got = cpu_ops.linear_rows(x, weight, bias)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_strided_rows_are_read_as_their_values() -> None:
    x = randn(4, 128)[:, ::2]  # every other column: not contiguous
    weight = randn(20, 64) * 0.05
    torch.testing.assert_close(
        cpu_ops.linear_rows(x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-5
    )


def test_the_sums_differ_from_f_linear_only_by_rounding_on_real_weights() -> None:
    torch.manual_seed(0)
    layer = PackedLinear(torch.nn.Linear(576, 1536, bias=False))
    x = torch.randn(8, 576)
    got, want = cpu_ops.linear_rows(x, layer._weight, None), F.linear(x, layer.weight)
    scale = x.abs() @ layer.weight.abs().T  # |x| . |w|: what fp32 rounding is relative to
    assert ((got - want).abs() <= 1e-6 * scale + 1e-7).all()


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 576), (67, 37), (5, 1)])
def test_bfloat16_weights_give_the_fp32_sums_of_their_values(
    rows: int, out_features: int, in_features: int
) -> None:
    x = randn(rows, in_features).bfloat16()
    weight, bias = (randn(out_features, in_features) * 0.05).bfloat16(), randn(out_features)
    got = cpu_ops.linear_rows(x, weight, bias.bfloat16())
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    want = F.linear(x.double(), weight.double(), bias.bfloat16().double())  # exact sums
    # the fp32 sums, then one rounding to bfloat16 (8 significant bits): within 2**-8 relative
    scale = x.double().abs() @ weight.double().abs().T + bias.bfloat16().double().abs()
    assert ((got.double() - want).abs() <= 2**-8 * scale + 1e-6).all()


def test_bfloat16_agrees_with_torchs_bfloat16_linear_to_one_rounding() -> None:
    weight, x = (randn(1536, 576) * 0.05).bfloat16(), randn(4, 576).bfloat16()
    got, want = cpu_ops.linear_rows(x, weight, None).float(), F.linear(x, weight).float()
    ulp = 2.0 ** (torch.frexp(want.abs()).exponent - 8)  # one bf16 step at each value
    order = 1e-5 * (x.float().abs() @ weight.float().abs().T)  # fp32 sums in another order
    assert ((got - want).abs() <= ulp + order).all()


def test_a_bfloat16_model_scores_one_greedy_path_alike_on_the_kernel_and_on_onednn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The few-row kernel streams a bfloat16 model's weights (panels kept out, as on a CPU
    without AVX512-BF16). Teacher-forced along its greedy path, every token's
    log-probability is oneDNN's within bfloat16's rounding (`teacher_forced.py`): the
    same products in another order, so the tokens may part at a near tie."""

    def load(kernel_rows: str) -> LLM:
        monkeypatch.setenv("MINSERVE_KERNEL_ROWS", kernel_rows)
        with mock.patch.object(cpu_ops, "panels_apply", lambda weight: False):
            return LLM(dtype="bfloat16", max_num_seqs=2)

    rows, onednn = load("16"), load("0")
    linears = [m for m in rows.loaded.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(cpu_ops.linear_applies(m._weight, m._weight) for m in linears)
    assert "linear_rows=16" in rows.get_execution_config().summary()
    assert "linear_rows=off" in onednn.get_execution_config().summary()
    assert_paths_agree(rows, onednn, max_tokens=16, prompts=PROMPTS[:1])


def test_greedy_tokens_are_the_same_with_the_kernel_on_and_off() -> None:
    llm = LLM(max_num_seqs=6)
    linears = [m for m in llm.loaded.model.modules() if isinstance(m, PackedLinear)]
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    saved = [m.plan for m in linears]

    def tokens(kernel_rows: int) -> list[list[int]]:
        for m in linears:
            m.use_rows_kernel(kernel_rows)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    try:
        assert tokens(16) == tokens(0)  # every decode step on the kernel, then on oneDNN
    finally:
        for m, plan in zip(linears, saved):
            m.plan = plan
