"""Weight-only int8: each output channel's weights as int8 with one fp32 scale.

Any float checkpoint can be stored in a quarter of its fp32 bytes: for each row r of a
weight (one output channel), scale_r = max |w_r| / 127 and q_r = round(w_r / scale_r),
so w_r ~ scale_r * q_r with an error of at most scale_r / 2 per weight. Activations stay
in floating point; only the weights shrink (vLLM's and LMDeploy's "weight-only int8").
`LLM(model=..., quantization="int8")` builds these from the loaded weights:

- `Int8Linear`: widens the int8 weight for the call and scales the product's columns (the
  reference, and a prefill's path); on a CPU the platform's plan sends a decode's few rows
  to the C kernel that reads the int8 rows and multiplies each output by its scale
  (`kernels/quant_rows.c`, `int8_rows`).
- `Int8Embedding`: a lookup widens just the rows of the step's token ids. A tied head is
  the same int8 rows, read as a linear layer: one scale per vocabulary entry either way.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minserve.kernels.linear_kernels import NO_KERNELS, KernelLinear, LinearPlan
from minserve.model.quantized_linear import matmul_dtype

INT8_MAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] float -> (q int8 [out, in], scales fp32 [out]): symmetric, per row."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / INT8_MAX  # [out]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row stays 0
    q = torch.round(w / safe[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)  # [out, in]
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q int8 [out, in], scales fp32 [out]) -> w fp32 [out, in]: scale times integer."""
    return q.float() * scales[:, None]


class Int8Linear(nn.Module):
    """`nn.Linear` whose weight is int8 per output channel: `qweight` [out, in], `scales` [out]."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.plan: LinearPlan = NO_KERNELS  # the platform's kernels (`platforms/cpu/linears.py`)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize a float linear layer's weight per output channel."""
        return cls(*quantize_int8(linear.weight), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [N, in]
        shape = (*x.shape[:-1], self.out_features)
        kernel = self.kernel(rows.shape[0])
        if kernel is not None:  # [N, out] in x's dtype: scaled, the bias added in fp32
            return kernel(rows).view(shape)
        # widen the integers once for this call (exact in bf16 too: at most 8 bits), scale
        # the columns after
        dtype = matmul_dtype(x)
        out = F.linear(rows.to(dtype), self.qweight.to(dtype)).float() * self.scales
        out = out if self.bias is None else out + self.bias.float()
        return out.to(x.dtype).view(shape)

    def kernel(self, num_rows: int) -> KernelLinear | None:
        """The kernel `forward` runs on `num_rows` rows (the plan's; None: torch)."""
        return self.plan.kernel(num_rows)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, bias={self.bias is not None}, int8 per channel"


class Int8Embedding(nn.Module):
    """`nn.Embedding` whose table is int8 per row: a lookup widens only its rows."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.num_embeddings = qweight.shape[0]
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.float().contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize_int8(self.qweight[flat], self.scales[flat])  # [T, hidden] fp32
        return rows.to(self.dtype).view(*ids.shape, -1)


def use_int8_weights(model: nn.Module, tied: bool, dtype: torch.dtype) -> int:
    """Replace every float linear layer and the embedding by its int8 form, in place;
    a tied head shares the embedding's int8 rows. Returns how many layers changed."""
    changed = 0
    for path, child in list(model.named_modules()):
        if not path or not isinstance(child, nn.Linear | nn.Embedding):
            continue
        if tied and path == "lm_head":
            continue  # done with the embedding it shares
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        if isinstance(child, nn.Embedding):
            qweight, scales = quantize_int8(child.weight)
            setattr(parent, attr, Int8Embedding(qweight, scales, dtype))
            if tied:
                model.lm_head = Int8Linear(qweight, scales, None)
                changed += 1
        else:
            setattr(parent, attr, Int8Linear.from_linear(child))
        changed += 1
    return changed
