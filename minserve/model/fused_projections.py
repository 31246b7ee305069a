"""Fused projections: q, k and v as one linear layer, the MLP's gate and up as another.

The three attention projections read the same input, and so do the MLP's gate and up. One
`[q + 2 kv, hidden]` weight and one `[2 * inner, hidden]` weight make five matrix products
two: fewer calls, and each streams its weight in one pass (vLLM's `QKVParallelLinear` and
`MergedColumnParallelLinear` do the same). Outputs are split back by rows, so every number
is the same dot product as before.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minserve.model.llama import CausalLM
from minserve.model.quantized_linear import QuantizedLinear, dequantize


def concat_linears(parts: list[nn.Module]) -> nn.Module:
    """One linear whose output is the parts' outputs side by side: [..., sum of out].
    Quantized parts of one format stay quantized (their blocks, row after row)."""
    if all(isinstance(p, QuantizedLinear) for p in parts) and len({p.quant for p in parts}) == 1:
        return QuantizedLinear.concat(parts)
    plain = [p.weight.dtype for p in parts if not isinstance(p, QuantizedLinear)]
    dtype = plain[0] if plain else torch.float32
    weight = torch.cat([weight_of(p).to(dtype) for p in parts])  # [sum of out, in]
    has_bias = parts[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return fused


def weight_of(part: nn.Module) -> torch.Tensor:
    """A part's weight [out, in] as floats (a quantized one widened)."""
    if isinstance(part, QuantizedLinear):
        return dequantize(part.blocks, part.quant)
    return part.weight.detach()


def fuse_projections(model: CausalLM) -> None:
    """Replace every layer's q/k/v_proj by `qkv_proj` and gate/up_proj by `gate_up_proj`."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = concat_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp.gate_up_proj = concat_linears([mlp.gate_proj, mlp.up_proj])
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
        for module, last in ((attn, "o_proj"), (mlp, "down_proj")):  # print in running order
            module._modules[last] = module._modules.pop(last)
