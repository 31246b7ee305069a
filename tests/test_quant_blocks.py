"""GGUF's block formats both ways (`model/quant_blocks.py`) against the `gguf` package, the
dequantizing matmul against the widened product, and `LLM(quant_codec=...)`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from minserve.llm import LLM
from minserve.model.quant_blocks import CODEC, dequantize, dequantize_matmul, quantize
from minserve.model.quantized_linear import QUANTS
from minserve.plugins import CoursePlugins
from minserve.sampling_params import SamplingParams


def rows() -> torch.Tensor:
    """Random rows of 4 blocks, with an all-zero block, a constant one and exact halves."""
    values = torch.from_numpy(np.random.default_rng(1).normal(size=(5, 128)).astype(np.float32))
    values[0, :32] = 0.0
    values[1, 32:64] = 2.5
    values[2, 64:96] = torch.arange(32) - 15.5
    return values


@pytest.mark.parametrize("quant", QUANTS)
def test_quantize_is_the_gguf_packages_byte_for_byte(quant: str) -> None:
    want = gguf_quantize(rows().numpy(), GGMLQuantizationType[quant])
    assert np.array_equal(quantize(rows(), quant).numpy(), want)


@pytest.mark.parametrize("quant", QUANTS)
def test_dequantize_matmul_is_the_widened_product(quant: str) -> None:
    blocks = quantize(rows(), quant)  # [5, 4 blocks]
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    want = x @ dequantize(blocks, quant).T  # [3, 5]
    got = dequantize_matmul(x, blocks, quant, dequantize, step=3)  # slices of 3 and 1 blocks
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_unknown_format_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no Q5_K blocks here"):
        CODEC.dequantize(torch.zeros(1, 34, dtype=torch.uint8), "Q5_K")


def test_a_codec_serves_the_tokens_of_the_c_kernel() -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4)
    kernel = LLM(quantization="gguf")
    want = kernel.generate("The capital of France is", greedy, use_tqdm=False)[0].outputs[0]
    codec = LLM(
        kernel.loaded, plugins=CoursePlugins(quant_codec=CODEC)
    )  # the same blocks, through quant_blocks.py
    got = codec.generate("The capital of France is", greedy, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids


def test_quant_codec_needs_quantized_layers(tiny_model) -> None:
    with pytest.raises(ValueError, match="quant_codec widens GGUF blocks; load a .gguf model"):
        LLM(tiny_model("llama"), plugins=CoursePlugins(quant_codec=CODEC))
