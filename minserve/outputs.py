"""What `LLM.generate` returns, in vLLM's shapes, and the deltas each engine step gives.

One `RequestOutput` per prompt, holding one `CompletionOutput` per sample (`n`). An engine
step returns the same shapes holding only what is new (a delta: this step's text, token ids
and logprobs, of the samples that got tokens); `OutputAccumulator` adds the deltas up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """One token's entry in `RequestOutput.prompt_logprobs` (vLLM's `Logprob`): its logprob,
    its rank in the model's distribution (1: the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token: None for the first (nothing predicts it), then token id ->
# Logprob for the prompt's token and the top-k alternatives.
PromptLogprobsList = list[dict[int, Logprob] | None]


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

    def add(self, delta: CompletionOutput) -> None:
        """Append the same sample's next delta."""
        self.text += delta.text
        self.token_ids += delta.token_ids
        if self.logprobs is not None and delta.logprobs is not None:
            self.logprobs += delta.logprobs
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        self.cumulative_logprob = delta.cumulative_logprob

    def copy(self) -> CompletionOutput:
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return dataclasses.replace(self, token_ids=list(self.token_ids), logprobs=logprobs)


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
    # With SamplingParams(prompt_logprobs=k): the request's first output carries them all
    # (the prompt is scored before its first token); later deltas hold None.
    prompt_logprobs: PromptLogprobsList | None = None


class OutputAccumulator:
    """Adds up each request's deltas into its whole output so far (offline and non-streaming
    callers want whole outputs; a stream sends the deltas as they are)."""

    def __init__(self) -> None:
        self.outputs: dict[str, RequestOutput] = {}  # request id -> whole output so far

    def add(self, delta: RequestOutput) -> RequestOutput:
        """Fold in one step's delta; returns the request's whole output so far."""
        whole = self.outputs.get(delta.request_id)
        if whole is None:
            whole = dataclasses.replace(delta, prompt_token_ids=list(delta.prompt_token_ids),
                                        outputs=[])  # fmt: skip
            self.outputs[delta.request_id] = whole
        samples = {c.index: c for c in whole.outputs}
        for completion in delta.outputs:
            if completion.index in samples:
                samples[completion.index].add(completion)
            else:
                whole.outputs.append(completion.copy())
        whole.outputs.sort(key=lambda c: c.index)
        whole.finished, whole.metrics = delta.finished, delta.metrics
        whole.num_cached_tokens = delta.num_cached_tokens
        return whole
