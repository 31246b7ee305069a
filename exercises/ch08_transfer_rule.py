# Your workspace for chapter 08 (Disaggregating prefill and decode): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 08` from the repository root.
# Generated from minserve/disagg/transfer_rule.py, minserve/disagg/pd_worker.py by `python -m minserve.course.generate`.
# stub fingerprint: 8be50053b7d3 (lets the generator tell your edits from a stale stub)
"""Chapter 08, Disaggregating prefill and decode: transfer or recompute, and the
decode side of the KV hand-off.

After a prefill, a request's KV cache either travels to the decode instance
(latency + bytes / bandwidth) or the decode instance computes the prompt again
(prompt tokens x seconds per prefill token). You write `TransferRule.decide`,
then `admit`: the decode instance takes an offered request, blocks first.
"""

from dataclasses import dataclass

from minserve.disagg.engine_hooks import add_prefilled  # noqa: F401
from minserve.disagg.kv_transfer import KVOffer
from minserve.disagg.transfer_rule import (
    POLICIES,
    TransferDecision,
    log,  # noqa: F401  (to log each decision)
)
from minserve.engine import LLMEngine
from minserve.scheduler.sequence import Sequence


# Exercise 8.1: transfer or recompute
@dataclass
class TransferRule:
    """Measured link and prefill speed; `decide` picks the cheaper way per request."""

    latency_s: float
    bandwidth_bytes_s: float
    policy: str = "auto"
    recompute_s_per_token: float | None = None  # None until a prefill step was seen

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"transfer policy must be one of {POLICIES}, got {self.policy!r}")

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Update the prefill speed from a step (a running mean, weight 1/4 on the new one)."""
        if num_tokens > 0:
            rate = seconds / num_tokens
            old = self.recompute_s_per_token
            self.recompute_s_per_token = rate if old is None else 0.75 * old + 0.25 * rate

    def decide(self, request_id: str, num_tokens: int, kv_bytes: int) -> TransferDecision:
        """Estimate both ways for one request and pick the cheaper (ties: transfer).

        transfer_s = latency_s + kv_bytes / bandwidth_bytes_s; recompute_s = num_tokens x
        recompute_s_per_token (infinite while no prefill was observed). Policy "transfer" or
        "recompute" forces the choice but still reports both estimates. Log the decision.
        """
        raise NotImplementedError("Exercise 8.1: transfer or recompute")


# Exercise 8.2: the decode side of the KV hand-off
def admit(engine: LLMEngine, offer: KVOffer) -> tuple[Sequence, bool]:
    """Take an offered request into this decode engine; (its sequence, KV accepted).

    Blocks come first: with `offer.with_kv`, allocate blocks for the whole prompt before
    any byte moves, with `add_prefilled(engine, request_id, prompt ids (a list), params,
    first_token, with_kv=True)`; the caller then acknowledges and writes the received KV
    into `seq.block_table`. It raises MemoryError when the pool has no room: then refuse
    the KV and take the request anyway, to recompute its prompt here (`with_kv=False`).
    An offer without KV (the rule chose recompute) is always taken that way.
    """
    raise NotImplementedError("Exercise 8.2: the decode side of the KV hand-off")
