# Generated from minserve/speculative/verify.py by `python -m minserve.course.generate`;
# edit the marked regions there, not here.
"""Chapter 06, Sampling and speculative decoding: verifying a draft distribution.

A draft q proposes tokens; the target p keeps each with probability min(1, p/q)
and, at the first rejection, draws from the residual max(0, p - q) normalised, so
every token returned is distributed exactly as p (Leviathan et al., Chen et al.).
"""

import torch


# Exercise 6.1: the residual distribution
def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Where to draw from after a rejection: max(0, p - q), normalised.

    `target_probs` p and `draft_probs` q are [..., vocab] and each sums to 1 over the last
    dim. The residual puts mass exactly where the target wants more than the draft gave,
    which is what a rejection must make up for. When p == q there is no such mass (and a
    rejection never happens); return p itself, never NaN. Returns a new tensor.
    """
    excess = (target_probs - draft_probs).clamp(min=0)  # [..., vocab]
    total = excess.sum(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(total > 0, excess / total.clamp(min=1e-30), target_probs)


# Exercise 6.2: accept or reject each draft
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
