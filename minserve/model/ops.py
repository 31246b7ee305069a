"""The decoder's building blocks as plain functions: RMSNorm, RoPE, SwiGLU (and attention,
and RoPE's frequencies from `rope.py`).

`llama.py` calls these through a `ModelOps`, so the same model runs on minserve's own
versions (`MODEL_OPS`) or on anyone else's with the same signatures: chapter 00's
exercises plug in with `LLM(model_ops=ModelOps.from_module(module))`. A platform may give
the model its own value of the same kind: the CPU's C kernels compute the same math
(`platforms/cpu/ops.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from minserve.attention.contiguous import Attend, attend
from minserve.model.rope import rope_inverse_frequencies
from minserve.model_config import ModelConfig


# >>> exercise 0.1: RMSNorm
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm over the last dim: x [..., dim], weight [dim] -> [..., dim].

    Divide each row by sqrt(mean(x^2) + eps), computed in float32 whatever x's dtype;
    cast the normed row back to x's dtype, then scale it by `weight` (no mean
    subtraction, no bias: that is what sets RMSNorm apart from LayerNorm).
    """
    # >>> solution
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
    # <<< solution


# <<< exercise


# >>> exercise 0.2: rotary position embedding (RoPE)
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate q or k by each token's position: x [T, heads, head_dim] -> same shape.

    cos and sin are [T, 1, head_dim] (broadcast over heads), the cosines and sines of
    position * frequency with the head_dim / 2 frequencies written twice. "Rotate half"
    layout (Hugging Face's): dim i and dim i + head_dim / 2 form a pair, rotated by
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    """
    # >>> solution
    x1, x2 = x.chunk(2, dim=-1)  # [T, heads, head_dim / 2] each
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    # <<< solution


# <<< exercise


# >>> exercise 0.3: SwiGLU
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The MLP's gated activation: silu(gate) * up, elementwise, [T, inner] -> [T, inner].

    silu(g) = g * sigmoid(g). The MLP computes gate = x W_gate and up = x W_up, then
    down(swiglu(gate, up)). Keep the inputs' dtype.
    """
    # >>> solution
    return F.silu(gate) * up
    # <<< solution


# <<< exercise


@dataclass(frozen=True)
class ModelOps:
    """The functions the decoder computes with (one set per model, see `CausalLM.use_ops`).

    `attend` is not called by the model itself but by the attention the engine builds
    each step when given these ops (`attention/per_sequence.py`, `contiguous.py`).
    """

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    apply_rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    attend: Attend
    rope_inverse_frequencies: Callable[[ModelConfig], torch.Tensor]

    @classmethod
    def from_module(cls, module: ModuleType) -> ModelOps:
        """The five functions of `module` (chapter 00's exercises or solutions), by name."""
        names = ("rms_norm", "apply_rope", "swiglu", "attend", "rope_inverse_frequencies")
        missing = [name for name in names if not callable(getattr(module, name, None))]
        if missing:
            raise ValueError(f"module {module.__name__} has no function {', '.join(missing)}")
        return cls(*(getattr(module, name) for name in names))


MODEL_OPS = ModelOps(rms_norm, apply_rope, swiglu, attend, rope_inverse_frequencies)
