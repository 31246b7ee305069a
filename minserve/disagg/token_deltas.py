"""Streaming across processes: instances send each step's deltas, the proxy passes them on.

An instance's engine step gives deltas (`RequestOutput`s holding only this step's tokens
and text); `delta_json` is one of them as JSON (one sample: disaggregated requests have
n = 1). The first token's delta comes from the prefill instance; the decode instance was
given that token (`engine_hooks.add_prefilled`) and sends only what follows. The proxy's
`RemoteRequest` knows where a request lives, its timestamps and the tokens streamed so far,
and turns each JSON delta back into the `RequestOutput` delta the server streams.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from minserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minserve.sampling_params import SamplingParams


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
    """Proxy side: a request living on another instance, and what it streamed so far (the
    tokens to resume it from, should that instance die)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    location: int  # the rank holding it now (a prefill rank, then a decode rank)
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    token_ids: list[int] = field(default_factory=list)  # generated and streamed so far
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    finished: bool = False

    def add_json(self) -> dict[str, Any]:
        """The command that adds it to a prefill instance."""
        return {"id": self.request_id, "prompt_token_ids": self.prompt_token_ids,
                "params": asdict(self.params), "priority": self.priority}  # fmt: skip

    def resume_json(self) -> dict[str, Any]:
        """The command that continues it on another instance, after the tokens it streamed."""
        return {**self.add_json(), "token_ids": list(self.token_ids)}

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
        self.token_ids += completion.token_ids
        if self.finished:
            self.metrics.finished_time = now
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, [completion],
            finished=self.finished, metrics=self.metrics,
        )  # fmt: skip
