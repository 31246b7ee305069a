"""The Triton quantized matrix product (`minserve.platforms.cuda.triton_quant.py`), run in Triton's
interpreter (compiled on a CUDA machine), against the exact sums of the `gguf` package's
dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from minserve.attention.triton_env import interpreting
from minserve.platforms.cuda.triton_quant import quant_matmul

DEVICE = "cpu" if interpreting() else "cuda"  # interpreted on a CPU, compiled on a GPU
SHAPES = [(1, 37, 96), (19, 64, 64), (33, 5, 32)]  # rows of x, out features, in features
GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize(("rows", "out_features", "in_features"), SHAPES)
def test_the_kernel_sums_the_packages_dequantized_weights(
    quant: str, rows: int, out_features: int, in_features: int
) -> None:
    values = torch.randn(out_features, in_features, generator=GEN).numpy() * 0.05
    values[0, :32] = 2.5  # a block of equal values: Q4_1's scale is 0, its offset the value
    qtype = GGMLQuantizationType[quant]
    blocks = quantize(values, qtype)
    weights = torch.from_numpy(dequantize(blocks, qtype).reshape(values.shape).astype(np.float32))
    x = torch.randn(rows, in_features, generator=GEN)
    stored = torch.from_numpy(np.ascontiguousarray(blocks))
    got = quant_matmul(x.to(DEVICE), stored.to(DEVICE), quant).cpu()
    want = F.linear(x.double(), weights.double())
    bound = 1e-5 * (x.double().abs() @ weights.double().abs().T) + 1e-6
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= bound).all()


def test_blocks_that_do_not_hold_x_s_features_are_refused() -> None:
    blocks = torch.zeros((4, 34), dtype=torch.uint8)  # one Q8_0 block a row: 32 features
    with pytest.raises(ValueError, match="hold rows of 32 weights; x has 64 features"):
        quant_matmul(torch.zeros(2, 64, device=DEVICE), blocks.to(DEVICE), "Q8_0")
