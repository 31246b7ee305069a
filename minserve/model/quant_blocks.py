"""GGUF's block formats, both ways: rows of weights to Q8_0, Q4_0 and Q4_1 blocks and back.

A row is cut into blocks of 32 weights; each block keeps one fp16 scale `d` (Q4_1: and an
fp16 offset `m`, the block's minimum) and 32 small integers `q`:

- Q8_0, 34 bytes: d = absmax / 127, q = round(w / d) in int8; w = q * d.
- Q4_0, 18 bytes: d = (the weight of largest magnitude) / -8, q = w / d + 8 in 0..15;
  w = (q - 8) * d.
- Q4_1, 20 bytes: d = (max - min) / 15, m = min, q = (w - m) / d in 0..15; w = q * d + m.

The 4-bit ones pack two weights a byte, in GGUF's order: byte j holds q_j in its low
nibble and q_(j+16) in its high one. The arithmetic is the `gguf` package's (llama.cpp's
reference), bit for bit: fp32 throughout, fp16 only where a scale is stored. `QuantCodec`
bundles the functions the quantized layers call (`quantized_linear.py`), minserve's or a
module's (chapter 10: `LLM(model=<gguf>, quantization="gguf", quant_codec=...)`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from minserve.kernels.cpu_ops import QUANT_BLOCK, QUANT_BLOCK_BYTES

Quantize = Callable[[torch.Tensor], torch.Tensor]  # fp32 [rows, in] -> uint8 [rows, row bytes]
Dequantize = Callable[[torch.Tensor], torch.Tensor]  # uint8 [rows, row bytes] -> fp32 [rows, in]
Widen = Callable[[torch.Tensor, str], torch.Tensor]  # (blocks, format) -> fp32 [rows, in]


def half(pair: torch.Tensor) -> torch.Tensor:
    """Two bytes per entry [..., 2] (an fp16, little-endian) -> fp32 [..., 1]."""
    return pair.contiguous().view(torch.float16).float()


def half_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp32 [..., 1] -> its fp16 (rounded to nearest) as two bytes [..., 2]."""
    return values.to(torch.float16).contiguous().view(torch.uint8)


def as_blocks(rows: torch.Tensor) -> torch.Tensor:
    """fp32 [rows, in] -> [rows, in / 32, 32], after checking `in` is whole blocks."""
    if rows.dim() != 2 or rows.shape[1] % QUANT_BLOCK:
        raise ValueError(f"expected rows [n, a multiple of 32], got {tuple(rows.shape)}")
    return rows.float().reshape(rows.shape[0], -1, QUANT_BLOCK)


def block_bytes(blocks: torch.Tensor, quant: str) -> torch.Tensor:
    """uint8 [rows, row bytes] -> [rows, blocks, bytes a block of `quant`]."""
    return blocks.reshape(blocks.shape[0], -1, QUANT_BLOCK_BYTES[quant])


# >>> exercise 10.1: Q8_0 blocks
def round_half_away(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, halves away from zero (C's `roundf`; torch.round
    rounds halves to even), computed as the `gguf` package does so that it agrees bit for
    bit: floor(|v|), plus one when the fraction doubled reaches 1."""
    # >>> solution
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())
    # <<< solution


def quantize_q8_0(rows: torch.Tensor) -> torch.Tensor:
    """Rows fp32 [rows, in] -> Q8_0 blocks uint8 [rows, in / 32 * 34].

    Per block of 32: d = absmax / 127 (fp32), q = round_half_away(w * (1 / d)) as int8 (an
    all-zero block has d = 0 and q = 0); store d as fp16 (2 bytes), then the 32 q's.
    """
    # >>> solution
    w = as_blocks(rows)  # [rows, blocks, 32]
    d = w.abs().amax(dim=-1, keepdim=True) / 127  # [rows, blocks, 1]
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = round_half_away(w * inverse).to(torch.int8)  # [rows, blocks, 32]
    packed = torch.cat((half_bytes(d), q.view(torch.uint8)), dim=-1)  # [rows, blocks, 34]
    return packed.reshape(rows.shape[0], -1)
    # <<< solution


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks uint8 [rows, row bytes] -> weights fp32 [rows, row bytes / 34 * 32]:
    w = q * d, in fp32."""
    # >>> solution
    b = block_bytes(blocks, "Q8_0")  # [rows, blocks, 34]
    q = b[..., 2:].contiguous().view(torch.int8).float()  # [rows, blocks, 32]
    return (q * half(b[..., 0:2])).reshape(blocks.shape[0], -1)
    # <<< solution


# <<< exercise


# >>> exercise 10.2: Q4_0 and Q4_1 blocks
def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Integers 0..15 [..., 32] -> bytes uint8 [..., 16]: byte j holds q_j in its low
    nibble and q_(j+16) in its high one (GGUF's order, not q_(2j) and q_(2j+1))."""
    # >>> solution
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)
    # <<< solution


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes uint8 [..., 16] -> integers 0..15 as fp32 [..., 32], undoing `pack_nibbles`."""
    # >>> solution
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()
    # <<< solution


def quantize_q4_0(rows: torch.Tensor) -> torch.Tensor:
    """Rows fp32 [rows, in] -> Q4_0 blocks uint8 [rows, in / 32 * 18].

    Per block: the weight of largest magnitude (the first one, on a tie), with its sign,
    divided by -8 is d (fp32); q = trunc(w * (1 / d) + 8.5) clipped to 0..15 (d = 0 gives
    q = 8); store d as fp16, then the q's packed two a byte.
    """
    # >>> solution
    w = as_blocks(rows)  # [rows, blocks, 32]
    largest = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True))  # [rows, blocks, 1]
    d = largest / -8
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = (w * inverse + 8.5).trunc().clamp(0, 15)  # [rows, blocks, 32]
    packed = torch.cat((half_bytes(d), pack_nibbles(q)), dim=-1)  # [rows, blocks, 18]
    return packed.reshape(rows.shape[0], -1)
    # <<< solution


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks uint8 [rows, row bytes] -> weights fp32 [rows, row bytes / 18 * 32]:
    w = (q - 8) * d."""
    # >>> solution
    b = block_bytes(blocks, "Q4_0")  # [rows, blocks, 18]
    q = unpack_nibbles(b[..., 2:])  # [rows, blocks, 32]
    return ((q - 8.0) * half(b[..., 0:2])).reshape(blocks.shape[0], -1)
    # <<< solution


def quantize_q4_1(rows: torch.Tensor) -> torch.Tensor:
    """Rows fp32 [rows, in] -> Q4_1 blocks uint8 [rows, in / 32 * 20].

    Per block: d = (max - min) / 15 and m = min (fp32); q = trunc((w - m) * (1 / d) + 0.5)
    clipped to 0..15 (d = 0 gives q = 0); store d and m as fp16, then the q's packed.
    """
    # >>> solution
    w = as_blocks(rows)  # [rows, blocks, 32]
    low = w.amin(dim=-1, keepdim=True)  # [rows, blocks, 1]
    d = (w.amax(dim=-1, keepdim=True) - low) / 15
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = ((w - low) * inverse + 0.5).trunc().clamp(0, 15)  # [rows, blocks, 32]
    packed = torch.cat((half_bytes(d), half_bytes(low), pack_nibbles(q)), dim=-1)
    return packed.reshape(rows.shape[0], -1)  # [rows, blocks * 20]
    # <<< solution


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks uint8 [rows, row bytes] -> weights fp32 [rows, row bytes / 20 * 32]:
    w = q * d + m, in fp32 (the fp16 m, not the exact minimum)."""
    # >>> solution
    b = block_bytes(blocks, "Q4_1")  # [rows, blocks, 20]
    q = unpack_nibbles(b[..., 4:])  # [rows, blocks, 32]
    return (q * half(b[..., 0:2]) + half(b[..., 2:4])).reshape(blocks.shape[0], -1)
    # <<< solution


# <<< exercise


# >>> exercise 10.3: the dequantizing matmul
def dequantize_matmul(
    x: torch.Tensor, blocks: torch.Tensor, quant: str, widen: Widen, step: int = 8
) -> torch.Tensor:
    """x fp32 [N, in] times the blocked weight [out, in] transposed -> fp32 [N, out], the
    weight widened `step` blocks of columns at a time (`widen(blocks slice, quant)` gives
    fp32 [out, step * 32]), never all at once: each slice of x meets its slice of weights
    and the partial products add up. Equal to x @ widen(blocks, quant).T, up to the order
    of the additions.
    """
    # >>> solution
    per_block = QUANT_BLOCK_BYTES[quant]
    num_blocks = blocks.shape[1] // per_block
    out = x.new_zeros(x.shape[0], blocks.shape[0])  # [N, out]
    for first in range(0, num_blocks, step):
        last = min(first + step, num_blocks)
        weights = widen(blocks[:, first * per_block : last * per_block], quant)  # [out, cols]
        out += x[:, first * QUANT_BLOCK : last * QUANT_BLOCK] @ weights.T
    return out
    # <<< solution


# <<< exercise


def dequantize(blocks: torch.Tensor, quant: str) -> torch.Tensor:
    """Blocks uint8 [rows, row bytes] -> weights fp32 [rows, row bytes / block bytes * 32]."""
    return CODEC.dequantize(blocks, quant)


def quantize(rows: torch.Tensor, quant: str) -> torch.Tensor:
    """Rows fp32 [rows, in] -> blocks uint8 [rows, in / 32 * block bytes]."""
    return CODEC.quantize(rows, quant)


@dataclass(frozen=True)
class QuantCodec:
    """The block arithmetic the quantized layers call: minserve's (`CODEC`) or a module's
    (`QuantCodec.from_module`), one quantize and one dequantize per format and the matmul."""

    quantizers: dict[str, Quantize]
    dequantizers: dict[str, Dequantize]
    matmul: Callable[[torch.Tensor, torch.Tensor, str, Widen], torch.Tensor]

    @classmethod
    def from_module(cls, module: ModuleType) -> QuantCodec:
        """The functions of `module` by name (chapter 10's exercises or solutions)."""
        names = {q: (f"quantize_{q.lower()}", f"dequantize_{q.lower()}") for q in QUANT_BLOCK_BYTES}
        wanted = [n for pair in names.values() for n in pair] + ["dequantize_matmul"]
        missing = [name for name in wanted if not callable(getattr(module, name, None))]
        if missing:
            raise ValueError(f"module {module.__name__} has no function {', '.join(missing)}")
        return cls(
            {q: getattr(module, pair[0]) for q, pair in names.items()},
            {q: getattr(module, pair[1]) for q, pair in names.items()},
            module.dequantize_matmul,
        )

    def quantize(self, rows: torch.Tensor, quant: str) -> torch.Tensor:
        """Rows fp32 [rows, in] -> `quant` blocks uint8 [rows, row bytes]."""
        return self.quantizers[_known(quant)](rows)

    def dequantize(self, blocks: torch.Tensor, quant: str) -> torch.Tensor:
        """`quant` blocks uint8 [rows, row bytes] -> weights fp32 [rows, in]."""
        return self.dequantizers[_known(quant)](blocks)

    def linear(self, x: torch.Tensor, blocks: torch.Tensor, quant: str) -> torch.Tensor:
        """x fp32 [N, in] @ the blocked weight's transpose -> [N, out], widening by slices."""
        return self.matmul(x, blocks, quant, self.dequantize)


def _known(quant: str) -> str:
    if quant not in QUANT_BLOCK_BYTES:
        raise ValueError(f"no {quant} blocks here; the formats are {tuple(QUANT_BLOCK_BYTES)}")
    return quant


CODEC = QuantCodec(
    {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0, "Q4_1": quantize_q4_1},
    {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1},
    dequantize_matmul,
)
