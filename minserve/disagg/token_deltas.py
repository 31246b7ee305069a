"""Streaming across processes: instances send each step's deltas, the proxy passes them on.

An instance's engine step gives deltas (`RequestOutput`s holding only this step's tokens
and text); `delta_json` is one of them as JSON (one sample: disaggregated requests have
n = 1). The first token's delta comes from the prefill instance; the decode instance was
given that token (`engine_hooks.add_prefilled`) and sends only what follows. The proxy's
`RemoteRequest` knows where a request lives and its timestamps, and turns each JSON delta
back into the `RequestOutput` delta the server streams.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from minserve.outputs import CompletionOutput, RequestMetrics, RequestOutput


def delta_json(output: RequestOutput) -> dict[str, Any]:
    """A one-sample request's delta, as the JSON an instance reports."""
    (completion,) = output.outputs
    return {
        "id": output.request_id,
        "token_ids": completion.token_ids,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


@dataclass
class RemoteRequest:
    """Proxy side: a request living on another instance."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    location: int  # the rank holding it now (a prefill rank, then a decode rank)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    finished: bool = False

    def delta(self, reported: dict[str, Any]) -> RequestOutput:
        """An instance's JSON delta as the `RequestOutput` delta the server streams."""
        now = time.monotonic()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        completion = CompletionOutput(
            0, reported["text"], list(reported["token_ids"]), reported["finish_reason"],
            reported["stop_reason"],
        )  # fmt: skip
        self.finished = completion.finished
        if self.finished:
            self.metrics.finished_time = now
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, [completion],
            finished=self.finished, metrics=self.metrics,
        )  # fmt: skip
