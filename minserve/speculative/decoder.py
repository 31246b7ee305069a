"""`SpeculativeDecoder`: the worker's side of speculative decoding, around one forward.

    propose(chunks)   before the forward: drafts for the decodes the scheduler gave draft
                      slots (at most that many each); a model proposer writes its own K/V
    verify(...)       after the forward: keep the drafts the target accepts (greedy: those
                      it agrees with; sampling: rejection sampling) and one token of its own;
                      a request with a row no token can be drawn from fails alone

How many drafts a decode may get is the scheduler's call (`planner.py`); rolling the KV
slots of rejected drafts back is the scheduler's too, from what `verify` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minserve.messages import SampledTokens, ScheduledChunk
from minserve.model.runner import ModelRunner
from minserve.model.sampler import Sampler, SamplingRow
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.proposers import make_proposer
from minserve.speculative.sampled import Outcome, verify_sampled
from minserve.speculative.verify import accepted_length, rejection_sample, rows_for_drafts


@dataclass
class Proposal:
    """What `propose` gave one step's batch, for the forward and for `verify`."""

    drafts: dict[int, list[int]] = field(default_factory=dict)  # seq id -> draft tokens
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)  # seq id -> q [g, vocab]
    num_rounds: int = 0  # draft positions proposed in sequence (the longest draft)

    def drop_unused_probs(self) -> None:
        """After drafts were cut short (a grammar forbade one): q's rows past them go too."""
        for seq_id, q in self.draft_probs.items():
            self.draft_probs[seq_id] = q[: len(self.drafts.get(seq_id, ()))]


@dataclass(frozen=True)
class _Target:
    """One sampling row to verify: its drafts (the speculating row only) and logits rows."""

    seq_id: int
    request_id: str
    row: SamplingRow
    drafts: list[int]
    draft_probs: torch.Tensor | None
    first_logits_row: int


class SpeculativeDecoder:
    """Proposes drafts for a batch and verifies them against the target's logits."""

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner) -> None:
        self.proposer = make_proposer(config, runner)
        self.rejection_sampler = config.rejection_sampler or rejection_sample

    def propose(self, chunks: Sequence[ScheduledChunk]) -> Proposal:
        """Drafts for every chunk with draft slots, at most that many each."""
        drafting = [c for c in chunks if c.num_draft_slots > 0]
        proposal = Proposal()
        if not drafting:
            return proposal
        limits = [c.num_draft_slots for c in drafting]
        for chunk, draft in zip(drafting, self.proposer.propose(drafting, limits)):
            proposal.drafts[chunk.seq_id] = list(draft.token_ids)
            if draft.probs is not None:
                proposal.draft_probs[chunk.seq_id] = draft.probs
            proposal.num_rounds = max(proposal.num_rounds, len(draft.token_ids))
        return proposal

    def release(self, seq_ids: Sequence[int]) -> None:
        """Forget finished sequences (a draft model frees their draft KV)."""
        release = getattr(self.proposer, "release", None)  # proposers with state
        if release is not None:
            release(seq_ids)

    def verify(
        self,
        chunks: Sequence[ScheduledChunk],
        proposal: Proposal,
        logits: torch.Tensor,  # [sum over sampling chunks of (1 + drafts), vocab]
        sampler: Sampler,
    ) -> tuple[dict[int, tuple[SampledTokens, ...]], dict[str, str]]:
        """Every sampling row's kept tokens, per sequence id (one per row of its samples),
        and the requests that failed (request id -> why): a request with a row the sampler
        could not draw from gets no tokens."""
        targets = _targets(chunks, proposal)
        rows, logit_rows, spans = _rows(targets)
        walked = [bool(t.drafts) and not t.row.params.greedy for t in targets]
        agreeing = [i for i, w in enumerate(walked) if not w]  # greedy, or nothing drafted
        rejection = [i for i, w in enumerate(walked) if w]  # sampling, with drafts
        verified: dict[int, Outcome] = {}
        for group, verify_group in ((agreeing, self._agreeing), (rejection, self._rejection)):
            if not group:
                continue
            picked = [r for i in group for r in range(spans[i][0], sum(spans[i]))]
            group_logits = logits[[logit_rows[r] for r in picked]]  # [rows of group, vocab]
            own = [targets[i].drafts for i in group]
            qs = [targets[i].draft_probs for i in group]
            results = verify_group(sampler, group_logits, [rows[r] for r in picked], own, qs)
            verified.update(zip(group, results))
        failed = {
            targets[i].request_id: f"the sampler could not draw a token: {outcome}"
            for i, outcome in sorted(verified.items())
            if isinstance(outcome, str)
        }
        sampled: dict[int, list[SampledTokens]] = {}
        for i, target in enumerate(targets):
            outcome = verified[i]
            if target.request_id in failed or isinstance(outcome, str):
                continue
            tokens, logprobs = outcome
            sampled.setdefault(target.seq_id, []).append(
                SampledTokens(tuple(tokens), tuple(logprobs))
            )
        return {seq_id: tuple(rows) for seq_id, rows in sampled.items()}, failed

    @staticmethod
    def _agreeing(
        sampler: Sampler,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        drafts: list[list[int]],
        draft_probs: list[torch.Tensor | None],
    ) -> list[Outcome]:
        """Greedy (or draft-less) rows: sample every row, keep the drafts up to the first
        disagreement and the target's token there."""
        result = sampler(logits, rows)
        verified: list[Outcome] = []
        first = 0
        for own in drafts:
            count = len(own) + 1
            reasons = [result.failed[r] for r in range(first, first + count) if r in result.failed]
            tokens = result.token_ids[first : first + count]
            kept = 1 + accepted_length(tokens, own)
            verified.append(
                reasons[0] if reasons else (tokens[:kept], result.logprobs[first : first + kept])
            )
            first += count
        return verified

    def _rejection(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        drafts: list[list[int]],
        draft_probs: list[torch.Tensor | None],
    ) -> list[Outcome]:
        """Sampling rows with drafts: rejection sampling (sampled.py)."""
        return verify_sampled(self.rejection_sampler, sampler, logits, rows, drafts, draft_probs)


def _targets(chunks: Sequence[ScheduledChunk], proposal: Proposal) -> list[_Target]:
    """The sampling rows in batch order. A chunk owns consecutive logits rows (1 + drafts);
    the siblings a finished prefill forks into (never drafting) share its single row."""
    targets, next_row = [], 0
    for chunk in chunks:
        if not chunk.samples:
            continue
        own = proposal.drafts.get(chunk.seq_id, [])
        q = proposal.draft_probs.get(chunk.seq_id)
        for j, row in enumerate(chunk.samples):
            drafts = own if j == 0 else []
            q_j = q if j == 0 else None
            targets.append(_Target(chunk.seq_id, chunk.request_id, row, drafts, q_j, next_row))
        next_row += 1 + len(own)
    return targets


def _rows(targets: list[_Target]) -> tuple[list[SamplingRow], list[int], list[tuple[int, int]]]:
    """Sampling rows (one per verified position), their logits rows, and each target's
    (first row, row count)."""
    rows: list[SamplingRow] = []
    logit_rows: list[int] = []
    spans: list[tuple[int, int]] = []
    for target in targets:
        target_rows = rows_for_drafts(target.row, target.drafts)
        spans.append((len(rows), len(target_rows)))
        logit_rows += range(target.first_logits_row, target.first_logits_row + len(target_rows))
        rows += target_rows
    return rows, logit_rows, spans
