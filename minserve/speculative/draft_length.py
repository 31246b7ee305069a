"""Draft length per request: always k ("fixed"), or what its acceptance pays for ("adaptive").

With per-draft acceptance rate a and draft cost ratio c (one draft step over one target
forward, `SpecCounters.cost_ratio`), a step with g drafts costs g c + 1 target forwards and
yields 1 + a + ... + a^g = (1 - a^(g+1)) / (1 - a) tokens on average (Leviathan et al.), so
the expected speedup over plain decoding is

    S(g) = (1 - a^(g+1)) / ((1 - a)(g c + 1)).

"adaptive": each request keeps exponentially discounted counts of the drafts it had tested
and accepted (their ratio is a, starting from a prior) and drafts the g in [1, k] that
maximises S(g), the shortest within 1% of the best (verifying more drafts also costs the
target compute that S leaves out). g never drops to 0: a request that stopped drafting could
never see its acceptance recover; at g = 1 a useless proposer costs c per step.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

PRIOR_RATE = 0.5  # a before a request has verified anything
PRIOR_WEIGHT = 2.0  # ... worth this many tested drafts
DECAY = 0.8  # weight of the past at each verification: it remembers about 5 steps
TOLERANCE = 0.01  # a shorter draft within 1% of the best expected speedup wins


def expected_tokens(a: float, g: int) -> float:
    """Tokens per verification, 1 + a + ... + a^g (also right at a = 1)."""
    return sum(a**i for i in range(g + 1))


def expected_speedup(a: float, g: int, c: float) -> float:
    """S(g) = (1 - a^(g+1)) / ((1 - a)(g c + 1)): tokens per step over its cost in forwards."""
    return expected_tokens(a, g) / (g * c + 1)


# >>> exercise 6.5: the adaptive draft length
def best_draft_length(a: float, c: float, k: int) -> int:
    """The shortest g in [1, k] whose expected speedup `expected_speedup(a, g, c)` is within
    TOLERANCE of the best one: at least (1 - TOLERANCE) times the largest S(g)."""
    # >>> solution
    speedups = [expected_speedup(a, g, c) for g in range(1, k + 1)]
    best = max(speedups)
    return next(g for g, s in enumerate(speedups, start=1) if s >= (1 - TOLERANCE) * best)
    # <<< solution


@dataclass
class AcceptanceEstimate:
    """Discounted counts of one request's drafts: a = accepted / tested."""

    accepted: float = PRIOR_RATE * PRIOR_WEIGHT
    tested: float = PRIOR_WEIGHT

    @property
    def rate(self) -> float:
        return self.accepted / self.tested

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """Drafts are tested in order until the first rejection: the accepted ones, plus the
        rejected one if any (drafts after it were never tested). Both counts decay by DECAY
        before this step's are added, so recent steps weigh most."""
        # >>> solution
        tested = num_accepted + (num_accepted < num_drafts)
        self.accepted = DECAY * self.accepted + num_accepted
        self.tested = DECAY * self.tested + tested
        # <<< solution


class DraftLengths:
    """How many drafts each sequence may get this step (before the engine's own limits).

    mode "fixed": always k. "adaptive": each sequence's own `AcceptanceEstimate` (made on
    first use), and the best draft length at its rate. Plug your class into the engine
    with `speculative_config={..., "draft_length": "adaptive", "draft_lengths_cls": ...}`.
    """

    def __init__(self, mode: str, k: int) -> None:
        self.adaptive = mode == "adaptive"
        self.k = k
        self.estimates: dict[Hashable, AcceptanceEstimate] = {}  # adaptive only, by sequence

    def length(self, seq: Hashable, cost_ratio: float) -> int:
        """Drafts for `seq` this step, at draft cost ratio `cost_ratio`."""
        # >>> solution
        if not self.adaptive:
            return self.k
        estimate = self.estimates.setdefault(seq, AcceptanceEstimate())
        return best_draft_length(estimate.rate, cost_ratio, self.k)
        # <<< solution

    def observe(self, seq: Hashable, num_drafts: int, num_accepted: int) -> None:
        """`seq` had `num_drafts` drafts verified, `num_accepted` of them kept (adaptive
        mode only, and only when it drafted at all)."""
        # >>> solution
        if self.adaptive and num_drafts > 0:
            self.estimates.setdefault(seq, AcceptanceEstimate()).observe(num_drafts, num_accepted)
        # <<< solution

    def forget(self, seq: Hashable) -> None:
        """A finished or aborted sequence: its estimate goes."""
        self.estimates.pop(seq, None)


# <<< exercise
