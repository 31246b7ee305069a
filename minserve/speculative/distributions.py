"""The distributions speculative sampling compares: the target's p and the draft's q.

Rejection sampling is exact only if p is the distribution the target's sampler would draw
from at that position: after penalties, min_tokens, temperature, top-k, top-p and min-p
(`processed_logits` applies them in the sampler's order, with the sampler's own filters).
A model proposer processes its own logits the same way and draws its drafts from that q,
one uniform per row as the sampler does; a seeded request's comes from its generator keyed
by the draft's position and the purpose "draft" (`minserve/model/seeded_draws.py`), apart
from the numbers its verification draws ("verify"), as rejection sampling needs them to be.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from minserve.model.sampler import (
    Sampler,
    SamplingRow,
    apply_token_bitmasks,
    draw_from_logits,
    row_uniforms,
    unsampleable_rows,
)


def processed_logits(
    sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]
) -> torch.Tensor:
    """`logits` [rows, vocab] as `sampler` transforms them before drawing (sampling rows).

    Softmax of the result is the distribution the sampler draws each row from; filtered
    tokens (and those a row's grammar forbids) are -inf (probability 0)."""
    masked = apply_token_bitmasks(logits.float(), rows, sampler.bitmask_fn)
    return sampler.filtered(sampler.processed(masked, rows), rows)


def row_after(row: SamplingRow, drafts: list[int]) -> SamplingRow:
    """The sampling row of the position after `drafts`: they count as output so far, and
    a grammar is in its state after them."""
    if not drafts:
        return row
    constraint = None if row.constraint is None else row.constraint.after(drafts)
    return replace(row, output_token_ids=[*row.output_token_ids, *drafts], constraint=constraint)


def choose_drafts(
    sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[list[int | None], list[torch.Tensor | None]]:
    """One draft per row from a proposer's logits [rows, vocab], and the q it came from.

    Greedy rows take the argmax (q is one-hot there: None). Sampling rows draw from their
    processed distribution q, whose row [vocab] is returned for the verifier. A row no token
    can be drawn from (the draft model's logits hold NaN, say) gets None: that sequence
    drafts no further, and the target decides its next token alone."""
    tokens: list[int | None] = logits.argmax(dim=-1).tolist()  # replaced below for sampling
    probs: list[torch.Tensor | None] = [None] * len(rows)
    unsampleable = set(unsampleable_rows(logits.float()))
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy and i not in unsampleable]
    if drawn:
        drawn_rows = [rows[i] for i in drawn]
        processed = processed_logits(sampler, logits[drawn], drawn_rows)  # [drawn, vocab]
        unsampleable |= {drawn[j] for j in unsampleable_rows(processed)}
        uniforms = row_uniforms(drawn_rows, logits.device, purpose="draft")  # [drawn]
        draws = draw_from_logits(processed, uniforms).tolist()
        for i, token, q in zip(drawn, draws, processed.softmax(dim=-1)):
            tokens[i], probs[i] = token, q
    for i in unsampleable:
        tokens[i], probs[i] = None, None
    return tokens, probs
