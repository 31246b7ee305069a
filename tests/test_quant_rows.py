"""The quantized few-row kernel (`kernels/quant_rows.c`) against the `gguf` package's own
dequantization: Q8_0, Q4_0 and Q4_1 blocks, random and from the bundled model, every
remainder of the rows of x it handles (groups of four, then 3, 2, 1); and its int8 rows
(weight-only int8, a scale per output channel) against the exact sums of the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from minserve.kernels import cpu_ops
from minserve.kernels.build import cpu_kernels
from minserve.model.default_model import default_model_path
from minserve.model.gguf_loader import open_gguf
from minserve.model.int8_linear import dequantize_int8, quantize_int8

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C kernels could not be built")
GEN = torch.Generator().manual_seed(0)
QUANTS = ("Q8_0", "Q4_0", "Q4_1")


def quantized(values: np.ndarray, quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """values fp32 [out, in] -> (blocks uint8 [out, row bytes], their dequantized fp32)."""
    qtype = GGMLQuantizationType[quant]
    blocks = quantize(values, qtype)
    exact = dequantize(blocks, qtype).reshape(values.shape).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(exact)


def assert_dequantized_sums(x: torch.Tensor, blocks: torch.Tensor, weights: torch.Tensor,
                            quant: str) -> None:  # fmt: skip
    got = cpu_ops.quant_rows(x, blocks, quant)
    want = F.linear(x.double(), weights.double())  # the exact sums of the same weights
    scale = x.double().abs() @ weights.double().abs().T  # what fp32 rounding is relative to
    assert got.shape == want.shape and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= 1e-5 * scale + 1e-6).all(), quant


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 12])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 576), (5, 32), (130, 96)])
def test_the_kernel_sums_the_packages_dequantized_weights(
    quant: str, rows: int, out_features: int, in_features: int
) -> None:
    values = torch.randn(out_features, in_features, generator=GEN).numpy() * 0.05
    blocks, weights = quantized(values, quant)
    x = torch.randn(rows, in_features, generator=GEN)
    assert_dequantized_sums(x, blocks, weights, quant)


def test_offsets_negative_scales_and_tiny_halves_are_read_as_the_package_reads_them() -> None:
    # Q4_1's offset is the block's minimum; a block of equal values has scale 0; values of
    # 1e-6 give subnormal fp16 scales
    values = np.stack([np.full(64, 3.0), np.linspace(-1e-6, 1e-6, 64), np.linspace(5, 9, 64)])
    x = torch.randn(3, 64, generator=GEN)
    for quant in QUANTS:
        blocks, weights = quantized(values.astype(np.float32), quant)
        assert_dequantized_sums(x, blocks, weights, quant)


def test_the_bundled_models_own_blocks() -> None:
    reader = open_gguf(default_model_path())
    tensors = {t.name: t for t in reader.tensors}
    x = torch.randn(5, 576, generator=GEN)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "token_embd.weight"):
        tensor = tensors[name]
        quant = GGMLQuantizationType(tensor.tensor_type).name
        blocks = torch.from_numpy(np.array(tensor.data))  # [out, row bytes] as stored
        weights = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
        weights = torch.from_numpy(weights.reshape(blocks.shape[0], -1).astype(np.float32))
        assert_dequantized_sums(x, blocks, weights, quant)


def test_a_mismatched_width_is_refused_with_both_numbers() -> None:
    blocks, _ = quantized(np.zeros((4, 64), dtype=np.float32), "Q4_1")
    with pytest.raises(ValueError, match="rows of 64 weights; x has 96 features"):
        cpu_ops.quant_rows(torch.zeros(1, 96), blocks, "Q4_1")


@pytest.mark.parametrize("quant", QUANTS)
def test_the_c_dequantization_is_the_packages_bit_for_bit(quant: str) -> None:
    values = torch.randn(9, 96, generator=GEN).numpy()
    values[0] = 1.5  # a block of equal values
    blocks, weights = quantized(values, quant)
    assert torch.equal(cpu_ops.dequantize_blocks(blocks, quant), weights)
    # a bfloat16 prefill's weights: the same, rounded to nearest (ties to even) as torch does
    widened = cpu_ops.dequantize_blocks(blocks, quant, torch.bfloat16)
    assert torch.equal(widened, weights.to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 576), (5, 32), (130, 96)])
def test_the_int8_kernel_sums_each_channels_integers_times_its_scale(
    rows: int, out_features: int, in_features: int
) -> None:
    values = torch.randn(out_features, in_features, generator=GEN) * 0.05
    values[0] = 0.0  # an all-zero channel: scale 0, outputs 0
    qweight, scales = quantize_int8(values)
    x = torch.randn(rows, in_features, generator=GEN)
    got = cpu_ops.int8_rows(x, qweight, scales)
    weights = dequantize_int8(qweight, scales)
    want = F.linear(x.double(), weights.double())
    bound = 1e-5 * (x.double().abs() @ weights.double().abs().T) + 1e-6
    assert got.dtype == torch.float32 and ((got.double() - want).abs() <= bound).all()
    assert torch.equal(got[:, 0], torch.zeros(rows))


def test_int8_quantization_rounds_each_weight_to_half_a_step_of_its_channel() -> None:
    values = torch.randn(40, 96, generator=GEN) * torch.logspace(-6, 2, 40)[:, None]
    values[3] = 0.0
    qweight, scales = quantize_int8(values)
    assert qweight.dtype == torch.int8 and int(qweight.abs().max()) == 127
    assert torch.equal(qweight.abs().amax(dim=1)[torch.arange(40) != 3], torch.full((39,), 127))
    error = (values - dequantize_int8(qweight, scales)).abs()
    assert (error <= scales[:, None] * 0.5 * (1 + 1e-5)).all()
    assert torch.equal(dequantize_int8(qweight, scales)[3], torch.zeros(96))


@pytest.mark.parametrize("rows", [1, 3, 4, 6])
@pytest.mark.parametrize("kind", [*QUANTS, "int8"])
def test_bfloat16_rows_and_a_bias_give_the_dequantized_sums_rounded_once(
    rows: int, kind: str
) -> None:
    """A bfloat16 model's rows go in as they are and come out bfloat16: the sums of the
    dequantized weights (fp32, in some order; 4-bit blocks meet x in bfloat16 pairs where
    the CPU has AVX512-BF16), plus the bias, rounded once."""
    values = torch.randn(70, 96, generator=GEN) * 0.05
    bias = torch.randn(70, generator=GEN)
    x = torch.randn(rows, 96, generator=GEN).bfloat16()
    if kind == "int8":
        qweight, scales = quantize_int8(values)
        weights = dequantize_int8(qweight, scales)
        got = cpu_ops.int8_rows(x, qweight, scales, bias)
    else:
        blocks, weights = quantized(values.numpy(), kind)
        got = cpu_ops.quant_rows(x, blocks, kind, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 70)
    exact = F.linear(x.double(), weights.double(), bias.double())  # [rows, 70]
    order = 1e-5 * (x.double().abs() @ weights.double().abs().T + bias.double().abs())
    assert ((got.double() - exact).abs() <= 2**-8 * exact.abs() + order).all()


def test_the_bias_is_added_in_fp32_before_the_one_rounding() -> None:
    blocks, _ = quantized(torch.randn(70, 96, generator=GEN).numpy() * 0.05, "Q4_1")
    x, bias = torch.randn(3, 96, generator=GEN), torch.randn(70, generator=GEN)
    plain = cpu_ops.quant_rows(x, blocks, "Q4_1")  # [3, 70] fp32
    assert torch.equal(cpu_ops.quant_rows(x, blocks, "Q4_1", bias), plain + bias)


PANELS = cpu_kernels() is not None and cpu_ops.panels_native()


@pytest.mark.skipif(not PANELS, reason="the panel kernel needs a CPU with AVX512-BF16")
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("rows", [1, 9, 40])
@pytest.mark.parametrize(("out_features", "in_features"), [(32, 32), (96, 576)])
def test_many_bfloat16_rows_meet_the_weights_widened_panel_by_panel(
    quant: str, rows: int, out_features: int, in_features: int
) -> None:
    """A bfloat16 model's many rows: the blocks widened to bfloat16 a pair of panels at a
    time, in cache, then the panel kernel: bit for bit the panel kernel on the whole
    weight widened first (`dequantize_blocks`) and packed, and within one rounding of the
    exact sums of those weights."""
    values = torch.randn(out_features, in_features, generator=GEN).numpy() * 0.05
    blocks, _ = quantized(values, quant)
    bias = torch.randn(out_features, generator=GEN).bfloat16()
    x = torch.randn(rows, in_features, generator=GEN).bfloat16()
    got = cpu_ops.quant_panels(x, blocks, quant, bias)
    widened = cpu_ops.dequantize_blocks(blocks, quant, torch.bfloat16)  # [out, in]
    assert torch.equal(got, cpu_ops.linear_panels(x, cpu_ops.pack_panels(widened), bias))
    exact = F.linear(x.double(), widened.double(), bias.double())
    scale = x.double().abs() @ widened.double().abs().T + bias.double().abs()
    assert ((got.double() - exact).abs() <= 2**-8 * scale + 1e-6).all()
