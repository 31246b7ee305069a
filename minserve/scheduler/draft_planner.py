"""The scheduler's side of speculative decoding: how many drafts each decode may get.

Before the step runs, `reserve` gives each eligible decode KV slots for up to g drafts
(g: k, or adaptive per request, `draft_length.py`), within the step's token budget and the
free blocks; the worker proposes and verifies inside those slots. After the step, `accept`
learns from what was accepted (adaptive lengths, the acceptance counters), and the
scheduler rolls the slots of rejected drafts back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from minserve.kvcache.manager import KVCacheManager
from minserve.request import StopRules
from minserve.scheduler.sequence import SeqStatus, Sequence
from minserve.speculative.config import SpeculativeConfig
from minserve.speculative.counters import SpecCounters
from minserve.speculative.draft_length import DraftLengths

if TYPE_CHECKING:
    from minserve.scheduler.scheduler import ScheduledSeq


class DraftPlanner:
    """Draft lengths and slots per decode, and what speculation achieved (`metrics`)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        lengths_cls = config.draft_lengths_cls or DraftLengths
        self.lengths = lengths_cls(config.draft_length, config.num_speculative_tokens)
        self.counters = SpecCounters()

    def reserve(
        self, scheduled: list[ScheduledSeq], budget: int, kv: KVCacheManager, rules: StopRules
    ) -> dict[int, int]:
        """Slots for drafts after each eligible decode's token, within `budget` tokens and
        the free blocks: sequence id -> number of draft slots."""
        self.release_finished()
        slots: dict[int, int] = {}
        for s in scheduled:
            seq = s.seq
            limit = min(self._draft_limit(seq, rules), budget) if _speculates(seq) else 0
            if limit > 0 and kv.can_append(seq.block_table, limit):
                kv.append(seq.block_table, limit)
                slots[seq.seq_id] = limit
                budget -= limit
        return slots

    def _draft_limit(self, seq: Sequence, rules: StopRules) -> int:
        """g (k, or adaptive), less any tokens past max_tokens or max_model_len (the last one
        is the target's)."""
        limit = self.lengths.length(seq, self.counters.cost_ratio)
        max_tokens = seq.sample.params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - len(seq.sample.token_ids) - 1)
        return min(limit, rules.max_model_len - seq.num_tokens - 1)

    def accept(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """One sequence sampled this step, after verifying `num_drafts` drafts."""
        self.counters.num_sampled_seqs += 1
        self.counters.num_emitted_tokens += 1 + num_accepted
        if num_drafts == 0:
            return
        self.lengths.observe(seq, num_drafts, num_accepted)
        self.counters.num_drafts += 1
        self.counters.num_draft_tokens += num_drafts
        self.counters.num_accepted_tokens += num_accepted

    def record_costs(self, num_rounds: int, propose_s: float, forward_s: float) -> None:
        """The step's proposing and verifying forward times (for the draft cost ratio)."""
        self.counters.record_costs(num_rounds, propose_s, forward_s)

    def release_finished(self) -> None:
        """Forget the acceptance estimates of finished and aborted sequences."""
        for seq in [s for s in self.lengths.estimates if s.status is SeqStatus.FINISHED]:
            self.lengths.forget(seq)

    def metrics(self) -> dict[str, float]:
        return self.counters.as_metrics()


def _speculates(seq: Sequence) -> bool:
    """Decodes speculate; a request about to fork into n samples waits until it has."""
    return seq.is_decode and not seq.unforked
