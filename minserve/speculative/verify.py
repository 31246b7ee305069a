"""Verification: the target scores every proposed position in one forward; keep the drafts
it accepts, plus one token of its own (at the first rejection, or after the last draft).

Row j of a sequence's logits sees the context plus drafts d_1..d_j.
- Greedy requests: the sampler takes x_j (the argmax) there and draft d_{j+1} is kept while
  x_j == d_{j+1}, so greedy output equals non-speculative output token for token.
- Sampling requests: Leviathan / Chen rejection sampling (`rejection_sample` below) of the
  drafts, drawn from the proposer's q, against the target's processed distribution p; every
  emitted token is distributed exactly as if the target had sampled it alone.
"""

from __future__ import annotations

import torch

from minserve.model.sampler import SamplingRow
from minserve.speculative.distributions import row_after


def accepted_length(sampled: list[int], drafts: list[int]) -> int:
    """How many drafts the target agrees with, counted from the first."""
    count = 0
    for target, draft in zip(sampled, drafts):
        if target != draft:
            break
        count += 1
    return count


def rows_for_drafts(row: SamplingRow, drafts: list[int]) -> list[SamplingRow]:
    """One sampling row per verified position: row j has the drafts before it as output, so
    penalties, min_tokens and logprobs see exactly what a plain decode would."""
    return [row_after(row, drafts[:j]) for j in range(len(drafts) + 1)]


# Rejection sampling against a draft *distribution* (Leviathan et al. 2023, Chen et al. 2023).
# The engine verifies a sampling request's drafts with it (speculative_config's
# "rejection_sampler", default `rejection_sample`): model proposers draw their drafts from q;
# n-gram drafts are one-hot (accept with probability p(d), else draw from p with d removed,
# the rule above). Greedy requests keep the rule above. A seeded request's `generator` comes
# re-seeded for the round (speculative/sampled.py), so a round's draws follow from its history.


# >>> exercise 6.1: the residual distribution
def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Where to draw from after a rejection: max(0, p - q), normalised.

    `target_probs` p and `draft_probs` q are [..., vocab] and each sums to 1 over the last
    dim. The residual puts mass exactly where the target wants more than the draft gave,
    which is what a rejection must make up for. When p == q there is no such mass (and a
    rejection never happens); return p itself, never NaN. Returns a new tensor.
    """
    # >>> solution
    excess = (target_probs - draft_probs).clamp(min=0)  # [..., vocab]
    total = excess.sum(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(total > 0, excess / total.clamp(min=1e-30), target_probs)
    # <<< solution


# <<< exercise


# >>> exercise 6.2: accept or reject each draft
def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: list[int],
    generator: torch.Generator,
) -> list[int]:
    """Verify k drafts; return the accepted ones plus one token drawn by the target.

    `target_probs` is [k + 1, vocab]: row j is p at the position of draft j, row k the
    position after the last draft. `draft_probs` is [k, vocab]: the q that proposed each
    draft. Walk the drafts in order; draw u ~ U[0, 1) from `generator` and keep draft d
    when u * q(d) < p(d) (probability min(1, p(d) / q(d)), no division). At the first
    rejection, append one token drawn from `residual_distribution` of that row (with
    `torch.multinomial(..., 1, generator=generator)`) and stop. When all k are kept,
    append a bonus token drawn from row k. Every token returned is then distributed
    exactly as if the target had sampled it alone.
    """
    # >>> solution
    tokens: list[int] = []
    for j, draft in enumerate(draft_tokens):
        u = torch.rand((), generator=generator)
        if u * draft_probs[j, draft] < target_probs[j, draft]:
            tokens.append(draft)
            continue
        residual = residual_distribution(target_probs[j], draft_probs[j])  # [vocab]
        tokens.append(int(torch.multinomial(residual, 1, generator=generator)))
        return tokens
    bonus = torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator)
    return tokens + [int(bonus)]
    # <<< solution


# <<< exercise
