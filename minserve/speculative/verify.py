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
