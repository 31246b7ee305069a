"""A GGUF-quantized linear layer in Triton: the blocks widened inside the matrix product.

out [M, N] = x [M, K] . dequantize(blocks)^T, where blocks is uint8 [N, K / 32 * block bytes]
as the file stores it (`quantized_linear.py` has the formats and the torch reference). One
program computes a [BLOCK_M, BLOCK_N] tile of out; each pass of its loop reads one 32-weight
GGUF block of each of its BLOCK_N weight rows, widens it to fp32 in registers (the fp16
scale from its two bytes, the integers from their bytes or nibbles, exactly the `gguf`
package's arithmetic) and adds its product with the matching 32 columns of x. Weights never
exist widened in memory: on a GPU the matrix product reads a quarter to a fifth of the fp32
bytes, as the C kernel does for a CPU's few rows. On a CPU it runs in Triton's interpreter
(for checking, like the attention kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minserve.attention import triton_env
from minserve.kernels.cpu_ops import QUANT_BLOCK_BYTES, check_blocks_hold

QUANT_IDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}
BLOCK_M, BLOCK_N = 16, 32  # a tile of out; tl.dot needs at least 16 on each side


@triton.jit
def _half_at(ptr, mask):
    """Two little-endian bytes at `ptr` (any shape) -> the fp16 they hold, as fp32 (0 where
    `mask` is off)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return ((hi << 8) | lo).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit(do_not_specialize=["M"])  # a step's row count: one variant for all
def quant_matmul_kernel(
    x_ptr,  # [M, K] fp32
    w_ptr,  # [N, row_bytes] uint8: each weight row's GGUF blocks
    out_ptr,  # [M, N] fp32
    M, N, K, row_bytes,
    QUANT: tl.constexpr,  # 0: Q8_0, 1: Q4_0, 2: Q4_1
    BYTES: tl.constexpr,  # bytes of one block: 34, 18, 20
    BM: tl.constexpr,
    BN: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)  # [BM] rows of x
    cols = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] weight rows = columns of out
    j = tl.arange(0, 32)  # [32] a block's weights
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for b in range(0, K // 32):
        x_at = x_ptr + rows[:, None] * K + b * 32 + j[None, :]  # [BM, 32]
        x = tl.load(x_at, mask=row_ok[:, None], other=0.0)
        block = w_ptr + cols.to(tl.int64) * row_bytes + b * BYTES  # [BN] each row's block
        d = _half_at(block, col_ok)  # [BN] the block's scale
        if QUANT == 0:  # Q8_0: 32 int8 after the scale
            q = tl.load(block[:, None] + 2 + j[None, :], mask=col_ok[:, None], other=0)
            w = q.to(tl.int8, bitcast=True).to(tl.float32) * d[:, None]  # [BN, 32]
        else:  # nibbles: byte i holds q_i low and q_(i+16) high
            first = 2 if QUANT == 1 else 4
            byte_at = block[:, None] + first + (j % 16)[None, :]  # [BN, 32]
            byte = tl.load(byte_at, mask=col_ok[:, None], other=0)
            q = tl.where(j[None, :] < 16, byte & 0x0F, byte >> 4).to(tl.float32)  # [BN, 32]
            if QUANT == 1:  # Q4_0: w = d (q - 8)
                w = (q - 8.0) * d[:, None]
            else:  # Q4_1: w = d q + m
                w = q * d[:, None] + _half_at(block + 2, col_ok)[:, None]
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)  # [BM, 32] x [32, BN]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=mask)


def quant_matmul(x: torch.Tensor, blocks: torch.Tensor, quant: str) -> torch.Tensor:
    """x [M, K] (any float dtype) . dequantize(blocks, quant)^T -> [M, N] fp32, in Triton."""
    out_features, in_features = check_blocks_hold(blocks, quant, x)
    row_bytes = blocks.shape[1]
    x = x.to(torch.float32).contiguous()
    blocks = blocks.contiguous()
    triton_env.check_kernel_device(x, blocks)
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(out_features, BLOCK_N))
    quant_matmul_kernel[grid](
        x, blocks, out, x.shape[0], out_features, in_features, row_bytes,
        QUANT=QUANT_IDS[quant], BYTES=QUANT_BLOCK_BYTES[quant], BM=BLOCK_M, BN=BLOCK_N,
        PRECISION=triton_env.dot_precision(torch.float32),
    )  # fmt: skip
    return out
