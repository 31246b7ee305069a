"""Verification: the target samples every proposed position in one forward; keep the drafts
up to the first disagreement, plus the target's own token there (or after the last draft).

Row j of a sequence's logits sees the context plus drafts d_1..d_j, and the sampler draws
x_j from the target's (processed) distribution there. Draft d_{j+1} is accepted when
x_j == d_{j+1}. Every emitted token is therefore a draw from the target given exactly the
tokens before it: greedy output equals non-speculative greedy output token for token.
(For a deterministic draft this is Leviathan et al.'s rejection sampling: accept with
probability p(d), otherwise draw from p with d removed.)
"""

from __future__ import annotations

from dataclasses import replace

import torch

from minserve.model.sampler import SamplingRow


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
    outputs = list(row.output_token_ids)
    return [row] + [
        replace(row, output_token_ids=outputs + drafts[:j]) for j in range(1, len(drafts) + 1)
    ]


# Rejection sampling against a draft *distribution* (Leviathan et al. 2023, Chen et al. 2023).
# The engine's proposers are deterministic (q is one-hot at the draft), where the rule above is
# this one with q(d) = 1: accept with probability p(d), else draw from p with d removed.


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
