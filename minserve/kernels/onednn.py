"""Whether oneDNN (torch's CPU inner-product library) can prepack weights here."""

from __future__ import annotations

import torch

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packs weights on CPUs: fp32 on any, bf16 only where the CPU has the
    instructions oneDNN's bf16 path needs (AVX512-BW/VL/DQ or AVX-NE-CONVERT)."""
    if device.type != "cpu" or dtype not in PACKABLE_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
