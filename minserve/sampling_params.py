"""`SamplingParams`: how to pick each next token, shaped like vLLM's so habits carry over.

Every field is either honoured by the engine or rejected here with a message a user can
act on; nothing is silently ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# Temperatures below this count as greedy, as in vLLM: dividing logits by them risks
# float32 overflow, and the distribution is an argmax in all but exact near-ties anyway.
GREEDY_TEMPERATURE = 1e-5

# The accepted ranges of the settings that scale logits. Outside them the effect is
# saturated (at temperature 100 a logit gap of 10 is worth 10%; a repetition penalty of 100
# already takes a seen token's logit of 10 to 0.1) or not representable in float32, the
# sampler's precision (a repetition penalty of 1e-40 underflows to a subnormal, 1e-200 to 0).
TEMPERATURE_RANGE = (0.0, 100.0)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
OPENAI_PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency, as OpenAI documents them
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # as OpenAI documents it


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's names): exactly one of

    - `json`: a JSON schema (a dict, or its text); the output is a JSON value it validates;
    - `regex`: the output matches this regular expression, whole;
    - `choice`: the output is one of these strings;
    - `grammar`: the output is a sentence of this EBNF grammar (GBNF, llama.cpp's
      notation, with a `root` rule);
    - `json_object`: True: the output is a JSON object (any keys).

    `disable_any_whitespace`: JSON on one line, one space after each comma and colon
    (`{"a": 1, "b": 2}`); otherwise up to 16 whitespace characters between JSON tokens.
    `whitespace_pattern` is vLLM's option for the outlines and guidance backends; minserve's
    grammar library (xgrammar) has no such rule, so a pattern is refused when the request
    is added.
    The grammar is compiled when the request is added (`minserve/structured/`); an
    invalid schema, regex or grammar is a ValueError then.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in STRUCTURED_KINDS if getattr(self, name) is not None]
        _check(
            len(kinds) == 1,
            f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KINDS)}; "
            f"got {', '.join(kinds) or 'none'}",
        )
        _check(
            self.json is None or isinstance(self.json, dict | str),
            f"json must be a JSON schema (a dict or its text), got {type(self.json).__name__}",
        )
        _check(self.json_object is not False, "json_object must be true when given")
        _check(
            self.choice is None
            or (bool(self.choice) and all(isinstance(c, str) and c for c in self.choice)),
            f"choice must be a non-empty list of non-empty strings, got {self.choice!r}",
        )
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except json.JSONDecodeError as error:
                raise ValueError(f"json is not a valid JSON schema text: {error}") from None


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding options (vLLM names and defaults).

    temperature 0 (anything below GREEDY_TEMPERATURE) means greedy. top_k <= 0 (0 or -1)
    and top_p = 1 and min_p = 0 mean "off". A seed is any integer (taken modulo 2**64).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    # Per prompt token after the first: its logprob given the tokens before it, plus the
    # top `prompt_logprobs` alternatives (`RequestOutput.prompt_logprobs`); 0: the token's own.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # a JSON schema, regex, choice or grammar the output must follow (None: free text)
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's: {token id: bias in [-100, 100]} added to that token's logit before sampling
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        self._validate()

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple, whether it was given as one string, a list or None."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def _validate(self) -> None:
        _check(self.n >= 1, f"n must be at least 1, got {self.n}")
        _check_range("temperature", self.temperature, *TEMPERATURE_RANGE)
        _check(
            math.isfinite(self.top_p) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p}",
        )
        _check(self.top_k >= -1, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, *OPENAI_PENALTY_RANGE)
        _check_range("frequency_penalty", self.frequency_penalty, *OPENAI_PENALTY_RANGE)
        _check_range("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        _check(
            self.logprobs is None or self.logprobs >= 0,
            f"logprobs must be >= 0, got {self.logprobs}",
        )
        _check(
            self.prompt_logprobs is None or self.prompt_logprobs >= 0,
            f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}",
        )
        _check(
            all(self.stop_strings),
            f"stop must not contain empty strings, got {self.stop!r}",
        )
        _check(
            all(t >= 0 for t in self.stop_token_ids or ()),
            f"stop_token_ids must be non-negative, got {self.stop_token_ids}",
        )
        for token_id, bias in (self.logit_bias or {}).items():
            _check(
                isinstance(token_id, int) and token_id >= 0,
                f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}",
            )
            _check_range(f"logit_bias[{token_id}]", bias, *LOGIT_BIAS_RANGE)
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams, got "
            f"{type(self.structured_outputs).__name__}",
        )

    @property
    def greedy(self) -> bool:
        """Take the argmax instead of sampling (temperature 0, or below GREEDY_TEMPERATURE)."""
        return self.temperature < GREEDY_TEMPERATURE


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_range(name: str, value: float, low: float, high: float) -> None:
    """`value` is a finite number in [low, high] (NaN and infinities are refused too)."""
    _check(
        math.isfinite(value) and low <= value <= high,
        f"{name} must be in [{low:g}, {high:g}], got {value}",
    )
