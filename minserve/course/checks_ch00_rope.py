"""Checks for chapter 00's RoPE frequencies (exercise 0.9), run against any module that
defines `rope_inverse_frequencies(config)`: the solutions, or a student's exercise file.

The oracle is transformers' own `LlamaRotaryEmbedding`, built from the same settings:
plain RoPE at two values of theta, then Llama 3's scaling, whose head_dim of 64 has
pairs in all three bands (kept, blended, slowed down).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from minserve.model_config import ModelConfig, RopeScaling

_LLAMA3 = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _config(theta: float, scaling: RopeScaling | None) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=16, hidden_size=256, intermediate_size=64,
        num_layers=1, num_heads=4, num_kv_heads=4, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=theta, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling=scaling,
    )  # fmt: skip


def _transformers_inv_freq(config: ModelConfig) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope: dict[str, object] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope = {**rope, "rope_type": "llama3", **config.rope_scaling.__dict__}
    hf = LlamaConfig(
        hidden_size=config.hidden_size, num_attention_heads=config.num_heads,
        max_position_embeddings=config.max_position_embeddings, rope_parameters=rope,
    )  # fmt: skip
    return LlamaRotaryEmbedding(config=hf).inv_freq


def _assert_matches(impl: ModuleType, config: ModelConfig, what: str) -> None:
    expected = _transformers_inv_freq(config)  # [head_dim / 2]
    got = impl.rope_inverse_frequencies(config)
    assert isinstance(got, torch.Tensor) and got.shape == expected.shape, (
        f"rope_inverse_frequencies({what}): expected a tensor of shape {tuple(expected.shape)}, "
        f"got {type(got).__name__} {tuple(getattr(got, 'shape', ()))}"
    )
    assert got.dtype == torch.float32, (
        f"rope_inverse_frequencies({what}): expected float32, got {got.dtype}"
    )
    wrong = [i for i in range(len(expected)) if not torch.isclose(got[i], expected[i], rtol=1e-6)]
    assert not wrong, (
        f"rope_inverse_frequencies({what}), pairs {wrong}: expected "
        f"{[f'{x:.6g}' for x in expected[wrong].tolist()]}, got "
        f"{[f'{x:.6g}' for x in got[wrong].tolist()]}"
    )


def check_rope_frequencies_match_transformers(impl: ModuleType) -> None:
    """Plain RoPE, head_dim 64, theta 10,000 and 500,000: transformers' frequencies."""
    for theta in (10_000.0, 500_000.0):
        _assert_matches(impl, _config(theta, None), f"head_dim 64, theta {theta:g}, no scaling")


def check_llama3_scaling_matches_transformers(impl: ModuleType) -> None:
    """Llama 3 scaling (factor 8, from 8k positions) keeps, blends and slows pairs as transformers.

    Its head_dim of 64 has pairs in all three bands."""
    what = "head_dim 64, theta 500000, llama3 factor 8, low 1, high 4, 8192 positions"
    _assert_matches(impl, _config(500_000.0, _LLAMA3), what)


ROPE_CHECKS: list[Callable[[ModuleType], None]] = [
    check_rope_frequencies_match_transformers,
    check_llama3_scaling_matches_transformers,
]

HINTS: dict[str, tuple[str, str, str]] = {
    "0.9": (
        "Pair i of a head turns at speed theta^(-2i/d): fast pairs for short distances, slow "
        "ones for long. Llama 3 slows down only the slow pairs, by the factor, and blends "
        "the ones in between so no pair jumps.",
        "Build the d / 2 speeds in float64; without scaling, cast and return them. With "
        "scaling, turn each speed into a wavelength, compute both bounds from the original "
        "length and the two freq factors, then choose per pair: divided, kept, or blended.",
        "Speeds: one over theta to the power arange(0, d, 2) / d; wavelength is 2 * pi "
        "over a speed; `torch.where` on `wavelength > L / lo` picks the slowed speeds, and "
        "a second `torch.where` on the band between the bounds picks the blend.",
    ),
}
