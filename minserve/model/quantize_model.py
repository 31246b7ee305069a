"""Quantize a loaded model's weights into GGUF blocks, as `llama-quantize` does to a file.

A model loaded in fp32 (`load_model(prepack=False)`) has plain `nn.Linear` layers and an
`nn.Embedding`; `quantize_weights` turns each into its quantized form (`QuantizedLinear`,
`QuantizedEmbedding`, `quantized_linear.py`) holding `quantize(weight)`'s blocks, so the
same engine then reads 4 or 8 bits a weight. A tied head shares the embedding's blocks.
Chapter 10 measures what each format costs with it, and runs the engine on a student's
quantizer: `LLM(model=loaded, quant_codec=...)`.
"""

from __future__ import annotations

import torch
from torch import nn

from minserve.model.quant_blocks import Quantize
from minserve.model.quantized_linear import QuantizedEmbedding, QuantizedLinear


# >>> exercise 10.4: quantize a model
def quantize_weights(model: nn.Module, quant: str, quantize: Quantize) -> int:
    """Replace every `nn.Linear` and `nn.Embedding` of `model` (a plain fp32 one) by its
    quantized form holding `quantize(weight)`, blocks uint8 [rows, row bytes] of format
    `quant`; the embedding keeps its dtype for what it returns. A head tied to the
    embedding (`model.lm_head.weight is` the table) becomes a `QuantizedLinear` over the
    embedding's blocks, quantized once. Returns how many layers were replaced.
    """
    # >>> solution
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
    # <<< solution


# <<< exercise


def weight_rms_error(weight: torch.Tensor, widened: torch.Tensor) -> float:
    """Root-mean-square difference of a weight and its quantized-then-widened copy,
    relative to the weight's own RMS (0.01: one percent)."""
    weight = weight.float()
    return ((widened - weight).pow(2).mean() / weight.pow(2).mean()).sqrt().item()
