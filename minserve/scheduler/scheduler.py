"""Iteration-level scheduling with chunked prefill and preemption (vLLM + Sarathi-Serve).

Every step, under a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`):
1. running sequences first, decodes before prefill chunks, so streams never stall;
   when the KV pool runs out of blocks, the lowest-priority running sequence is
   preempted (recomputed later, or swapped to host memory when swap space is set);
2. then swapped-out sequences come back, then waiting ones are admitted, each with as
   much of its prompt as the remaining budget allows (a chunk, with chunked prefill).

The class is chapter 03's exercise (the marked region below): students write
`_schedule_running` and `_admit_waiting`, and their class plugs into the engine with
`LLM(scheduler_cls=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minserve.config import SchedulerConfig
from minserve.kvcache.manager import KVCacheManager
from minserve.scheduler.policy import get_policy
from minserve.scheduler.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence in this step's batch, with the number of tokens it runs."""

    seq: Sequence
    num_new_tokens: int
    draft_token_ids: tuple[int, ...] = ()  # speculative decoding: guesses verified this step

    @property
    def start(self) -> int:
        """Position of the first token this step computes."""
        return self.seq.num_computed_tokens

    @property
    def num_query_tokens(self) -> int:
        """Tokens the model runs for this sequence: its new tokens plus any drafts."""
        return self.num_new_tokens + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    """This step's batch (decodes first) and what had to make room for it."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    """Counters the engine reports through `get_metrics()`."""

    num_preemptions: int = 0
    num_swapped_out: int = 0
    num_swapped_in: int = 0


# >>> exercise 3.1: schedule(): running sequences first, then waiting ones
class Scheduler:
    """Decides, each step, which sequences run and how many tokens each computes.

    Iteration-level scheduling (Orca, vLLM): the batch is rebuilt every step, so a
    finished sequence's seat goes to a waiting one at once, instead of idling until the
    whole batch is done (static batching). Plug your class into the engine with
    `LLM(scheduler_cls=Scheduler)`.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.policy = get_policy(config.scheduling_policy, kv)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        """This step's batch: swapped sequences back in, running ones, then waiting ones."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._swap_in()
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # admitting new work while evicting old would thrash
            self._admit_waiting(out, budget)
        self._release_cached_prefixes()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give each running sequence its tokens, decodes first, preempting when blocks run out.

        Visit `self.running` decodes first (`seq.is_decode`), then in policy order
        (`self.policy(seq)` is a sort key: lower is served first). Each sequence asks
        `self._chunk(seq, budget)` for its tokens (0: skip it this step). If
        `self.kv.can_append(seq.block_table, n)` says no, preempt the one the policy
        serves last among those not yet visited this step, `self._preempt(victim, out)`,
        and try again; when none is left, preempt `seq` itself and move on. Otherwise
        `self.kv.append(seq.block_table, n)`, add `ScheduledSeq(seq, n)` to
        `out.scheduled` and spend `n` of the budget. Returns the budget left.
        """
        # >>> solution
        queue = sorted(self.running, key=lambda s: (not s.is_decode, self.policy(s)))
        while queue:
            seq = queue.pop(0)
            num_new = self._chunk(seq, budget)
            if num_new == 0:
                continue
            while not self.kv.can_append(seq.block_table, num_new):
                victim = max(queue, key=self.policy) if queue else seq
                if victim is not seq:
                    queue.remove(victim)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self.kv.append(seq.block_table, num_new)
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        return budget
        # <<< solution

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in policy order while budget, seats and blocks last.

        Sort `self.waiting` by `self.policy` and admit from the front; stop at the first
        one that does not fit (so no later, smaller request jumps the queue): it fits when
        its `seq.width` more sequences stay within `config.max_num_seqs` (count with
        `self._num_seqs()`), `self._chunk` gives it tokens, and the KV cache has the
        blocks. An admitted sequence gets its blocks, becomes RUNNING, joins
        `self.running` and `out.scheduled`, and spends its tokens of the budget.
        """
        # >>> solution
        self.waiting.sort(key=self.policy)
        while self.waiting:
            seq = self.waiting[0]
            if self._num_seqs() + seq.width > self.config.max_num_seqs:
                return
            num_new = self._chunk(seq, budget)
            if num_new == 0 or not self.kv.can_append(seq.block_table, num_new):
                return
            self.waiting.pop(0)
            self.kv.append(seq.block_table, num_new)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        # <<< solution

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` may compute now: all it needs, or a chunk of it (Sarathi-Serve).

        A waiting sequence first picks up the cached blocks of its longest cached prefix
        (prefix caching): those tokens are computed already.
        """
        if seq.status is SeqStatus.WAITING and not seq.block_table.blocks:
            seq.num_computed_tokens = self.kv.reuse_prefix(seq.block_table, seq.token_ids)
        needed = seq.num_uncomputed_tokens
        if needed <= budget:
            return needed
        return budget if self.config.enable_chunked_prefill else 0

    def _release_cached_prefixes(self) -> None:
        """Waiting sequences hold no blocks between steps: drop cached prefixes picked up by
        `_chunk` for a sequence that was then not admitted (they stay in the cache)."""
        for seq in self.waiting:
            if seq.block_table.blocks:
                self.kv.free(seq.block_table)
                seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take `seq` off the batch: swap its blocks to host memory, or free them to recompute."""
        self.running.remove(seq)
        self.stats.num_preemptions += 1
        out.preempted.append(seq)
        if self.kv.can_swap_out(seq.block_table):
            self.kv.swap_out(seq, seq.block_table)
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
            self.stats.num_swapped_out += 1
            return
        self.kv.free(seq.block_table)
        seq.num_computed_tokens = 0  # recompute: prompt and outputs so far, as one prefill
        self.add(seq)

    def _swap_in(self) -> None:
        """Bring swapped sequences back while their blocks (plus one to grow) are free."""
        self.swapped.sort(key=self.policy)
        while self.swapped and self._num_seqs() < self.config.max_num_seqs:
            seq = self.swapped[0]
            if not self.kv.can_swap_in(seq, headroom=1):
                return
            self.swapped.pop(0)
            self.kv.swap_in(seq, seq.block_table)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.stats.num_swapped_in += 1

    def _num_seqs(self) -> int:
        return sum(s.width for s in self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks, wherever it is."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.kv.free(seq.block_table)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            self.kv.free(seq.block_table)  # a recomputing sequence may hold none; harmless
        elif seq.status is SeqStatus.SWAPPED:
            self.swapped.remove(seq)
            self.kv.discard_swapped(seq)
        seq.status = SeqStatus.FINISHED

    def fork(self, seq: Sequence) -> list[Sequence]:
        """After a request's prefill: n - 1 siblings sharing the prompt's blocks."""
        siblings = [
            Sequence(
                request=seq.request,
                sample=sample,
                block_table=self.kv.fork(seq.block_table),
                priority=seq.priority,
                status=SeqStatus.RUNNING,
                order=seq.order,
                num_computed_tokens=seq.num_computed_tokens,
            )
            for sample in seq.unforked
        ]
        seq.unforked = []
        self.running.extend(siblings)
        return siblings


# <<< exercise
