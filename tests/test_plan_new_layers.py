"""A model quantized in place after its load gets its platform's kernels when an engine is
built on it (chapter 10 quantizes the loaded fp32 model to Q8_0 blocks, then serves it)."""

from __future__ import annotations

import pytest
import torch

from minserve import LLM
from minserve.kernels.linear_kernels import NO_KERNELS
from minserve.loader import load_model
from minserve.model.quant_blocks import quantize_q8_0
from minserve.model.quantize_model import quantize_weights
from minserve.model.quantized_linear import QuantizedLinear

pytestmark = pytest.mark.slow


def test_layers_quantized_after_the_load_run_the_platforms_kernels() -> None:
    plain = load_model(dtype="float32", prepack=False)
    quantize_weights(plain.model, "Q8_0", quantize_q8_0)
    layers = [m for m in plain.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.plan is NO_KERNELS for m in layers)  # made after the load
    LLM(model=plain, num_blocks=16)
    if not plain.execution.c_kernels:  # the plain platform has no kernels to give
        assert all(m.plan is NO_KERNELS for m in layers)
        return
    assert all(m.kernel(1) is not None for m in layers)
    layer = layers[0]
    x = torch.randn(3, layer.in_features)
    reference = torch.nn.functional.linear(x, layer.widened())  # the blocks widened in torch
    torch.testing.assert_close(layer(x), reference, rtol=1e-4, atol=1e-4)
