"""Verifying a sampling request's drafts: rejection sampling against the target's p.

At each verified position the target's processed distribution p (one batched call for every
such row of the step) is compared with the q the draft came from: a model proposer's own
processed distribution, or one-hot for deterministic drafts (n-gram). The per-sequence walk
(`rejection_sample`, or the student's verifier of chapter 06) keeps each draft with
probability min(1, p/q) and ends with one token of the target's. A sequence with a row
no token can be drawn from (NaN logits, say) gets the reason instead, and fails alone.

A seeded request's round draws from its generator re-seeded with the key of (seed, sample
index, the round's first position, "verify") (`minserve/model/seeded_draws.py`): a round
is reproducible from the tokens before it, whatever was drawn earlier. A resumed speculative
stream is identical to the original only where its rounds start at the same positions: the
drafts, and so the draws a round makes, depend on where the round starts (and on how many
drafts the step's budget allowed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minserve.model.sampler import (
    Sampler,
    SamplingRow,
    logprob_dicts,
    row_generator,
    unsampleable_rows,
)
from minserve.speculative.distributions import processed_logits

RejectionSampler = Callable[[torch.Tensor, torch.Tensor, list[int], torch.Generator], list[int]]
Verified = tuple[list[int], list[dict[int, float] | None]]  # tokens kept, their logprobs
Outcome = Verified | str  # a sequence's verified tokens, or why none could be drawn


def verify_sampled(
    rejection_sampler: RejectionSampler,
    sampler: Sampler,
    logits: torch.Tensor,  # [num_rows, vocab]: the rows of these sequences, in order
    rows: list[SamplingRow],  # one per logits row (rows_for_drafts of each sequence)
    drafts: list[list[int]],  # per sequence, at least one draft
    draft_probs: list[torch.Tensor | None],  # per sequence: q [len(drafts), vocab] or None
) -> list[Outcome]:
    """Each sequence's kept tokens (accepted drafts + one), with logprobs where asked, or
    why a row of it could not be sampled."""
    processed = processed_logits(sampler, logits, rows)  # [num_rows, vocab]
    unsampleable = unsampleable_rows(processed)
    probs = processed.softmax(dim=-1).cpu()  # [num_rows, vocab]
    kept: list[list[int] | str] = []
    first = 0
    for own, q in zip(drafts, draft_probs):
        count = len(own) + 1
        reasons = [unsampleable[r] for r in range(first, first + count) if r in unsampleable]
        if reasons:
            kept.append(reasons[0])
        else:
            p = probs[first : first + count]  # [k + 1, vocab]
            q = _one_hot(own, p.shape[-1]) if q is None else q.float().cpu()  # [k, vocab]
            generator = _round_generator(rows[first])
            kept.append(_checked(rejection_sampler(p, q, own, generator), own))
        first += count
    return _with_logprobs(logits, rows, drafts, kept)


def _round_generator(first_row: SamplingRow) -> torch.Generator:
    """The RNG of one verification round, given the row of its first draft: a seeded
    request's generator keyed by that position and "verify"; else the global RNG."""
    return row_generator(first_row, "verify") or torch.default_generator


def _one_hot(tokens: list[int], vocab: int) -> torch.Tensor:
    """q of a deterministic draft: all its mass on the proposed token. [k, vocab]"""
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def _checked(tokens: list[int], drafts: list[int]) -> list[int]:
    """A verifier must return the accepted drafts (a prefix) plus one token of the target's."""
    tokens = [int(t) for t in tokens]
    accepted = len(tokens) - 1
    if not 0 <= accepted <= len(drafts) or tokens[:accepted] != drafts[:accepted]:
        raise ValueError(
            f"the rejection sampler returned {tokens} for drafts {drafts}: expected the "
            "accepted drafts, in order, then one token drawn by the target (1 to "
            f"{len(drafts) + 1} tokens)"
        )
    return tokens


def _with_logprobs(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[list[int]],
    kept: list[list[int] | str],
) -> list[Outcome]:
    """Per sequence, its kept tokens with the sampler's logprob dicts (raw logits); a
    failed sequence's reason passes through."""
    picked: list[int] = []  # logits row of every kept token
    first = 0
    for own, tokens in zip(drafts, kept):
        if not isinstance(tokens, str):
            picked += range(first, first + len(tokens))
        first += len(own) + 1
    picked_rows = [rows[i] for i in picked]
    wanted = any(row.params.logprobs is not None for row in picked_rows)
    raw = logits[picked].float().log_softmax(dim=-1) if wanted else None  # [picked, vocab]
    kept_ids = [t for tokens in kept if not isinstance(tokens, str) for t in tokens]
    dicts = logprob_dicts(
        raw, torch.tensor(kept_ids, dtype=torch.long, device=logits.device), picked_rows
    )
    out: list[Outcome] = []
    start = 0
    for tokens in kept:
        if isinstance(tokens, str):
            out.append(tokens)
            continue
        out.append((tokens, dicts[start : start + len(tokens)]))
        start += len(tokens)
    return out
