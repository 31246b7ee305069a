"""The output processor: new token ids in, what the caller sees out (vLLM v1's OutputProcessor).

After each step the scheduler reports, per sample, the tokens it gained (`NewTokens`, in
its `SchedulerUpdate`). This turns them into deltas: the text they add (incremental
detokenization, `model/detokenizer.py`), cut at the first stop string (`stop_strings.py`),
with their logprobs and the finish reason.

    NewTokens ──► SampleOutput.update ──► CompletionOutput (this step's part only)
                        │
                        └─ a stop string ended the sample: `OutputStops` tells the scheduler

A step's result is one `RequestOutput` per request that got tokens, holding only what is
new (a delta). The server streams deltas as they are; `LLM.generate` adds them up
(`outputs.OutputAccumulator`). This is chapter 09's exercise 9.4 (the marked region below).

A request resumed from its journal (`resume_token_ids`) has its samples primed with those
tokens at `add_request`: they go through the same `update` as sampled tokens, and what it
shows is dropped (the stream being continued showed it). The detokenizer's window and the
stop-string matcher's held-back tail are then exactly the uninterrupted run's, so the deltas
that follow are too (a character split across the resume point, a stop string spanning it).
Resume tokens that finish the request already (a stop string, EOS, max_tokens) give a final
output with no new text, returned by the next step (`take_ready`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from minserve.errors import ResumeTokensError
from minserve.messages import NewTokens, OutputStops, PromptLogprobs, SchedulerUpdate
from minserve.model.detokenizer import IncrementalDetokenizer
from minserve.model.tokenizer import Tokenizer
from minserve.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobsList,
    RequestMetrics,
    RequestOutput,
)
from minserve.sampling_params import SamplingParams
from minserve.stop_strings import StopStringMatcher


# >>> exercise 9.4: from new token ids to a streamed delta
@dataclass
class SampleOutput:
    """What one sample has shown so far: its detokenizer and stop-string matcher hold the
    text still held back; the running logprob sum; why it finished."""

    index: int
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    with_logprobs: bool = False  # the request asked for logprobs
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, new: NewTokens) -> CompletionOutput:
        """This step's delta of the sample: the text `new.token_ids` add, cut at a stop string.

        Feed each token to `self.detokenizer.step(token)` and its text to
        `self.stops.feed(text)`, which returns (text safe to show now, the stop string it
        completed or None). A stop string finishes the sample on the token that completed it
        (finish_reason "stop", stop_reason the string): that token is the delta's last, the
        step's later tokens are dropped. The scheduler may have finished the sample already
        (`new.finish_reason`): "stop" means the last token is EOS or a stop token, whose
        text is never shown; on "stop" and "length" release the held-back text,
        `self.stops.feed(self.detokenizer.flush())` then `self.stops.flush()`.

        The delta (`CompletionOutput`) holds this step's text and kept token ids, their
        logprobs when the request asked for them (`new.logprobs`, else None), the finish and
        stop reasons, and the cumulative logprob of every kept token so far (None without
        logprobs). Record the finish on `self`.
        """
        # >>> solution
        token_ids = list(new.token_ids)
        finish, reason = new.finish_reason, new.stop_reason
        shown = token_ids[:-1] if finish == "stop" else token_ids  # a stop token shows no text
        text = ""
        for i, token in enumerate(shown):
            emitted, matched = self.stops.feed(self.detokenizer.step(token))
            text += emitted
            if matched is not None:
                token_ids, finish, reason = token_ids[: i + 1], "stop", matched
                break
        else:
            if finish is not None:  # release text held back (half a character, a stop prefix)
                emitted, _ = self.stops.feed(self.detokenizer.flush())
                text += emitted + self.stops.flush()
        self.finish_reason, self.stop_reason = finish, reason
        logprobs, cumulative = None, None
        if self.with_logprobs:
            logprobs = [lp for lp in new.logprobs[: len(token_ids)] if lp is not None]
            self.cumulative_logprob += sum(lp[t] for lp, t in zip(logprobs, token_ids))
            cumulative = self.cumulative_logprob
        return CompletionOutput(self.index, text, token_ids, finish, reason, logprobs, cumulative)
        # <<< solution


# <<< exercise


@dataclass
class RequestState:
    """One request's output side: its prompt, its samples' text state, its timestamps."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleOutput]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobsList | None = None  # filled as prompt chunks are scored
    prompt_logprobs_sent: bool = False  # they go out with the request's first output

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def add_prompt_logprobs(self, scored: PromptLogprobs, token_text: Callable[[int], str]) -> None:
        """Record a chunk's scored prompt tokens at their positions (a chunk computed again
        after a preemption writes the same values again)."""
        assert self.prompt_logprobs is not None
        for i, token_id in enumerate(scored.token_ids):
            entry = {token_id: Logprob(scored.logprobs[i], scored.ranks[i], token_text(token_id))}
            for rank, (top_id, value) in enumerate(
                zip(scored.top_ids[i], scored.top_logprobs[i]), start=1
            ):
                entry.setdefault(top_id, Logprob(value, rank, token_text(top_id)))
            self.prompt_logprobs[scored.first + i] = entry

    def take_prompt_logprobs(self) -> PromptLogprobsList | None:
        """The prompt logprobs, the first time only (None after, and without them)."""
        if self.prompt_logprobs is None or self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs


@dataclass(frozen=True)
class ProcessedStep:
    """A step's deltas, and the message back to the scheduler: the samples a stop string
    ended (the scheduler still runs them) and the requests whose new tokens could not be
    turned into output (they fail alone; their output side is dropped already)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    stops: OutputStops = field(default_factory=OutputStops)


def _primed_finished(sample: SampleOutput, resumed: NewTokens) -> bool:
    """Feed the resume tokens through `sample` as if sampled here, dropping what it shows;
    whether they finished it (a stop string in their text, or `resumed`'s finish).

    They go in unfinished: a finish would release the held-back text, which the request
    being continued never showed (a resumed request that is finished shows no new text)."""
    try:
        shown = sample.update(dataclasses.replace(resumed, finish_reason=None, stop_reason=None))
    except Exception as error:  # as a sampled token's would fail its request alone
        raise ResumeTokensError(
            f"resume_token_ids could not be turned into text ({type(error).__name__}: {error})"
        ) from error
    kept = len(shown.token_ids)
    if kept < len(resumed.token_ids):
        raise ResumeTokensError(
            f"resume_token_ids[{kept - 1}] completes the stop string {shown.stop_reason!r}, "
            f"so the {len(resumed.token_ids) - kept} tokens after it cannot follow; resume "
            "with the tokens up to it"
        )
    if not sample.finished:
        sample.finish_reason, sample.stop_reason = resumed.finish_reason, resumed.stop_reason
    return sample.finished


def check_stop_matcher_cls(cls: type) -> None:
    """Refuse a stop-string matcher class that lacks StopStringMatcher's feed and flush."""
    missing = [m for m in ("feed", "flush") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise TypeError(
            "stop_matcher_cls must be a class with feed and flush methods, like "
            f"StopStringMatcher; got {cls!r}"
        )


class OutputProcessor:
    """Turns each step's new tokens into deltas, for every request the engine holds."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        sample_output_cls: type = SampleOutput,
        stop_matcher_cls: type = StopStringMatcher,
    ) -> None:
        check_stop_matcher_cls(stop_matcher_cls)
        self.tokenizer = tokenizer
        self.sample_output_cls = sample_output_cls  # chapter 09 plugs the student's in here
        self.stop_matcher_cls = stop_matcher_cls  # and its stop-string matcher (9.5) here
        self.requests: dict[str, RequestState] = {}
        self.ready: list[RequestOutput] = []  # final outputs of requests resumed finished

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        resumed: NewTokens | None = None,
    ) -> bool:
        """Hold a request's output side. `resumed`: the tokens it generated elsewhere (its
        one sample's first, with the finish the token stop rules gave them), primed without
        showing them. Returns whether it still has tokens to generate (False: the resume
        tokens finished it; its final output waits in `ready`). ValueError when a stop
        string ends the text before the last resume token (ResumeTokensError)."""
        samples = [
            self.sample_output_cls(
                index=i,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params.skip_special_tokens
                ),
                stops=self.stop_matcher_cls(params.stop_strings, params.include_stop_str_in_output),
                with_logprobs=params.logprobs is not None,
            )
            for i in range(params.n)
        ]
        state = RequestState(
            request_id, prompt, list(prompt_token_ids), samples, RequestMetrics(arrival_time)
        )
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_token_ids)
        finished = resumed is not None and _primed_finished(state.samples[resumed.index], resumed)
        self.requests[request_id] = state  # (once finished, `_output` lets go of it)
        if not finished:
            return True
        with_logprobs = params.logprobs is not None
        sample = state.samples[resumed.index]
        final = CompletionOutput(
            sample.index, "", [], sample.finish_reason, sample.stop_reason,
            [] if with_logprobs else None, 0.0 if with_logprobs else None,
        )  # fmt: skip
        self.ready.append(self._output(state, [final], time.monotonic()))
        return False

    def holds(self, request_id: str) -> bool:
        """The request is running, or its final output waits to be taken."""
        return request_id in self.requests or any(o.request_id == request_id for o in self.ready)

    def take_ready(self) -> list[RequestOutput]:
        """The final outputs of requests whose resume tokens finished them (once each)."""
        ready, self.ready = self.ready, []
        return ready

    def forget(self, request_id: str) -> None:
        """Drop a request (aborted, or carried on by another instance)."""
        self.requests.pop(request_id, None)
        self.ready = [o for o in self.ready if o.request_id != request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests or self.ready)

    def add_prompt_logprobs(self, scored: dict[str, PromptLogprobs]) -> None:
        """A step's scored prompt chunks, by request id (gone requests are skipped)."""
        for request_id, chunk in scored.items():
            state = self.requests.get(request_id)
            if state is not None:
                state.add_prompt_logprobs(chunk, self._token_text)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def process(self, update: SchedulerUpdate) -> ProcessedStep:
        """Each sample's delta, gathered per request in the order the requests come.

        Requests the scheduler aborted (`update.failed`) are dropped first. A sample whose
        update raises (a token its tokenizer cannot decode, say) fails its request alone:
        no delta for it, the request dropped, the reason in the stops; the others go on."""
        for request_id in update.failed:
            self.forget(request_id)
        self.add_prompt_logprobs(update.prompt_logprobs)
        deltas: dict[str, list[CompletionOutput]] = {}
        stopped: list[tuple[str, int]] = []  # (request id, sample index)
        failed: dict[str, str] = {}
        for new in update.new_tokens:
            state = self.requests.get(new.request_id)
            if state is None or new.request_id in failed:  # aborted, forgotten or failed
                continue
            try:
                delta = state.samples[new.index].update(new)
            except Exception as error:  # this request's failure, not the step's
                failed[new.request_id] = (
                    f"its new tokens could not be processed ({type(error).__name__}: {error})"
                )
                deltas.pop(new.request_id, None)
                continue
            if delta.finished and new.finish_reason is None:
                stopped.append((new.request_id, new.index))
            state.num_cached_tokens = new.num_cached_tokens
            deltas.setdefault(new.request_id, []).append(delta)
        for request_id in failed:
            self.forget(request_id)
        now = time.monotonic()
        outputs = [self._output(self.requests[r], deltas[r], now) for r in deltas]
        stopped = [(rid, index) for rid, index in stopped if rid not in failed]
        return ProcessedStep(outputs, OutputStops(tuple(stopped), failed))

    def _output(
        self, state: RequestState, completions: list[CompletionOutput], now: float
    ) -> RequestOutput:
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        if state.finished:
            metrics.finished_time = now
            del self.requests[state.request_id]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=sorted(completions, key=lambda c: c.index),
            finished=state.finished,
            metrics=metrics,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=state.take_prompt_logprobs(),
        )
