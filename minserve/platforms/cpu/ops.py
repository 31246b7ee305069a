"""The decoder's small ops as C kernels: a `ModelOps` value like minserve's torch ops.

The CPU platform hands these to the model at load where the C kernels are built and the
model's dtype is one they take (fp32 or bfloat16). Each computes the math of its torch
reference in `model/ops.py` in one pass (`kernels/layer_ops.c`): a bfloat16 tensor is read
widened to fp32, computed on in fp32 and rounded once on the way out. The layers call
them exactly as they call the torch ones; `tests/test_cpu_kernels.py` checks each against
its reference. `attend` and the RoPE frequencies are the torch ones: attention on a CPU is
the attention backend's business (`attention/paged_cpu.py`).
"""

from __future__ import annotations

import torch

from minserve.kernels import cpu_ops
from minserve.model.ops import MODEL_OPS, ModelOps


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one C pass. gate and up are usually the two halves of one fused
    projection's rows ([T, 2 * inner], `gate_up_proj`): the kernel then reads them in place."""
    inner = gate.shape[-1]
    beside = (
        gate.dim() == 2
        and gate.stride() == up.stride()
        and up.data_ptr() == gate.data_ptr() + inner * gate.element_size()
    )
    if beside:  # [T, 2 * inner] as one strided view: gate columns, then up columns
        gate_up = gate.as_strided((gate.shape[0], 2 * inner), gate.stride())
    else:
        gate_up = torch.cat((gate, up), dim=-1)  # [..., 2 * inner]
    return cpu_ops.silu_mul(gate_up)


C_KERNEL_OPS = ModelOps(
    rms_norm=cpu_ops.rms_norm,
    apply_rope=cpu_ops.rope,
    swiglu=swiglu,
    attend=MODEL_OPS.attend,
    rope_inverse_frequencies=MODEL_OPS.rope_inverse_frequencies,
)
