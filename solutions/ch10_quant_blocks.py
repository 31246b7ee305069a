# Generated from minserve/model/quant_blocks.py, minserve/model/quantize_model.py, minserve/kvcache/kv_format.py by `python -m minserve.course.generate`;
# edit the marked regions there, not here.
"""Chapter 10, Fewer bytes: GGUF's block formats, both ways, and the matmul that
widens them a slice at a time.

10.1 is Q8_0 (an fp16 scale and 32 int8 a block), 10.2 the 4-bit Q4_0 and Q4_1
(two weights a byte: q_j low, q_(j+16) high), each checked byte for byte against
the `gguf` package; 10.3 multiplies by a blocked weight without widening all of it.
Plug them into the engine with `LLM(model=<gguf file>, quantization="gguf",
plugins=CoursePlugins(quant_codec=QuantCodec.from_module(module)))`: every
quantized layer then widens its blocks with your dequantize functions and
multiplies with your matmul. 10.4 quantizes a loaded fp32 model's layers with your
quantize functions: serve it with
`LLM(model=loaded, plugins=CoursePlugins(quant_codec=...))`. 10.5 is the int8 KV
cache's row: one fp16 scale per token and KV head, q = round(x / scale) in
[-127, 127]; plug it in with `LLM(kv_cache_dtype="int8",
plugins=CoursePlugins(kv_codec=KVCodec.from_module(module)))`: the engine then
stores and reads every cached key and value with your two functions.
"""

import torch
from torch import nn

from minserve.kernels.cpu_ops import QUANT_BLOCK, QUANT_BLOCK_BYTES
from minserve.kvcache.kv_format import INT8_MAX, KVCodec  # noqa: F401
from minserve.model.quant_blocks import QuantCodec  # noqa: F401
from minserve.model.quant_blocks import (  # noqa: F401  (your code will want them)
    Widen,
    as_blocks,
    block_bytes,
    half,
    half_bytes,
)
from minserve.model.quant_blocks import Quantize
from minserve.model.quantized_linear import QuantizedEmbedding, QuantizedLinear


# Exercise 10.1: Q8_0 blocks
def round_half_away(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest integer, halves away from zero (C's `roundf`; torch.round
    rounds halves to even), computed as the `gguf` package does so that it agrees bit for
    bit: floor(|v|), plus one when the fraction doubled reaches 1."""
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())


def quantize_q8_0(rows: torch.Tensor) -> torch.Tensor:
    """Rows fp32 [rows, in] -> Q8_0 blocks uint8 [rows, in / 32 * 34].

    Per block of 32: d = absmax / 127 (fp32), q = round_half_away(w * (1 / d)) as int8 (an
    all-zero block has d = 0 and q = 0); store d as fp16 (2 bytes), then the 32 q's.
    """
    w = as_blocks(rows)  # [rows, blocks, 32]
    d = w.abs().amax(dim=-1, keepdim=True) / 127  # [rows, blocks, 1]
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = round_half_away(w * inverse).to(torch.int8)  # [rows, blocks, 32]
    packed = torch.cat((half_bytes(d), q.view(torch.uint8)), dim=-1)  # [rows, blocks, 34]
    return packed.reshape(rows.shape[0], -1)


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks uint8 [rows, row bytes] -> weights fp32 [rows, row bytes / 34 * 32]:
    w = q * d, in fp32."""
    b = block_bytes(blocks, "Q8_0")  # [rows, blocks, 34]
    q = b[..., 2:].contiguous().view(torch.int8).float()  # [rows, blocks, 32]
    return (q * half(b[..., 0:2])).reshape(blocks.shape[0], -1)


# Exercise 10.2: Q4_0 and Q4_1 blocks
def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Integers 0..15 [..., 32] -> bytes uint8 [..., 16]: byte j holds q_j in its low
    nibble and q_(j+16) in its high one (GGUF's order, not q_(2j) and q_(2j+1))."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes uint8 [..., 16] -> integers 0..15 as fp32 [..., 32], undoing `pack_nibbles`."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()


def quantize_q4_0(rows: torch.Tensor) -> torch.Tensor:
    """Rows fp32 [rows, in] -> Q4_0 blocks uint8 [rows, in / 32 * 18].

    Per block: the weight of largest magnitude (the first one, on a tie), with its sign,
    divided by -8 is d (fp32); q = trunc(w * (1 / d) + 8.5) clipped to 0..15 (d = 0 gives
    q = 8); store d as fp16, then the q's packed two a byte.
    """
    w = as_blocks(rows)  # [rows, blocks, 32]
    largest = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True))  # [rows, blocks, 1]
    d = largest / -8
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = (w * inverse + 8.5).trunc().clamp(0, 15)  # [rows, blocks, 32]
    packed = torch.cat((half_bytes(d), pack_nibbles(q)), dim=-1)  # [rows, blocks, 18]
    return packed.reshape(rows.shape[0], -1)


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks uint8 [rows, row bytes] -> weights fp32 [rows, row bytes / 18 * 32]:
    w = (q - 8) * d."""
    b = block_bytes(blocks, "Q4_0")  # [rows, blocks, 18]
    q = unpack_nibbles(b[..., 2:])  # [rows, blocks, 32]
    return ((q - 8.0) * half(b[..., 0:2])).reshape(blocks.shape[0], -1)


def quantize_q4_1(rows: torch.Tensor) -> torch.Tensor:
    """Rows fp32 [rows, in] -> Q4_1 blocks uint8 [rows, in / 32 * 20].

    Per block: d = (max - min) / 15 and m = min (fp32); q = trunc((w - m) * (1 / d) + 0.5)
    clipped to 0..15 (d = 0 gives q = 0); store d and m as fp16, then the q's packed.
    """
    w = as_blocks(rows)  # [rows, blocks, 32]
    low = w.amin(dim=-1, keepdim=True)  # [rows, blocks, 1]
    d = (w.amax(dim=-1, keepdim=True) - low) / 15
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = ((w - low) * inverse + 0.5).trunc().clamp(0, 15)  # [rows, blocks, 32]
    packed = torch.cat((half_bytes(d), half_bytes(low), pack_nibbles(q)), dim=-1)
    return packed.reshape(rows.shape[0], -1)  # [rows, blocks * 20]


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks uint8 [rows, row bytes] -> weights fp32 [rows, row bytes / 20 * 32]:
    w = q * d + m, in fp32 (the fp16 m, not the exact minimum)."""
    b = block_bytes(blocks, "Q4_1")  # [rows, blocks, 20]
    q = unpack_nibbles(b[..., 4:])  # [rows, blocks, 32]
    return (q * half(b[..., 0:2]) + half(b[..., 2:4])).reshape(blocks.shape[0], -1)


# Exercise 10.3: the dequantizing matmul
def dequantize_matmul(
    x: torch.Tensor, blocks: torch.Tensor, quant: str, widen: Widen, step: int = 8
) -> torch.Tensor:
    """x fp32 [N, in] times the blocked weight [out, in] transposed -> fp32 [N, out], the
    weight widened `step` blocks of columns at a time (`widen(blocks slice, quant)` gives
    fp32 [out, step * 32]), never all at once: each slice of x meets its slice of weights
    and the partial products add up. Equal to x @ widen(blocks, quant).T, up to the order
    of the additions.
    """
    per_block = QUANT_BLOCK_BYTES[quant]
    num_blocks = blocks.shape[1] // per_block
    out = x.new_zeros(x.shape[0], blocks.shape[0])  # [N, out]
    for first in range(0, num_blocks, step):
        last = min(first + step, num_blocks)
        weights = widen(blocks[:, first * per_block : last * per_block], quant)  # [out, cols]
        out += x[:, first * QUANT_BLOCK : last * QUANT_BLOCK] @ weights.T
    return out


# Exercise 10.4: quantize a model
def quantize_weights(model: nn.Module, quant: str, quantize: Quantize) -> int:
    """Replace every `nn.Linear` and `nn.Embedding` of `model` (a plain fp32 one) by its
    quantized form holding `quantize(weight)`, blocks uint8 [rows, row bytes] of format
    `quant`; the embedding keeps its dtype for what it returns. A head tied to the
    embedding (`model.lm_head.weight is` the table) becomes a `QuantizedLinear` over the
    embedding's blocks, quantized once. Returns how many layers were replaced.
    """
    table = model.get_submodule("model.embed_tokens").weight
    tied = model.get_submodule("lm_head").weight is table
    table_blocks = quantize(table.detach().float())  # [vocab, row bytes]
    replaced = 0
    for name, layer in list(model.named_modules()):
        parent_name, _, attr = name.rpartition(".")
        if isinstance(layer, nn.Embedding):
            new: nn.Module = QuantizedEmbedding(table_blocks, quant, layer.weight.dtype)
        elif isinstance(layer, nn.Linear):
            tied_head = tied and layer.weight is table
            blocks = table_blocks if tied_head else quantize(layer.weight.detach().float())
            new = QuantizedLinear(blocks, quant, layer.bias)
        else:
            continue
        setattr(model.get_submodule(parent_name), attr, new)
        replaced += 1
    return replaced


# Exercise 10.5: the int8 KV store
def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] int8, scale [..., 1] fp16) with x ~= q * scale.

    scale = absmax(x) / 127 per row (in fp32), rounded to fp16 first so that the stored
    scale is the one used; q = round(x / scale) (torch.round: halves to even) clamped to
    [-127, 127]. An all-zero row gets scale 0 and q 0 (no division by zero); a row past
    fp16's range (absmax > 127 x 65504) saturates at the largest scale instead of
    overflowing.
    """
    absmax = x.float().abs().amax(dim=-1, keepdim=True)  # [..., 1]
    largest = torch.finfo(torch.float16).max
    scale = (absmax / INT8_MAX).clamp(max=largest).to(torch.float16)
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(absmax))
    q = torch.round(x.float() / safe).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of `quantize_int8`: q [..., D] int8 times scale [..., 1] -> float32."""
    return q.float() * scale.float()
