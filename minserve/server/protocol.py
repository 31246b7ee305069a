"""The OpenAI request bodies the server accepts, as strict pydantic models.

Every field is honoured or the request is refused: unknown fields (`tools`, `suffix`,
...) are rejected with 400 rather than silently ignored, and values must have
their JSON type ("5" is not a number). Two rules follow JSON's number model rather than
Python's: an integral float (2.0) is an integer, as OpenAI's API takes it, and numbers are
finite (Python's JSON reader would take `Infinity`, `NaN` and 1e999). Integers fit in 64
bits, what the engine's tensors and random generators hold.

The ranges of the sampling options are checked once, by `SamplingParams`, and written into
the JSON schema (`bounds`), so /openapi.json tells clients what is allowed.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic_core import PydanticCustomError

from minserve.sampling_params import (
    LOGIT_BIAS_RANGE,
    TEMPERATURE_RANGE,
    SamplingParams,
    StructuredOutputsParams,
)
from minserve.sampling_params import OPENAI_PENALTY_RANGE as PENALTY
from minserve.sampling_params import REPETITION_PENALTY_RANGE as REPETITION
from minserve.scheduler.policy import SLO_CLASSES

MAX_N = 16  # samples per request: a cap so that one request cannot take every seat
MAX_LOGPROBS = 20  # vLLM's cap on top logprobs per token
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1  # a seed may be given signed or unsigned


def _integral(value: object, low: int, high: int) -> object:
    """2.0 -> 2; refuse 2.5, inf, nan and integers outside [low, high]."""
    if isinstance(value, float):
        if not value.is_integer():
            raise PydanticCustomError("int_from_float", "must be an integer, got {value}",
                                      {"value": value})  # fmt: skip
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and not low <= value <= high:
        raise PydanticCustomError("int_range", "must be an integer in [{low}, {high}]",
                                  {"low": low, "high": high})  # fmt: skip
    return value  # anything else meets the strict int check: "5" and true are refused


def integer(low: int = INT64_MIN, high: int = INT64_MAX) -> Any:
    """An integer field in [low, high] that also takes an integral float, as JSON counts it."""
    return Annotated[
        int,
        BeforeValidator(partial(_integral, low=low, high=high)),
        schema({"type": "integer", "minimum": low, "maximum": high}),
    ]


def schema(json_schema: dict) -> WithJsonSchema:
    """The JSON schema of a field whose rules pydantic's own schema cannot say."""
    return WithJsonSchema(json_schema)


Int64 = integer()
Seed = integer(INT64_MIN, UINT64_MAX)
INT64 = {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}
TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": INT64_MAX}
TEXT = {"type": "string", "minLength": 1}  # empty stop strings and prompts are refused
Stop = Annotated[str | list[str], schema({"anyOf": [TEXT, {"type": "array", "items": TEXT}]})]
TokenIds = Annotated[list[Int64], schema({"type": "array", "items": TOKEN_ID})]
Priority = Annotated[Int64 | str, schema({"anyOf": [INT64, {"enum": list(SLO_CLASSES)}]})]
Prompt = Annotated[
    str | list[str] | list[Int64] | list[list[Int64]],
    schema({"anyOf": [
        TEXT,  # one prompt
        {"type": "array", "items": TEXT, "minItems": 1},  # a batch of prompts
        {"type": "array", "items": TOKEN_ID, "minItems": 1},  # one prompt's token ids
        {"type": "array", "minItems": 1,
         "items": {"type": "array", "items": TOKEN_ID, "minItems": 1}},  # a batch of them
    ]}),
]  # fmt: skip


LogitBias = Annotated[
    dict[str, float],
    schema({
        "type": "object", "propertyNames": {"pattern": "^(0|[1-9][0-9]*)$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    }),
]  # fmt: skip


_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]*")  # a token id as a JSON key: no sign, no leading 0


def token_biases(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids written as JSON keys) -> {token id: bias}; a
    ValueError naming a key that is not a token id (SamplingParams checks the biases)."""
    if logit_bias is None:
        return None
    bad = [key for key in logit_bias if not _TOKEN_ID_KEY.fullmatch(key)]
    if bad:
        raise ValueError(f'logit_bias keys must be token ids such as "1234", got {bad[0]!r}')
    return {int(key): bias for key, bias in logit_bias.items()}


def check_logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> None:
    """A ValueError naming a `logit_bias` key that is not one of the model's token ids, or
    a bias outside [-100, 100]."""
    biases = token_biases(logit_bias) or {}
    bad = [token_id for token_id in biases if token_id >= vocab_size]
    if bad:
        raise ValueError(
            f"logit_bias keys must be in [0, {vocab_size}), the model's vocabulary; got {bad[:5]}"
        )
    low, high = LOGIT_BIAS_RANGE
    for token_id, bias in biases.items():
        if not low <= bias <= high:
            raise ValueError(f"logit_bias[{token_id}] must be in [{low:g}, {high:g}], got {bias}")


def bounds(**keywords: float) -> Any:
    """JSON-schema bounds of a field whose range `SamplingParams` checks."""
    names = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum"}
    return {names[k]: v for k, v in keywords.items()}


def inside(closed: tuple[float, float]) -> Any:
    """JSON-schema bounds of a closed range `SamplingParams` checks (one source of truth)."""
    return bounds(ge=closed[0], le=closed[1])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of json (a schema), regex, choice, grammar
    (EBNF), json_object; with disable_any_whitespace and whitespace_pattern."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")  # "json": BaseModel's
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_schema, regex=self.regex, choice=self.choice, grammar=self.grammar,
            json_object=self.json_object, disable_any_whitespace=self.disable_any_whitespace,
            whitespace_pattern=self.whitespace_pattern,
        )  # fmt: skip


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`: the schema is always enforced (`strict` or
    not: the grammar allows nothing else)."""

    name: str
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")  # "schema": BaseModel's
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: text (free), json_object (any JSON object) or
    json_schema (JSON valid against `json_schema.schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def params(self) -> StructuredOutputsParams | None:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema goes with "type": "json_schema", and only there')
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is not None:
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return None


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    model: str | None = None
    n: integer(1, MAX_N) = 1
    temperature: float = Field(1.0, json_schema_extra=inside(TEMPERATURE_RANGE))
    top_p: float = Field(1.0, json_schema_extra=bounds(gt=0, le=1))
    top_k: Int64 = Field(0, json_schema_extra=bounds(ge=-1))
    min_p: float = Field(0.0, json_schema_extra=bounds(ge=0, le=1))
    presence_penalty: float = Field(0.0, json_schema_extra=inside(PENALTY))
    frequency_penalty: float = Field(0.0, json_schema_extra=inside(PENALTY))
    repetition_penalty: float = Field(1.0, json_schema_extra=inside(REPETITION))
    seed: Seed | None = None
    stop: Stop | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = Field(0, json_schema_extra=bounds(ge=0))
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Priority | None = None  # an int (lower first) or an SLO class name
    user: str | None = None  # an end-user id for the caller's own logs; not used here
    structured_outputs: StructuredOutputs | None = None  # vLLM's: json, regex, choice, ...
    logit_bias: LogitBias | None = None  # OpenAI's: {"token id": bias in [-100, 100]}
    # vLLM's: every choice (and streamed chunk) lists its token ids; the prompt's come too
    return_token_ids: bool = False
    # minserve's: continue a request after the tokens it generated elsewhere
    resume_token_ids: TokenIds | None = None

    @property
    def resumes(self) -> bool:
        """The request continues one that generated `resume_token_ids` already (a stream
        that already showed its role, its prompt's echo and the text of those tokens)."""
        return bool(self.resume_token_ids)

    @property
    def max_tokens_param(self) -> str:
        """The field that bounds the output, as named in errors."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def echoes_prompt(self) -> bool:
        """Each choice starts with its prompt (/v1/completions' `echo`)."""
        return False

    @property
    def prompt_only(self) -> bool:
        """max_tokens 0: no generated text (the engine's one token dropped)."""
        return False

    @property
    def structured_field(self) -> str:
        """The field that asked for structured output, as named in errors."""
        return "structured_outputs"

    def structured_output_params(self) -> StructuredOutputsParams | None:
        """The constraint on the output; ValueError when it is malformed."""
        return None if self.structured_outputs is None else self.structured_outputs.params()

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Raises ValueError naming the parameter (SamplingParams validates the ranges)."""
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_output_params(),
            logit_bias=token_biases(self.logit_bias),
        )


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions: one prompt or a batch (text or token ids)."""

    prompt: Prompt
    max_tokens: Int64 | None = Field(16, json_schema_extra=bounds(ge=0))  # 0: prompt only
    logprobs: integer(0, MAX_LOGPROBS) | None = None
    echo: bool = False

    @property
    def echoes_prompt(self) -> bool:
        return self.echo and not self.resumes  # the stream being continued echoed it

    @property
    def prompt_only(self) -> bool:
        return self.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        """With echo and logprobs, the prompt's tokens are scored too (prompt_logprobs).
        max_tokens 0 runs one token that the response leaves out: with echo, the prompt
        alone (lm-eval's loglikelihood requests); without, an empty completion."""
        max_tokens = 1 if self.prompt_only else self.max_tokens
        prompt_logprobs = self.logprobs if self.echoes_prompt else None
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The batch as a list: each item is a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt is empty: give a string, a list of strings or token ids")
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """{"role", "content"} with content parts joined: what chat templates expect."""
        content = self.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = Field(None, json_schema_extra=bounds(ge=1))
    max_completion_tokens: Int64 | None = Field(None, json_schema_extra=bounds(ge=1))
    logprobs: bool = False
    top_logprobs: integer(0, MAX_LOGPROBS) | None = None
    response_format: ResponseFormat | None = None

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def structured_field(self) -> str:
        return "structured_outputs" if self.response_format is None else "response_format"

    def structured_output_params(self) -> StructuredOutputsParams | None:
        if self.response_format is None:
            return super().structured_output_params()
        if self.structured_outputs is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        return self.response_format.params()

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        top = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, top)
