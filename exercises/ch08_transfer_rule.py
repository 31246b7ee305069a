# Your workspace for chapter 08 (Disaggregating prefill and decode): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 08` from the repository root.
# Generated from minserve/disagg/transfer_rule.py by `python -m minserve.course.generate`.
# stub fingerprint: 4d15d962e4ee (lets the generator tell your edits from a stale stub)
"""Chapter 08, Disaggregating prefill and decode: transfer or recompute.

After a prefill, a request's KV cache either travels to the decode instance
(latency + bytes / bandwidth) or the decode instance computes the prompt again
(prompt tokens x seconds per prefill token). You write `TransferRule.decide`.
"""

from dataclasses import dataclass

from minserve.disagg.transfer_rule import (
    POLICIES,
    TransferDecision,
    log,  # noqa: F401  (to log each decision)
)


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
