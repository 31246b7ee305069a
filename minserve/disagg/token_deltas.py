"""Streaming across processes: instances report each step's new tokens, the proxy adds them up.

An instance's engine produces cumulative `RequestOutput`s; `DeltaReporter` turns them into
what the proxy has not seen yet (new token ids, new text, the finish reason) as JSON. The
proxy's `RemoteRequest` accumulates the deltas from whichever instance holds the request
(the first token from the prefill instance, the rest from the decode instance) into the
cumulative `RequestOutput` the server streams from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from minserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minserve.scheduler.sequence import Sequence


class DeltaReporter:
    """Instance side: per request, how many tokens and characters were already reported."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, int]] = {}  # request id -> (tokens, chars)

    def report(self, output: RequestOutput) -> dict[str, Any]:
        """The part of a one-sample request's output the proxy has not seen, as JSON."""
        (completion,) = output.outputs
        tokens, chars = self._sent.get(output.request_id, (0, 0))
        if completion.finished:
            self.forget(output.request_id)
        else:
            self._sent[output.request_id] = (len(completion.token_ids), len(completion.text))
        return {
            "id": output.request_id,
            "token_ids": completion.token_ids[tokens:],
            "text": completion.text[chars:],
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }

    def already_reported(self, seq: Sequence) -> None:
        """A request arriving with its first token (reported by the prefill instance)."""
        self._sent[seq.request.request_id] = (len(seq.sample.token_ids), len(seq.sample.text))

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


@dataclass
class RemoteRequest:
    """Proxy side: a request living on another instance, rebuilt from its deltas."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    location: int  # the rank holding it now (a prefill rank, then a decode rank)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, delta: dict[str, Any]) -> None:
        self.token_ids += delta["token_ids"]
        self.text += delta["text"]
        self.finish_reason, self.stop_reason = delta["finish_reason"], delta["stop_reason"]
        now = time.monotonic()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        if self.finished:
            self.metrics.finished_time = now

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            0, self.text, list(self.token_ids), self.finish_reason, self.stop_reason
        )
        return RequestOutput(
            self.request_id, self.prompt, list(self.prompt_token_ids), [completion],
            finished=self.finished, metrics=self.metrics,
        )  # fmt: skip
