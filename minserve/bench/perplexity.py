"""Perplexity over a text: exp of the mean negative log-likelihood of its tokens.

The text's token ids are cut into windows of at most `window` tokens, `stride` apart (Hugging
Face's "Perplexity of fixed-length models" guide). Each window runs as one prompt with
`prompt_logprobs=0`, and only the tokens no earlier window scored count: with a stride
shorter than the window, the overlap is context for the window's tail. A window's first
token has no context in it: the text's first token is never scored, and without overlap
(stride = window) neither is any window's first token.

    window 0: [t0 ............ t7]         scores t1..t7
    window 1:          [t4 ............ t11]  scores t8..t11   (window 8, stride 4)

The bundled text (`minserve/data/perplexity.txt`, `bundled_text()`) is the opening of
chapter 1 of Jane Austen's *Pride and Prejudice* (1813, public domain; Project Gutenberg
eBook #1342), about 2.7 KB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minserve.llm import LLM


@dataclass(frozen=True)
class Window:
    """One window of the text: token ids [begin, end), scoring tokens [first_scored, end)."""

    begin: int
    end: int
    first_scored: int


@dataclass(frozen=True)
class PerplexityResult:
    """Perplexity, the mean NLL it is the exponential of, and what was scored how."""

    perplexity: float
    mean_nll: float
    num_scored_tokens: int
    num_windows: int
    window: int
    stride: int


def bundled_text() -> str:
    """The English text shipped with minserve for perplexity checks (see the module doc)."""
    return resources.files("minserve").joinpath("data/perplexity.txt").read_text("utf-8")


def windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """Windows of at most `window` tokens starting every `stride` tokens, until one reaches
    the end; each scores the tokens after the previous window's end (Hugging Face's loop)."""
    if num_tokens < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {num_tokens}")
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    out, previous_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        out.append(Window(begin, end, max(previous_end, begin + 1)))
        previous_end = end
        if end == num_tokens:
            break
    return out


def perplexity(llm: LLM, token_ids: list[int], window: int, stride: int) -> PerplexityResult:
    """Perplexity of `token_ids` under `llm`'s model: every window in one `generate` call,
    each prompt scored by its prompt logprobs (the model's raw distribution)."""
    from minserve.sampling_params import SamplingParams

    if window >= llm.max_model_len:
        raise ValueError(
            f"window is {window} tokens; the longest prompt this LLM takes is "
            f"{llm.max_model_len - 1} (max_model_len {llm.max_model_len} - 1)"
        )
    spans = windows(len(token_ids), window, stride)
    params = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
    outputs = llm.generate([token_ids[w.begin : w.end] for w in spans], params, use_tqdm=False)
    nll, num_scored = 0.0, 0
    for w, out in zip(spans, outputs):
        assert out.prompt_logprobs is not None
        for position in range(w.first_scored, w.end):
            entry = out.prompt_logprobs[position - w.begin]
            assert entry is not None
            nll -= entry[token_ids[position]].logprob
            num_scored += 1
    mean = nll / num_scored
    return PerplexityResult(math.exp(mean), mean, num_scored, len(spans), window, stride)
