"""RoPE's rotation speeds: one frequency per pair of dimensions, and Llama 3's scaling.

Rotary position embedding turns dimension pair i of q and k by position * inv_freq[i]
(`RotaryEmbedding` in `llama.py` builds the step's cos and sin from these). The fast pairs
tell nearby positions apart; the slow ones carry position over long distances, and
Llama 3 stretches only those to read far past the length it was trained on.
"""

from __future__ import annotations

import math

import torch

from minserve.model_config import ModelConfig


# >>> exercise 0.9: RoPE's frequencies, with Llama 3's long-context scaling
def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """RoPE's per-pair rotation speeds theta^(-2i/d), with Llama-3 scaling when configured.

    d = `config.head_dim`, theta = `config.rope_theta`; returns float32 [d / 2], pair i
    first (compute in float64, as transformers does, then cast). Without
    `config.rope_scaling`, that is all. With it (s = factor, L = original max positions,
    lo / hi = low / high freq factors), a pair's wavelength 2 pi / inv_freq decides:
    longer than L / lo: slowed down, inv_freq / s; shorter than L / hi: kept as it is; in
    between (both bounds included): blended, (1 - smooth) * inv_freq / s + smooth *
    inv_freq with smooth = (L / wavelength - lo) / (hi - lo). So a model trained on 8k
    tokens reads 128k: only the slow pairs, which carry long distances, are stretched.
    """
    # >>> solution
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.float()  # [head_dim / 2]
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_medium, blended, scaled).float()
    # <<< solution


# <<< exercise
