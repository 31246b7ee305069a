"""`SpeculativeDecoder`: the engine's two hooks around one step.

    propose(batch)   after scheduling: give decoding sequences drafts and KV slots for them
    verify(...)      after the forward: sample every verified position, keep what agrees,
                     roll the KV of rejected drafts back

Every decode speculates (greedy or sampling, any n); a sequence still prefilling does not.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from minserve.kvcache.manager import KVCacheManager
from minserve.model.runner import ModelRunner
from minserve.model.sampler import Sampler, SamplingRow
from minserve.request import StopRules
from minserve.scheduler.scheduler import ScheduledSeq, SchedulerOutput
from minserve.scheduler.sequence import Sequence
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.kv_rollback import truncate
from minserve.speculative.proposers import make_proposer
from minserve.speculative.verify import accepted_length, rows_for_drafts

Emitted = tuple[Sequence, int, dict[int, float] | None]  # (sequence, token, logprobs)


@dataclass
class SpecCounters:
    """Acceptance totals (`get_metrics()`, vLLM's spec_decode_* names)."""

    num_drafts: int = 0  # sequence-steps that verified at least one draft
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0
    num_sampled_seqs: int = 0  # sequence-steps that sampled (one target forward each)
    num_emitted_tokens: int = 0

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
        }


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
        self.counters = SpecCounters()

    # --- before the forward ---

    def propose(self, batch: SchedulerOutput, rules: StopRules) -> None:
        """Attach drafts to eligible decodes in `batch`, with KV slots for them.

        Slots are reserved first (within the step's token budget and the free blocks), so
        a model proposer can write its own K/V there; unused ones are released after."""
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
        for i, seq, drafts in zip(picked, seqs, self.proposer.propose(seqs, limits)):
            truncate(seq.block_table, self.kv.allocator, seq.num_tokens + len(drafts))
            batch.scheduled[i] = replace(batch.scheduled[i], draft_token_ids=tuple(drafts))

    def _draft_limit(self, seq: Sequence, rules: StopRules) -> int:
        """k, less any tokens past max_tokens or max_model_len (the last one is the target's)."""
        limit = self.config.num_speculative_tokens
        max_tokens = seq.sample.params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - len(seq.sample.token_ids) - 1)
        return min(limit, rules.max_model_len - seq.num_tokens - 1)

    # --- after the forward ---

    def verify(
        self,
        batch: SchedulerOutput,
        targets: list[Sequence],
        logits: torch.Tensor,  # [sum of (1 + drafts) over sampling sequences, vocab]
        sampler: Sampler,
        rules: StopRules,
    ) -> list[Emitted]:
        """Sample all verified positions at once; return the tokens to append, in order."""
        drafts = {id(s.seq): list(s.draft_token_ids) for s in batch.scheduled}
        rows, logit_rows, spans = self._rows(targets, drafts, rules)
        result = sampler(logits[logit_rows], rows)
        emitted: list[Emitted] = []
        for seq, (first, count) in zip(targets, spans):
            sampled = result.token_ids[first : first + count]
            kept = 1 + accepted_length(sampled, drafts.get(id(seq), []))
            self._accept(seq, count - 1, kept - 1)
            logprobs = result.logprobs[first : first + kept]
            emitted += [(seq, t, lp) for t, lp in zip(sampled[:kept], logprobs)]
        return emitted

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

    def metrics(self) -> dict[str, float]:
        return self.counters.as_metrics()


def _speculates(s: ScheduledSeq) -> bool:
    """Decodes speculate; a request about to fork into n samples waits until it has."""
    return s.seq.is_decode and not s.seq.unforked
