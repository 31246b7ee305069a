"""Chapter 00's checks of the decoder's pieces (exercises 0.1-0.4), and their hints.

Each piece is compared with a torch reference on seeded random tensors (transformers' own
`apply_rotary_pos_emb` for RoPE, torch's `scaled_dot_product_attention` for attention),
in float32 and bfloat16; then all four run together inside a tiny random Llama whose
logits must match transformers' for the same weights. `checks_ch00` lists them first.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from minserve.attention.contiguous import ContiguousAttention, ContiguousSlice, SequenceKV
from minserve.course.check import passes
from minserve.course.checks_ch00_rope import ROPE_CHECKS
from minserve.course.nonfinite import lead_with_nonfinite
from minserve.loader import build_model
from minserve.model.hf_loader import config_from_hf
from minserve.model.ops import ModelOps

# float32 agrees to float noise; bfloat16 has 8 bits of mantissa (relative error ~0.4%)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _random(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


def _assert_close(name: str, got: object, expected: torch.Tensor, what: str) -> None:
    """`got` must be a tensor of expected's shape and dtype, equal within the dtype's tolerance."""
    where = f"{name} on {what}"
    assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
    assert got.shape == expected.shape, (
        f"{where}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    )
    assert got.dtype == expected.dtype, f"{where}: expected dtype {expected.dtype}, got {got.dtype}"
    tol = TOLERANCE[expected.dtype]
    error = (got.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert error <= tol * max(1.0, scale), lead_with_nonfinite(
        got,
        f"{where}: largest difference from the reference is {error:.3g} (tolerance "
        f"{tol * max(1.0, scale):.3g}); first row expected {expected.reshape(-1)[:4].tolist()}, "
        f"got {got.reshape(-1)[:4].tolist()}",
    )


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def check_rms_norm_matches_torch(impl: ModuleType) -> None:
    """rms_norm of x [2, 5, 64] matches torch's RMSNorm, in float32 and in bfloat16."""
    for dtype in (torch.float32, torch.bfloat16):
        x = _random(2, 5, 64, dtype=dtype) * 3
        weight = (1 + 0.1 * _random(64, seed=1)).to(dtype)
        what = f"x [2, 5, 64] {dtype}, eps 1e-6"
        got = impl.rms_norm(x, weight, 1e-6)
        _assert_close("rms_norm", got, _rms_norm_reference(x, weight, 1e-6), what)


def check_rms_norm_uses_eps_and_ignores_scale(impl: ModuleType) -> None:
    """Scaling a row leaves its norm unchanged; eps keeps a zero row at zero (not NaN)."""
    x, weight = _random(3, 16), torch.ones(16)
    _assert_close("rms_norm", impl.rms_norm(100 * x, weight, 1e-6), impl.rms_norm(x, weight, 1e-6),
                  "x and 100 * x [3, 16] (the norm divides the scale out)")  # fmt: skip
    zero = impl.rms_norm(torch.zeros(1, 16), weight, 1e-6)
    _assert_close("rms_norm", zero, torch.zeros(1, 16), "a row of zeros, eps 1e-6")


def _rope_factors(num_tokens: int, head_dim: int, start: int = 0) -> tuple[torch.Tensor, ...]:
    """cos, sin [T, 1, head_dim] for positions start.. (theta 10000, halves repeated)."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(start, start + num_tokens).float()[:, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # [T, 1, head_dim]
    return angles.cos(), angles.sin()


def check_rope_matches_transformers(impl: ModuleType) -> None:
    """apply_rope on q [6, 4, 32] matches transformers' apply_rotary_pos_emb (fp32 and bf16)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = _rope_factors(6, 32, start=3)
    for dtype in (torch.float32, torch.bfloat16):
        q = _random(6, 4, 32, dtype=dtype)
        expected, _ = apply_rotary_pos_emb(q, q, cos[:, 0].to(dtype), sin[:, 0].to(dtype), 1)
        got = impl.apply_rope(q, cos.to(dtype), sin.to(dtype))
        _assert_close("apply_rope", got, expected, f"q [6, 4, 32] {dtype}, positions 3..8")


def check_rope_depends_on_relative_position(impl: ModuleType) -> None:
    """q at m and k at n score the same as q at m + 5 and k at n + 5 (only m - n matters)."""
    q, k = _random(1, 1, 32), _random(1, 1, 32, seed=1)
    scores = []
    for shift in (0, 5):
        q_at = impl.apply_rope(q, *_rope_factors(1, 32, start=7 + shift))
        k_at = impl.apply_rope(k, *_rope_factors(1, 32, start=2 + shift))
        scores.append((q_at * k_at).sum().item())
    assert abs(scores[0] - scores[1]) < 1e-4, (
        f"q . k with q at 7, k at 2: {scores[0]:.6f}; both moved on by 5 (12, 7): expected "
        f"the same score, got {scores[1]:.6f}; RoPE must rotate each pair by the same angle"
    )


def check_swiglu_matches_torch(impl: ModuleType) -> None:
    """swiglu(gate, up) on [5, 128] matches silu(gate) * up, in float32 and in bfloat16."""
    for dtype in (torch.float32, torch.bfloat16):
        gate, up = _random(5, 128, dtype=dtype) * 4, _random(5, 128, dtype=dtype, seed=1)
        expected = (F.silu(gate.float()) * up.float()).to(dtype)
        _assert_close("swiglu", impl.swiglu(gate, up), expected, f"gate, up [5, 128] {dtype}")


def _attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int):
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(start, start + n)[:, None]  # [n, ctx]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        attn_mask=mask, enable_gqa=True,
    )  # fmt: skip
    return out.transpose(0, 1).to(q.dtype)  # [n, Hq, D]


def check_attend_matches_torch(impl: ModuleType) -> None:
    """attend: 8 query heads over 2 KV heads, for a prefill, an extend and a decode."""
    for n, start, dtype in ((6, 0, torch.float32), (4, 5, torch.float32), (1, 9, torch.bfloat16)):
        q = _random(n, 8, 16, dtype=dtype)
        k, v = (
            _random(start + n, 2, 16, dtype=dtype, seed=1),
            _random(start + n, 2, 16, dtype=dtype, seed=2),
        )
        what = f"q [{n}, 8, 16], k and v [{start + n}, 2, 16] {dtype}, start {start}"
        _assert_close(
            "attend", impl.attend(q, k, v, start), _attend_reference(q, k, v, start), what
        )


def check_attend_is_causal(impl: ModuleType) -> None:
    """Changing the last key and value changes only the last query's output."""
    q, k, v = _random(5, 4, 16), _random(5, 2, 16, seed=1), _random(5, 2, 16, seed=2)
    before = impl.attend(q, k, v, 0)
    k2, v2 = k.clone(), v.clone()
    k2[-1], v2[-1] = 10.0, 10.0
    after = impl.attend(q, k2, v2, 0)
    changed = [i for i in range(5) if not torch.allclose(before[i], after[i])]
    assert changed == [4], (
        "attend over 5 tokens (start 0), with the last key and value changed: expected only "
        f"query 4's output to change, got changes in queries {changed}; query i may see keys 0..i"
    )


def _tiny_llama():
    """A seeded random 2-layer Llama (GQA: 4 query heads, 2 KV heads) and its ModelConfig."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_config).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf_config.save_pretrained(folder)
        config = config_from_hf(Path(folder))
    return hf, config


def check_whole_forward_matches_transformers(impl: ModuleType) -> None:
    """Your pieces inside a tiny random Llama: the logits of a prefill of 6 tokens
    and two decodes match transformers' for the same weights."""
    hf, config = _tiny_llama()
    ids = torch.tensor([5, 17, 99, 3, 64, 12, 40, 7])
    with torch.inference_mode():
        expected = hf(ids[None]).logits[0]  # [8, vocab]
        net = build_model(config, hf.state_dict(), torch.float32, torch.device("cpu"), fuse=True)
        net.use_ops(ModelOps.from_module(impl))
        kv = SequenceKV(config, len(ids), torch.float32, torch.device("cpu"))
        hidden = []
        for start, n in ((0, 6), (6, 1), (7, 1)):  # a prefill, then two decodes
            attention = ContiguousAttention([ContiguousSlice(kv, start, n)], impl.attend)
            hidden.append(net(ids[start : start + n], torch.arange(start, start + n), attention))
        got = net.compute_logits(torch.cat(hidden))
    error = (got - expected).abs().max().item()
    assert error < 1e-4, lead_with_nonfinite(
        got,
        "tiny Llama (2 layers, hidden 64, 4 query heads over 2 KV heads), logits [8, 128] of "
        f"a 6-token prefill and 2 decodes: largest difference from transformers is {error:.3g} "
        f"(expected < 1e-4); token 0's first logits expected {expected[0, :4].tolist()}, "
        f"got {got[0, :4].tolist()}",
    )


MODEL_CHECKS: list[Callable[[ModuleType], None]] = [
    check_rms_norm_matches_torch,
    check_rms_norm_uses_eps_and_ignores_scale,
    check_rope_matches_transformers,
    check_rope_depends_on_relative_position,
    check_swiglu_matches_torch,
    check_attend_matches_torch,
    check_attend_is_causal,
    check_whole_forward_matches_transformers,
]


def passes_model_checks(impl: ModuleType) -> bool:
    """Whether `impl`'s model pieces (0.1-0.4 and 0.9, RoPE's frequencies) pass their checks
    (the notebook's fallback switch)."""
    return passes(impl, MODEL_CHECKS + ROPE_CHECKS)


HINTS: dict[str, tuple[str, str, str]] = {
    "0.1": (
        "RMSNorm divides each vector by its root mean square, then scales it per dimension.",
        "Work in float32: square, mean over the last dim, add eps, reciprocal square root, "
        "multiply; cast back to x's dtype before multiplying by the weight.",
        "x32 = x.float(); inv = torch.rsqrt((x32 * x32).mean(dim=-1, keepdim=True) + eps); "
        "then weight times (x32 * inv) cast to x.dtype.",
    ),
    "0.2": (
        "RoPE turns each pair of dimensions by an angle proportional to the token's position, "
        "so q . k depends only on how far apart the two tokens are.",
        "Split the last dim into halves x1 and x2 (the pairs are (x1[i], x2[i])); build the "
        "'rotated' vector (-x2, x1); mix x and it with cos and sin (they broadcast over "
        "heads).",
        "x1, x2 = x[..., :half], x[..., half:]; rotated = torch.cat([-x2, x1], -1); "
        "the answer is x * cos plus rotated * sin.",
    ),
    "0.3": (
        "SwiGLU gates one projection with the SiLU of another: up carries the content, "
        "silu(gate) decides how much of it passes.",
        "silu(g) = g * sigmoid(g), elementwise; multiply by up. No reshapes needed.",
        "torch.sigmoid(gate) * gate gives silu; multiply that by up.",
    ),
    "0.4": (
        "Each query scores every key it may see (its own position and earlier), softmaxes the "
        "scores and averages the values; groups of query heads share one KV head (GQA).",
        "Repeat each KV head g = Hq // Hkv times along the head dim; scores [Hq, n, ctx] = "
        "q . k / sqrt(D) in float32; mask keys at positions > start + i with -inf; softmax "
        "over keys; weighted sum of v; back to q's dtype.",
        "kh = k.repeat_interleave(g, dim=1).transpose(0, 1) -> [Hq, ctx, D]; "
        "scores = q.transpose(0, 1).float() @ kh.float().transpose(1, 2) / math.sqrt(D); "
        "a boolean [n, ctx] of key position > start + query index; softmax; @ v.",
    ),
}
