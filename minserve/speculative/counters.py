"""Speculative decoding's counters and the metrics they give (`get_metrics()`, vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecCounters:
    """Acceptance and cost totals since the engine started."""

    num_drafts: int = 0  # sequence-steps that verified at least one draft
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0
    num_sampled_seqs: int = 0  # sequence-steps that sampled (one target forward each)
    num_emitted_tokens: int = 0
    # the draft cost ratio c, over the engine steps in which something was drafted:
    num_draft_rounds: int = 0  # sequential draft positions: the longest draft of each step
    num_draft_steps: int = 0  # engine steps with at least one draft round
    propose_seconds: float = 0.0  # the `propose` phase of those steps
    forward_seconds: float = 0.0  # the target's `forward` phase of those steps

    def record_costs(self, num_rounds: int, propose_s: float, forward_s: float) -> None:
        """One engine step's proposing (num_rounds draft positions) and verifying forward."""
        if num_rounds > 0:
            self.num_draft_rounds += num_rounds
            self.num_draft_steps += 1
            self.propose_seconds += propose_s
            self.forward_seconds += forward_s

    @property
    def cost_ratio(self) -> float:
        """c = (propose seconds / draft rounds) / (forward seconds / steps), over the steps
        that drafted: one draft position's cost (for the whole batch: rounds are batched)
        over one target forward's, as in the speedup (1 - a^(g+1)) / ((1 - a)(g c + 1)).
        0 before anything was drafted; about 0 for n-gram lookup."""
        if self.num_draft_rounds == 0 or self.forward_seconds == 0:
            return 0.0
        per_round = self.propose_seconds / self.num_draft_rounds
        return per_round / (self.forward_seconds / self.num_draft_steps)

    def as_metrics(self) -> dict[str, float]:
        drafts, proposed = self.num_drafts, self.num_draft_tokens
        return {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": proposed,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": self.num_accepted_tokens / proposed if proposed else 0.0,
            # tokens a speculating sequence gains per verification: 1 + accepted drafts
            "spec_decode_mean_acceptance_length": (
                1 + self.num_accepted_tokens / drafts if drafts else 0.0
            ),
            "spec_decode_tokens_per_forward": (
                self.num_emitted_tokens / self.num_sampled_seqs if self.num_sampled_seqs else 0.0
            ),
            "spec_decode_draft_cost_ratio": self.cost_ratio,
            "spec_decode_num_draft_rounds": self.num_draft_rounds,
        }
