"""What `LLM.generate` returns, in vLLM's shapes.

One `RequestOutput` per prompt, holding one `CompletionOutput` per sample (`n`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    """One generated sequence of a request (one of its `n` samples)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS, stop token or string), "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # One dict per generated token: token id -> logprob, holding the top-N and the sampled one.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic seconds) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The result (or, while streaming, the progress) of one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
