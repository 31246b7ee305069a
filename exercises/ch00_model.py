# Your workspace for chapter 00 (The model we serve): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 00` from the repository root.
# Generated from minserve/model/ops.py, minserve/attention/contiguous.py, minserve/model/sampler.py, minserve/model/rope.py by `python -m minserve.course.generate`.
# stub fingerprint: ad33eea664c1 (lets the generator tell your edits from a stale stub)
"""Chapter 00, The model we serve: the decoder's math and the sampler's filters.

0.1-0.4 are the model's math (RMSNorm, RoPE, SwiGLU, grouped-query causal
attention); plug them into the engine with
`LLM(plugins=CoursePlugins(model_ops=ModelOps.from_module(module)))`. 0.5-0.7 are
the sampler's filters (top-k, top-p, min-p): each takes logits [rows, vocab] and
one setting per row and returns new logits in which the tokens it rejects are
-inf; plug them in with
`LLM(plugins=CoursePlugins(sampler=Sampler.from_module(module)))`. 0.8 is the
sampler's repetition, frequency and presence penalties; `Sampler.from_module`
takes it too. 0.9 is
RoPE's frequencies (with Llama 3's scaling); `ModelOps.from_module` takes it
with 0.1-0.4, and the model's rotary embedding uses it.
"""

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from minserve.model.sampler import (  # noqa: F401  (used by 0.8)
    FLOAT32_MAX,
    SamplingRow,
    flat_token_ids,
    has_penalties,
    per_row,
)
from minserve.model_config import ModelConfig


# Exercise 0.1: RMSNorm
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm over the last dim: x [..., dim], weight [dim] -> [..., dim].

    Divide each row by sqrt(mean(x^2) + eps), computed in float32 whatever x's dtype;
    cast the normed row back to x's dtype, then scale it by `weight` (no mean
    subtraction, no bias: that is what sets RMSNorm apart from LayerNorm).
    """
    raise NotImplementedError("Exercise 0.1: RMSNorm")


# Exercise 0.2: rotary position embedding (RoPE)
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate q or k by each token's position: x [T, heads, head_dim] -> same shape.

    cos and sin are [T, 1, head_dim] (broadcast over heads), the cosines and sines of
    position * frequency with the head_dim / 2 frequencies written twice. "Rotate half"
    layout (Hugging Face's): dim i and dim i + head_dim / 2 form a pair, rotated by
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    """
    raise NotImplementedError("Exercise 0.2: rotary position embedding (RoPE)")


# Exercise 0.3: SwiGLU
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The MLP's gated activation: silu(gate) * up, elementwise, [T, inner] -> [T, inner].

    silu(g) = g * sigmoid(g). The MLP computes gate = x W_gate and up = x W_up, then
    down(swiglu(gate, up)). Keep the inputs' dtype.
    """
    raise NotImplementedError("Exercise 0.3: SwiGLU")


# Exercise 0.4: grouped-query causal attention
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal GQA attention of q [n, Hq, D] over k, v [start + n, Hkv, D] -> [n, Hq, D].

    The queries sit at positions start..start+n-1; query i may see keys 0..start+i.
    Hq is a multiple of Hkv: query heads h*g .. h*g+g-1 (g = Hq // Hkv) share KV head h.
    Scores are q . k / sqrt(D), softmaxed over the keys each query may see, in float32;
    the output is the softmax-weighted sum of v rows, in q's dtype.
    """
    raise NotImplementedError("Exercise 0.4: grouped-query causal attention")


# Exercise 0.5: top-k filtering
def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k largest logits of each row and set the others to -inf.

    Top-k cuts off the long tail: each of 50k unlikely tokens is rare, but together they
    are drawn often enough to derail a generation. `logits` is [rows, vocab]; `top_k` is
    int64 [rows], one k per row, where k <= 0 turns the filter off for that row and
    k >= vocab keeps every token. Tokens tied with the k-th largest logit are all kept (as
    in Hugging Face and vLLM), so the result depends on the values, never on token ids.
    Returns a new tensor; `logits` is left unchanged.
    """
    raise NotImplementedError("Exercise 0.5: top-k filtering")


# Exercise 0.6: top-p (nucleus) filtering
def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the nucleus: the fewest most-probable tokens whose probabilities sum to >= p.

    Unlike a fixed k, the nucleus follows the model's confidence: one token when it is
    sure, hundreds when it is not (Holtzman et al., 2019). `logits` is [rows, vocab] and
    may already hold -inf (top-k runs first); `top_p` is float [rows] in (0, 1]. The most
    probable token is always kept. Tokens tied with the least probable kept token are kept
    too, so the result depends on the values, never on token ids. p = 1.0 turns the
    filter off: that row comes back unchanged, even tokens whose probability underflows
    to 0 in float32. Tip: in float32, sum the small probabilities first (sort ascending
    and drop the prefix whose cumulative probability is <= 1 - p).
    Returns a new tensor; `logits` is left unchanged.
    """
    raise NotImplementedError("Exercise 0.6: top-p (nucleus) filtering")


# Exercise 0.7: min-p filtering
def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep the tokens at least `min_p` times as probable as the most probable one.

    min-p (Nguyen et al., 2024) scales the cut-off with the model's confidence: a peaked
    distribution keeps few tokens, a flat one keeps many. `logits` is [rows, vocab];
    `min_p` is float [rows] in [0, 1], where 0 turns the filter off for that row. No
    softmax is needed: the normaliser cancels in p_i / p_max = exp(logit_i - logit_max),
    so a token is kept exactly when logit_i >= logit_max + log(min_p).
    Returns a new tensor; `logits` is left unchanged.
    """
    raise NotImplementedError("Exercise 0.7: min-p filtering")


# Exercise 0.8: repetition, frequency and presence penalties
def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition (HF / vLLM), frequency and presence (OpenAI) penalties, on a copy.

    The repetition penalty r touches every token seen in the prompt or the output, once
    however often it was seen: positive logits are divided by r and negative ones
    multiplied, so r > 1 always makes a seen token less likely. Frequency and presence look
    at output tokens only: logit -= frequency * count + presence * (count > 0). `logits`
    is [rows, vocab]; row i's settings are `rows[i].params`. A row without penalties
    (`has_penalties`) is left as it is; with none in the batch, `logits` itself may be
    returned. Only seen tokens change, so work on those (hundreds) rather than on the whole
    vocabulary (tens of thousands): `flat_token_ids` gives their positions in the flat
    logits, `per_row` a setting per row. A -inf logit (a forbidden token) stays -inf; a
    penalty below 1 raises positive logits, and one past float32's range is kept at its
    largest value (FLOAT32_MAX) rather than +inf, which would leave nothing to draw from.
    """
    raise NotImplementedError("Exercise 0.8: repetition, frequency and presence penalties")


# Exercise 0.9: RoPE's frequencies, with Llama 3's long-context scaling
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
    raise NotImplementedError("Exercise 0.9: RoPE's frequencies, with Llama 3's long-context scaling")
