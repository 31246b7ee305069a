"""Weights served as GGUF stores them: Q8_0, Q4_0 and Q4_1 blocks, widened where they are used.

A GGUF weight row is cut into blocks of 32 values, each block one fp16 scale (Q4_1: and an
fp16 offset) and 32 small integers (8 or 4 bits): 8.5, 4.5 or 5 bits a weight where fp32
takes 32. A decode step reads every weight once, so reading the blocks as they are, and
widening them in registers, moves a fifth to a quarter of the bytes (llama.cpp's approach;
vLLM's `quantization="gguf"`). `LLM(model="file.gguf", quantization="gguf")` builds these:

- `QuantizedLinear`: its forward widens the blocks and runs one matrix product, the
  reference. The platform gives it a plan at load: on a CPU a decode's few rows go
  through the C kernel that reads the blocks (`kernels/quant_rows.c`); more rows (a
  prefill) widen the whole weight for the call in C and run one matrix product,
  compute-bound there anyway; in a bf16 model on a CPU with AVX512-BF16 the weight is
  widened a pair of panels at a time into cache and multiplied there by the panel kernel
  (`cpu_ops.quant_panels`), never written out whole. On a GPU every step runs the Triton
  kernel that widens the blocks inside the matrix product (`platforms/cuda/triton_quant.py`).
- `QuantizedEmbedding`: looks up the blocks of the step's token ids and widens just those.

`dequantize` (`quant_blocks.py`) is the reference: the `gguf` package's arithmetic (fp16
scale times integer, plus offset, in fp32), so a quantized model and the same file
dequantized at load compute with the same weights (`tests/test_quantized_model.py`).
`use_quant_codec` hands every quantized layer a `QuantCodec` (chapter 10's exercises):
then its lookups widen with the codec's dequantize and all its rows go through the codec's
dequantizing matmul, in torch.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minserve.kernels.cpu_ops import QUANT_BLOCK, QUANT_BLOCK_BYTES
from minserve.kernels.linear_kernels import NO_KERNELS, KernelLinear, LinearPlan
from minserve.model.llama import CausalLM
from minserve.model.quant_blocks import QuantCodec, dequantize

QUANTS = tuple(QUANT_BLOCK_BYTES)  # ("Q8_0", "Q4_0", "Q4_1"): the formats kept as stored


def check_quant(quant: str, in_features: int) -> None:
    """The formats kept as stored, on rows of whole blocks."""
    if quant not in QUANTS:
        raise ValueError(f"{quant} blocks are not served as stored; choose one of {QUANTS}")
    if in_features % QUANT_BLOCK:
        raise ValueError(f"{in_features} weights a row is not a whole number of 32-blocks")


class QuantizedLinear(nn.Module):
    """`nn.Linear` whose weight stays in GGUF blocks: `blocks` uint8 [out, row bytes].

    Its own forward widens the blocks in torch and runs one matrix product (the
    reference); `plan`, set by the platform at load, names the kernels that read the blocks
    as stored instead (`platforms/cpu/linears.py`, `platforms/cuda/platform.py`)."""

    def __init__(self, blocks: torch.Tensor, quant: str, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.quant = quant
        self.out_features = blocks.shape[0]
        self.in_features = blocks.shape[1] // QUANT_BLOCK_BYTES[quant] * QUANT_BLOCK
        check_quant(quant, self.in_features)
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.codec: QuantCodec | None = None  # `use_quant_codec`: a codec's arithmetic instead
        self.plan: LinearPlan = NO_KERNELS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [N, in]
        shape = (*x.shape[:-1], self.out_features)
        kernel = self.kernel(rows.shape[0])
        if kernel is not None:  # [N, out] in x's dtype, the bias added in fp32
            return kernel(rows).view(shape)
        if self.codec is not None:
            out = self.codec.linear(rows.float(), self.blocks, self.quant)  # [N, out] fp32
        else:  # widen the weight once for this call, in the step's dtype
            dtype = matmul_dtype(x)
            out = F.linear(rows.to(dtype), self.widened(dtype))  # [N, out]
        out = out if self.bias is None else out + self.bias.float()  # the bias added in fp32
        return out.to(x.dtype).view(shape)

    def kernel(self, num_rows: int) -> KernelLinear | None:
        """The kernel `forward` runs on `num_rows` rows (the plan's), None with a codec."""
        return None if self.codec is not None else self.plan.kernel(num_rows)

    def widened(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] in `dtype` (fp32, or bf16 rounded from it)."""
        return dequantize(self.blocks, self.quant).to(dtype)

    @classmethod
    def concat(cls, parts: list[QuantizedLinear]) -> QuantizedLinear:
        """One layer whose outputs are the parts' side by side (their blocks, row after row)."""
        quants = {p.quant for p in parts}
        if len(quants) != 1:
            raise ValueError(f"cannot fuse layers stored as {sorted(quants)} into one")
        biases = [p.bias for p in parts]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        return cls(torch.cat([p.blocks for p in parts]), parts[0].quant, bias)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, bias={self.bias is not None}, {self.quant}"


class QuantizedEmbedding(nn.Module):
    """`nn.Embedding` whose table stays in GGUF blocks: a lookup widens only its rows."""

    def __init__(self, blocks: torch.Tensor, quant: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.quant, self.dtype = quant, dtype
        self.num_embeddings = blocks.shape[0]
        check_quant(quant, blocks.shape[1] // QUANT_BLOCK_BYTES[quant] * QUANT_BLOCK)
        self.register_buffer("blocks", blocks.contiguous())
        self.codec: QuantCodec | None = None  # `use_quant_codec`: a codec's dequantize instead

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        widen = dequantize if self.codec is None else self.codec.dequantize
        rows = widen(self.blocks[ids.reshape(-1)], self.quant)  # [T, hidden] fp32
        return rows.to(self.dtype).view(*ids.shape, -1)


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a prefill's widened weight is multiplied in: a bfloat16 step's own (half
    the bytes and the CPU's bf16 matrix speed), else fp32."""
    return torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's tensors hold in memory: parameters and buffers (blocks, oneDNN's
    packed copies), each storage once (a tied head shares the embedding's)."""
    tensors = [*model.parameters(), *model.buffers()]
    sizes = {_storage_key(t): t.numel() * t.element_size() for t in tensors}
    return sum(sizes.values())


def _storage_key(t: torch.Tensor) -> int:
    """Where a tensor's bytes are: its data pointer, or (oneDNN's opaque layout) itself."""
    return t.data_ptr() if t.layout == torch.strided else id(t)


def use_quantized_blocks(
    model: nn.Module, found: dict[str, tuple[str, torch.Tensor]], tied: bool, dtype: torch.dtype
) -> None:
    """Replace each linear and embedding whose weight is in `found` (HF name -> (format,
    blocks)) by its quantized form; a tied head shares the embedding's blocks."""
    for name, (quant, blocks) in found.items():
        path = name.removesuffix(".weight")
        parent_path, _, attr = path.rpartition(".")
        parent, child = model.get_submodule(parent_path), model.get_submodule(path)
        if isinstance(child, nn.Embedding):
            setattr(parent, attr, QuantizedEmbedding(blocks, quant, dtype))
            if tied:
                model.lm_head = QuantizedLinear(blocks, quant, None)
        elif isinstance(child, nn.Linear):
            setattr(parent, attr, QuantizedLinear(blocks, quant, child.bias))


def use_quant_codec(model: nn.Module, codec: QuantCodec | None) -> int:
    """Give every quantized layer of `model` `codec` (None: minserve's own paths); returns
    how many layers took it."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear | QuantizedEmbedding)]
    for layer in layers:
        layer.codec = codec
    if isinstance(model, CausalLM):
        model.revision += 1  # what caches the layers' kernels sees them again
    return len(layers)
