"""Admission control: refuse at arrival (503, Retry-After) what would miss its targets anyway.

A server past its capacity that queues every request serves none of them well: the queue
grows, every request waits longer than its TTFT SLO, and goodput falls to 0. So, as
SLO-aware servers do, the server predicts at arrival and refuses early:

- TTFT: the prompt tokens accepted and not yet prefilled (the queue in front), plus its
  own, over the prefill rate the engine measures while there are prompts to compute
  (`StepTimeScheduler.prefill_rate`). Over `target_ttft_ms`, refused: it would start late.
- TPOT: one more decode per sample in the step every running request shares, priced by
  the step cost model. Past `target_tpot_ms` even without any prompt chunk, refused: the
  running requests would slow down for it.

A refused client is told when to retry (`Retry-After`, seconds). With nothing in flight a
request is always admitted (refusing it helps no one); a check the engine cannot predict
yet (`get_metrics()` has no rate, or no fitted cost) admits.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from minserve.config import SchedulerConfig
from minserve.scheduler.step_cost import StepCost, StepShape


class RequestRefusedError(RuntimeError):
    """A request the server will not start: it would miss a target (answered with 503)."""

    def __init__(self, message: str, reason: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason, self.retry_after_s = reason, retry_after_s


@dataclass(frozen=True)
class AdmissionConfig:
    """The targets admission keeps, in seconds (None: not checked)."""

    target_ttft_s: float | None = None
    target_tpot_s: float | None = None

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> AdmissionConfig | None:
        """The targets the engine was configured with; None when both are off."""
        ttft, tpot = config.target_ttft_ms, config.target_tpot_ms
        if not (ttft or tpot):
            return None
        return cls(ttft / 1000 if ttft else None, tpot / 1000 if tpot else None)


@dataclass(frozen=True)
class Work:
    """Requests in flight, or one arriving: its sequences, the context their decodes will
    attend (prompt + max_tokens), and its prompt tokens not yet prefilled."""

    num_seqs: int = 0
    num_context_tokens: int = 0
    num_prefill_tokens: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(
            self.num_seqs + other.num_seqs,
            self.num_context_tokens + other.num_context_tokens,
            self.num_prefill_tokens + other.num_prefill_tokens,
        )


def predicted_ttft_s(queued: Work, new: Work, prefill_tokens_per_s: float) -> float:
    """When the new request's first token comes: the prompts in front of it, then its own."""
    return (queued.num_prefill_tokens + new.num_prefill_tokens) / prefill_tokens_per_s


def check_admission(
    config: AdmissionConfig,
    in_flight: Work,
    new: Work,
    cost: StepCost | None,
    prefill_tokens_per_s: float,
) -> RequestRefusedError | None:
    """Why `new` should be refused, given what is in flight and what the engine measured;
    None to admit it."""
    if in_flight.num_seqs == 0:
        return None
    if config.target_ttft_s and prefill_tokens_per_s > 0 and in_flight.num_prefill_tokens:
        ttft = predicted_ttft_s(in_flight, new, prefill_tokens_per_s)
        if ttft > config.target_ttft_s:
            return RequestRefusedError(
                f"server is overloaded: its first token would come in about {ttft:.2f} s "
                f"({in_flight.num_prefill_tokens} prompt tokens queued in front of it), over "
                f"the {config.target_ttft_s:g} s TTFT target; retry later",
                "ttft", max(1, math.ceil(ttft - config.target_ttft_s)),
            )  # fmt: skip
    if config.target_tpot_s and cost is not None:
        total = in_flight + new
        step = cost.predict(StepShape(total.num_seqs, total.num_context_tokens))
        if step > config.target_tpot_s:
            return RequestRefusedError(
                f"server is overloaded: {total.num_seqs} sequences would decode in steps "
                f"of about {step * 1000:.0f} ms, over the {config.target_tpot_s * 1000:g} ms "
                "TPOT target; retry later",
                "tpot", 1,
            )  # fmt: skip
    return None


class Admission:
    """The work the server holds, by request id, and the admission check against it.

    Handlers admit (under a lock: requests arrive at once); the engine thread marks a
    request prefilled (its first output came) and releases it when it ends.
    """

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._held: dict[str, Work] = {}

    def admit(self, arrivals: dict[str, Work], stats: dict[str, float]) -> None:
        """Hold these requests (one HTTP request's prompts, by id), or raise
        RequestRefusedError; `stats` is the engine's latest `get_metrics()`."""
        new = sum(arrivals.values(), Work())
        cost, rate = StepCost.from_metrics(stats), stats.get("prefill_tokens_per_second", 0.0)
        with self._lock:
            in_flight = sum(self._held.values(), Work())
            refusal = check_admission(self.config, in_flight, new, cost, rate)
            if refusal is not None:
                raise refusal
            self._held.update(arrivals)

    def prefilled(self, request_id: str) -> None:
        """Its prompt is computed: it no longer stands in front of new requests."""
        with self._lock:
            work = self._held.get(request_id)
            if work is not None and work.num_prefill_tokens:
                self._held[request_id] = Work(work.num_seqs, work.num_context_tokens)

    def release(self, request_id: str) -> None:
        with self._lock:
            self._held.pop(request_id, None)
