"""What the server drives: an engine it can add requests to, abort, step, and ask for metrics.

`LLMEngine` (one process) and `DisaggregatedEngine` (the proxy over prefill and decode
instances) both have this shape, so `AsyncEngine` and the HTTP layer work with either and
read nothing else from them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from minserve.config import SchedulerConfig
from minserve.model.tokenizer import Tokenizer
from minserve.outputs import RequestOutput
from minserve.sampling_params import SamplingParams


class EngineClient(Protocol):
    """Requests in (add, abort), each step's deltas out, metrics on the side."""

    scheduler_config: SchedulerConfig  # max_num_seqs bounds the server's queue
    max_model_len: int  # the longest sequence (prompt + output) it accepts
    vocab_size: int  # token ids run from 0 to vocab_size - 1
    device: torch.device | None  # where its steps run in this process (None: elsewhere)

    def get_tokenizer(self) -> Tokenizer: ...

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        resume_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request; `resume_token_ids`: the tokens it already generated elsewhere,
        to continue after (ValueError where the engine cannot)."""
        ...

    def check_params(self, params: SamplingParams) -> None:
        """Check what `add_request` would of `params`, from any thread (ValueError if bad);
        slow checks (a structured output's grammar compile) are done and kept here, so the
        server runs them off the engine thread."""
        ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]:
        """One step's deltas: each request that got tokens, with this step's part only."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def get_metrics(self) -> dict[str, float]: ...

    def kv_events_info(self) -> dict[str, object] | None:
        """Where a router subscribes to the KV events (GET /v1/kv_events); None: none."""
        ...

    def shutdown(self) -> None:
        """Stop the processes it started, if any."""
        ...
