"""`SpeculativeDecoder`: the engine's two hooks around one step.

    propose(batch)   after scheduling: give decoding sequences drafts and KV slots for them
    verify(...)      after the forward: keep the drafts the target accepts (greedy: those it
                     agrees with; sampling: rejection sampling), roll the KV of the rest back

Every decode speculates (greedy or sampling, any n); a sequence still prefilling does not.
How many drafts a sequence gets is `DraftLengths`' call (k, or adaptive per request).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from minserve.kvcache.manager import KVCacheManager
from minserve.model.runner import ModelRunner
from minserve.model.sampler import Sampler, SamplingRow
from minserve.request import StopRules
from minserve.scheduler.scheduler import ScheduledSeq, SchedulerOutput
from minserve.scheduler.sequence import Sequence
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.counters import SpecCounters
from minserve.speculative.draft_length import DraftLengths
from minserve.speculative.kv_rollback import truncate
from minserve.speculative.proposers import make_proposer
from minserve.speculative.sampled import Verified, verify_sampled
from minserve.speculative.verify import accepted_length, rejection_sample, rows_for_drafts
from minserve.step_timings import StepTimings

Emitted = tuple[Sequence, int, dict[int, float] | None]  # (sequence, token, logprobs)


@dataclass
class Proposal:
    """What `propose` gave one step's batch, for `verify`."""

    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)  # id(seq) -> q [g, vocab]
    num_rounds: int = 0  # draft positions proposed in sequence (the longest draft)


class SpeculativeDecoder:
    """Proposes drafts for a batch and verifies them against the target's logits."""

    def __init__(
        self,
        config: SpeculativeConfig,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        runner: ModelRunner,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.proposer = make_proposer(config, runner)
        self.rejection_sampler = config.rejection_sampler or rejection_sample
        self.lengths = DraftLengths(config.draft_length, config.num_speculative_tokens)
        self.counters = SpecCounters()

    # --- before the forward ---

    def propose(self, batch: SchedulerOutput, rules: StopRules) -> Proposal:
        """Attach drafts to eligible decodes in `batch`, with KV slots for them.

        Slots are reserved first (within the step's token budget and the free blocks), so
        a model proposer can write its own K/V there; unused ones are released after."""
        self.lengths.release_finished()
        budget = self.max_num_batched_tokens - batch.num_batched_tokens
        picked, limits = [], []
        for i, s in enumerate(batch.scheduled):
            limit = min(self._draft_limit(s.seq, rules), budget) if _speculates(s) else 0
            if limit > 0 and self.kv.can_append(s.seq.block_table, limit):
                self.kv.append(s.seq.block_table, limit)
                picked.append(i)
                limits.append(limit)
                budget -= limit
        seqs = [batch.scheduled[i].seq for i in picked]
        rows = [seq.sample.sampling_row(rules) for seq in seqs]
        proposal = Proposal()
        for i, seq, draft in zip(picked, seqs, self.proposer.propose(seqs, limits, rows)):
            drafts = tuple(draft.token_ids)
            truncate(seq.block_table, self.kv.allocator, seq.num_tokens + len(drafts))
            batch.scheduled[i] = replace(batch.scheduled[i], draft_token_ids=drafts)
            if draft.probs is not None:
                proposal.draft_probs[id(seq)] = draft.probs
            proposal.num_rounds = max(proposal.num_rounds, len(drafts))
        return proposal

    def _draft_limit(self, seq: Sequence, rules: StopRules) -> int:
        """g (k, or adaptive), less any tokens past max_tokens or max_model_len (the last one
        is the target's)."""
        limit = self.lengths.length(seq, self.counters.cost_ratio)
        max_tokens = seq.sample.params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - len(seq.sample.token_ids) - 1)
        return min(limit, rules.max_model_len - seq.num_tokens - 1)

    # --- after the forward ---

    def verify(
        self,
        batch: SchedulerOutput,
        proposal: Proposal,
        targets: list[Sequence],
        logits: torch.Tensor,  # [sum of (1 + drafts) over sampling sequences, vocab]
        sampler: Sampler,
        rules: StopRules,
        timings: StepTimings,  # this step's so far: its propose and forward phases
    ) -> list[Emitted]:
        """Verify every sequence's drafts; return the tokens to append, in order."""
        self.counters.record_costs(proposal.num_rounds, timings.propose, timings.forward)
        drafts = {id(s.seq): list(s.draft_token_ids) for s in batch.scheduled}
        rows, logit_rows, spans = self._rows(targets, drafts, rules)
        walked = [bool(drafts.get(id(t))) and not t.sample.params.greedy for t in targets]
        agreeing = [i for i, w in enumerate(walked) if not w]  # greedy, or nothing drafted
        rejection = [i for i, w in enumerate(walked) if w]  # sampling, with drafts
        verified: dict[int, Verified] = {}
        for group, verify_group in ((agreeing, self._agreeing), (rejection, self._rejection)):
            if not group:
                continue
            picked = [r for i in group for r in range(spans[i][0], sum(spans[i]))]
            own = [drafts.get(id(targets[i]), []) for i in group]
            qs = [proposal.draft_probs.get(id(targets[i])) for i in group]
            group_logits = logits[[logit_rows[r] for r in picked]]  # [rows of group, vocab]
            results = verify_group(sampler, group_logits, [rows[r] for r in picked], own, qs)
            verified.update(zip(group, results))
        emitted: list[Emitted] = []
        for i, seq in enumerate(targets):
            tokens, logprobs = verified[i]
            self._accept(seq, len(drafts.get(id(seq), [])), len(tokens) - 1)
            emitted += [(seq, t, lp) for t, lp in zip(tokens, logprobs)]
        return emitted

    @staticmethod
    def _agreeing(
        sampler: Sampler,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        drafts: list[list[int]],
        draft_probs: list[torch.Tensor | None],
    ) -> list[Verified]:
        """Greedy (or draft-less) sequences: sample every row, keep the drafts up to the
        first disagreement and the target's token there."""
        result = sampler(logits, rows)
        verified, first = [], 0
        for own in drafts:
            count = len(own) + 1
            tokens = result.token_ids[first : first + count]
            kept = 1 + accepted_length(tokens, own)
            verified.append((tokens[:kept], result.logprobs[first : first + kept]))
            first += count
        return verified

    def _rejection(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        drafts: list[list[int]],
        draft_probs: list[torch.Tensor | None],
    ) -> list[Verified]:
        """Sampling sequences with drafts: rejection sampling (sampled.py)."""
        return verify_sampled(self.rejection_sampler, sampler, logits, rows, drafts, draft_probs)

    def _rows(
        self, targets: list[Sequence], drafts: dict[int, list[int]], rules: StopRules
    ) -> tuple[list[SamplingRow], list[int], list[tuple[int, int]]]:
        """Sampling rows, their logits rows, and each target's (first row, row count).

        Sampling sequences own consecutive logits rows (1 + drafts each); forked siblings
        (never speculating) follow their parent and share its single row.
        """
        rows: list[SamplingRow] = []
        logit_rows: list[int] = []
        spans: list[tuple[int, int]] = []
        next_row, parent_row = 0, 0
        for seq in targets:
            own = drafts.get(id(seq))
            if own is not None:  # a scheduled sequence; siblings forked this step are not
                parent_row, next_row = next_row, next_row + 1 + len(own)
            seq_rows = rows_for_drafts(seq.sample.sampling_row(rules), own or [])
            spans.append((len(rows), len(seq_rows)))
            logit_rows += range(parent_row, parent_row + len(seq_rows))
            rows += seq_rows
        return rows, logit_rows, spans

    def _accept(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Accepted drafts' K/V are computed; the rejected ones' slots are rolled back."""
        self.counters.num_sampled_seqs += 1
        self.counters.num_emitted_tokens += 1 + num_accepted
        if num_drafts == 0:
            return
        self.lengths.observe(seq, num_drafts, num_accepted)
        self.counters.num_drafts += 1
        self.counters.num_draft_tokens += num_drafts
        self.counters.num_accepted_tokens += num_accepted
        seq.num_computed_tokens += num_accepted
        truncate(seq.block_table, self.kv.allocator, seq.num_computed_tokens)

    def emitted_tokens(self, emitted: list[Emitted]) -> Iterator[Emitted]:
        """Skip tokens after a sequence finished (a stop inside accepted drafts ends it);
        once the engine has appended them all, free the draft state of finished sequences."""
        for seq, token, logprobs in emitted:
            if not seq.sample.finished:
                yield seq, token, logprobs
        release = getattr(self.proposer, "release_finished", None)  # proposers with state
        if release is not None:
            release()
        self.lengths.release_finished()

    def metrics(self) -> dict[str, float]:
        return self.counters.as_metrics()


def _speculates(s: ScheduledSeq) -> bool:
    """Decodes speculate; a request about to fork into n samples waits until it has."""
    return s.seq.is_decode and not s.seq.unforked
