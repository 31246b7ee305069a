"""A request's life after sampling: append the token, detokenize, check every stop rule.

One `Request` holds `n` `Sample`s (vLLM's `n`): each is one sequence with its own output
tokens, text, random generator and finish reason. Both engines (the paged one, through
`Scheduler.update_from_output`, and the contiguous reference path) feed sampled tokens
through `Sample.append` and read the result with `Request.to_output`, so stop handling is
written once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from minserve.errors import PromptTooLongError
from minserve.model.detokenizer import IncrementalDetokenizer
from minserve.model.sampler import SamplingRow
from minserve.model.tokenizer import Tokenizer
from minserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minserve.sampling_params import SamplingParams
from minserve.stop_strings import StopStringMatcher


@dataclass(frozen=True)
class StopRules:
    """What ends a sequence besides its own SamplingParams."""

    eos_token_ids: tuple[int, ...]
    max_model_len: int


@dataclass
class Sample:
    """One generated sequence: its tokens, streamed text and why it stopped."""

    index: int
    params: SamplingParams
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the length of this sequence's KV."""
        return len(self.prompt_token_ids) + len(self.token_ids)

    def sampling_row(self, rules: StopRules) -> SamplingRow:
        return SamplingRow(
            params=self.params,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.token_ids,
            generator=self.generator,
            eos_token_ids=() if self.params.ignore_eos else rules.eos_token_ids,
        )

    def append(self, token_id: int, logprobs: dict[int, float] | None, rules: StopRules) -> None:
        """Add one sampled token and apply the stop rules in vLLM's order."""
        self.token_ids.append(token_id)
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs)
        if self._stops_on_token(token_id, rules):  # its text is not part of the output
            self._finish("stop", None if token_id in rules.eos_token_ids else token_id)
            return
        emitted, matched = self.stops.feed(self.detokenizer.step(token_id))
        self.text += emitted
        if matched is not None:
            self._finish("stop", matched, flush=False)
        elif self._at_length_limit(rules):
            self._finish("length", None)

    def abort(self) -> None:
        if not self.finished:
            self._finish("abort", None)

    def _stops_on_token(self, token_id: int, rules: StopRules) -> bool:
        if len(self.token_ids) < self.params.min_tokens:
            return False  # the sampler also masks these tokens until then
        eos = not self.params.ignore_eos and token_id in rules.eos_token_ids
        return eos or token_id in (self.params.stop_token_ids or ())

    def _at_length_limit(self, rules: StopRules) -> bool:
        limit = self.params.max_tokens
        return (limit is not None and len(self.token_ids) >= limit) or (
            self.num_tokens >= rules.max_model_len
        )

    def _finish(self, reason: str, stop_reason: int | str | None, flush: bool = True) -> None:
        if flush:  # release text held back for an open character or a possible stop string
            emitted, _ = self.stops.feed(self.detokenizer.flush())
            self.text += emitted + self.stops.flush()
        self.finish_reason, self.stop_reason = reason, stop_reason

    def to_output(self) -> CompletionOutput:
        cumulative = None
        if self.logprobs is not None:
            cumulative = sum(lp[t] for lp, t in zip(self.logprobs, self.token_ids, strict=False))
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            cumulative_logprob=cumulative,
        )


@dataclass
class Request:
    """A prompt and its `n` samples, with the timestamps the metrics need."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Sample]
    metrics: RequestMetrics
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (set on start)

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
    ) -> Request:
        samples = [
            Sample(
                index=i,
                params=params,
                prompt_token_ids=prompt_token_ids,
                detokenizer=IncrementalDetokenizer(
                    tokenizer, prompt_token_ids, params.skip_special_tokens
                ),
                stops=StopStringMatcher(params.stop_strings, params.include_stop_str_in_output),
                generator=_generator(params.seed, i),
                logprobs=[] if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]
        metrics = RequestMetrics(arrival_time=time.monotonic())
        return cls(request_id, prompt, prompt_token_ids, params, samples, metrics)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def record_token_time(self) -> None:
        now = time.monotonic()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        if self.finished and self.metrics.finished_time is None:
            self.metrics.finished_time = now

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[s.to_output() for s in self.samples],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens or 0,
        )


def _generator(seed: int | None, index: int) -> torch.Generator | None:
    """A per-sample RNG so seeded results do not depend on what else is in the batch."""
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def validate_prompt(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Reject a prompt the engine cannot run, saying why (with the numbers)."""
    if not token_ids:
        raise ValueError("prompt is empty: give at least one token")
    bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    if len(token_ids) >= max_model_len:  # leave room for at least one new token
        raise PromptTooLongError(len(token_ids), max_model_len)
