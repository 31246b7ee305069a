"""Iteration-level scheduling with chunked prefill and preemption (vLLM + Sarathi-Serve).

Every step, under a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`):
1. running sequences first, decodes before prefill chunks, so streams never stall;
   when the KV pool runs out of blocks, the lowest-priority running sequence is
   preempted (recomputed later, or swapped to host memory when swap space is set);
2. then swapped-out sequences come back, then waiting ones are admitted, each with as
   much of its prompt as the remaining budget allows (a chunk, with chunked prefill).

`schedule()` returns the step as plain data (`SchedulerOutput`, `minserve/messages.py`):
token ids, positions, block tables, the block copies the worker makes first and the
sequences finished since the last step (the worker drops their state). After the worker
ran it, `update_from_output()` is the one place that moves scheduling state on: requests
the worker failed are aborted, then computed tokens, prefix-cache inserts, forks, appended
tokens, finished sequences. It returns each sample's new tokens, the sequences it finished
and the requests it aborted (`SchedulerUpdate`) for the output processor, whose one message
back (`OutputStops`: stop strings, text that failed) `apply_stops()` carries out.

Chapter 03's exercises are marked regions below: 3.1 is `append_sampled`, a sequence's
sampled tokens appended under the stop rules; 3.2 is the class, where students write
`_schedule_running` and `_admit_waiting`; 3.3 is the step's result, `advance_sequences`
after the class, which `update_from_output` calls (and which calls 3.1). A student's
class, with the 3.1 and 3.3 functions of its own module, plugs into the engine with
`LLM(scheduler_cls=...)`. Two decisions it asks of small functions are chapter 04's
exercises: a sequence's share of the token budget (`budget.prefill_chunk`) and whether a
preempted sequence is swapped or recomputed (`preemption.preemption_mode`); the engine
takes yours with `LLM(chunk_rule=..., preemption_rule=...)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from minserve.config import SchedulerConfig
from minserve.kvcache.block_table import BlockTable
from minserve.kvcache.manager import KVCacheManager
from minserve.messages import (
    ModelRunnerOutput,
    NewTokens,
    OutputStops,
    SampledTokens,
    ScheduledChunk,
    SchedulerOutput,
    SchedulerUpdate,
)
from minserve.request import StopRules
from minserve.scheduler.budget import prefill_chunk
from minserve.scheduler.draft_planner import DraftPlanner
from minserve.scheduler.policy import get_policy
from minserve.scheduler.preemption import PreemptionMode, preemption_mode
from minserve.scheduler.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence in the batch being planned, with the number of tokens it runs."""

    seq: Sequence
    num_new_tokens: int

    @property
    def start(self) -> int:
        """Position of the first token this step computes (while the step is planned)."""
        return self.seq.num_computed_tokens


@dataclass
class StepPlan:
    """The batch `schedule()` is building (decodes first) and what had to make room for it."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class SchedulerStats:
    """Counters the engine reports through `get_metrics()`."""

    num_preemptions: int = 0
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    num_generation_tokens: int = 0
    num_prefix_cache_queries: int = 0  # prompt tokens of requests that started
    num_prefix_cache_hits: int = 0  # ... of which came from the prefix cache
    # the same for requests coming back after a preemption (vLLM's preempted_*): what the
    # cache and its tiers gave back of what they had computed
    num_preempted_cache_queries: int = 0
    num_preempted_cache_hits: int = 0


# >>> exercise 3.1: append a step's sampled tokens, with the stop rules
def append_sampled(scheduler: Scheduler, seq: Sequence, tokens: SampledTokens) -> NewTokens:
    """Append sampled tokens to `seq.sample` one at a time, with the stop rules.

    `seq.sample.append(token, scheduler.rules)` adds one token and checks EOS, stop token
    ids, max_tokens and the model's length limit; once `seq.sample.finished`, the sequence
    is done: `scheduler.finish(seq)` frees its blocks, and the tokens after the stop (a
    stop may come inside accepted drafts) are dropped. Add the tokens kept to
    `scheduler.stats.num_generation_tokens`; `kept` counts them for the `NewTokens` below.
    """
    sample, kept = seq.sample, 0
    # >>> solution
    for token in tokens.token_ids:
        sample.append(token, scheduler.rules)
        kept += 1
        if sample.finished:
            scheduler.finish(seq)
            break
    scheduler.stats.num_generation_tokens += kept
    # <<< solution
    return NewTokens(
        request_id=seq.request_id,
        index=sample.index,
        token_ids=tokens.token_ids[:kept],
        logprobs=tokens.logprobs[:kept],
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason,
        num_cached_tokens=seq.request.num_cached_tokens or 0,
    )


# <<< exercise


# >>> exercise 3.2: schedule(): running sequences first, then waiting ones
class Scheduler:
    """Decides, each step, which sequences run and how many tokens each computes.

    Iteration-level scheduling (Orca, vLLM): the batch is rebuilt every step, so a
    finished sequence's seat goes to a waiting one at once, instead of idling until the
    whole batch is done (static batching). Plug your class into the engine with
    `LLM(scheduler_cls=Scheduler)`.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        rules: StopRules | None = None,
        drafts: DraftPlanner | None = None,
        chunk_rule: Callable[[int, int, bool], int] = prefill_chunk,
        preemption_rule: Callable[[int, int, int], PreemptionMode] = preemption_mode,
    ) -> None:
        self.config = config
        self.kv = kv
        self.rules = rules or StopRules((), 1 << 62)  # what ends a sequence besides its params
        self.drafts = drafts  # speculative decoding: draft slots per decode
        self.policy = get_policy(config.scheduling_policy, kv)
        self.chunk_rule = chunk_rule  # a sequence's share of the budget (chapter 04)
        self.preemption_rule = preemption_rule  # swap or recompute a victim (chapter 04)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}  # every live sequence, by id
        self.stats = SchedulerStats()
        self._finished_ids: list[int] = []  # since the last step: the worker drops their state

    def add(self, seq: Sequence) -> None:
        """Queue a sequence to (re)compute from its first uncomputed token."""
        seq.status = SeqStatus.WAITING
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        """This step, as plain data for the worker: the batch `plan()` builds, the slots
        for speculative drafts, and the block operations decided meanwhile."""
        plan = self.plan()
        draft_slots = {}
        if self.drafts is not None:
            budget_left = self.config.max_num_batched_tokens - plan.num_batched_tokens
            draft_slots = self.drafts.reserve(plan.scheduled, budget_left, self.kv, self.rules)
        return self._output(plan, draft_slots)

    def plan(self) -> StepPlan:
        """This step's batch: swapped sequences back in, running ones, then waiting ones."""
        out = StepPlan()
        budget = self.config.max_num_batched_tokens
        self._swap_in()
        budget = self._schedule_running(out, budget)
        if not out.preempted:  # admitting new work while evicting old would thrash
            self._admit_waiting(out, budget)
        self._release_cached_prefixes()
        return out

    def _schedule_running(self, out: StepPlan, budget: int) -> int:
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

    def _admit_waiting(self, out: StepPlan, budget: int) -> None:
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
        (prefix caching): those tokens are computed already. Not one that asks for prompt
        logprobs: a cached prefix has no logits, so it computes its whole prompt (as vLLM).
        """
        reuses = seq.sample.params.prompt_logprobs is None
        if seq.status is SeqStatus.WAITING and not seq.block_table.blocks and reuses:
            seq.num_computed_tokens = self.kv.reuse_prefix(seq.block_table, seq.token_ids)
        return self.chunk_rule(
            seq.num_uncomputed_tokens, budget, self.config.enable_chunked_prefill
        )

    def _release_cached_prefixes(self) -> None:
        """Waiting sequences hold no blocks between steps: drop cached prefixes picked up by
        `_chunk` for a sequence that was then not admitted (they stay in the cache)."""
        for seq in self.waiting:
            if seq.block_table.blocks:
                self.kv.free(seq.block_table)
                seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence, out: StepPlan) -> None:
        """Take `seq` off the batch: swap its blocks to host memory, or free them to recompute."""
        self.running.remove(seq)
        self.stats.num_preemptions += 1
        out.preempted.append(seq)
        num_blocks = len(seq.block_table.blocks)
        if self.preemption_rule(num_blocks, *self.kv.swap_room()) == "swap":
            self.kv.swap_out(seq.seq_id, seq.block_table)
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
            self.stats.num_swapped_out += 1
            return
        self.kv.free(seq.block_table)
        seq.num_computed_tokens = 0  # recompute: prompt and outputs so far, as one prefill
        seq.recomputing = True
        self.add(seq)

    def _swap_in(self) -> None:
        """Bring swapped sequences back while their blocks (plus one to grow) are free."""
        self.swapped.sort(key=self.policy)
        while self.swapped and self._num_seqs() < self.config.max_num_seqs:
            seq = self.swapped[0]
            if not self.kv.can_swap_in(seq.seq_id, headroom=1):
                return
            self.swapped.pop(0)
            self.kv.swap_in(seq.seq_id, seq.block_table)
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
            self.kv.discard_swapped(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        if self.seqs.pop(seq.seq_id, None) is not None:
            self._finished_ids.append(seq.seq_id)

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
        self.seqs.update((s.seq_id, s) for s in siblings)
        return siblings

    # --- the step as data, and its result ---

    def _output(self, plan: StepPlan, draft_slots: dict[int, int]) -> SchedulerOutput:
        """The planned batch as plain data, with the block operations decided meanwhile and
        the sequences finished since the last step."""
        chunks = tuple(self._chunk_of(s, draft_slots.get(s.seq.seq_id, 0)) for s in plan.scheduled)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(
            chunks=chunks,
            block_ops=self.kv.take_block_ops(),
            preempted_request_ids=tuple(seq.request_id for seq in plan.preempted),
            finished_seq_ids=finished,
        )

    def _chunk_of(self, s: ScheduledSeq, num_draft_slots: int) -> ScheduledChunk:
        seq, start = s.seq, s.start
        end = start + s.num_new_tokens
        samples = ()
        if end == seq.num_tokens:  # its last token: sample, for it and the siblings it forks
            family = [seq.sample, *seq.unforked]
            samples = tuple(sample.sampling_row(self.rules) for sample in family)
        return ScheduledChunk(
            seq_id=seq.seq_id,
            request_id=seq.request_id,
            token_ids=seq.token_slice(start, end),
            start=start,
            block_table=tuple(seq.block_table.blocks),
            samples=samples,
            num_draft_slots=num_draft_slots,
            num_prompt_tokens=len(seq.sample.prompt_token_ids),
            prompt_logprobs=seq.sample.params.prompt_logprobs or 0,
            prompt_targets=seq.prompt_targets(start, end),
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> SchedulerUpdate:
        """Move every scheduled sequence on by what the step computed and sampled.

        The one writer of `num_computed_tokens`: requests the worker failed alone are
        aborted first (their tokens are not looked for); then chunks become computed (and
        their full blocks cached), accepted drafts too (rejected drafts' slots are rolled
        back), a finished prefill forks into its n samples, sampled tokens are appended
        with the token stop rules, and finished sequences free their blocks
        (`advance_sequences`, exercise 3.3). Returns each sample's new tokens, in batch
        order, with the sequences finished and the requests aborted meanwhile.
        """
        if self.drafts is not None and runner_output.timings is not None:
            timings = runner_output.timings
            self.drafts.record_costs(
                runner_output.num_draft_rounds, timings.propose, timings.forward
            )
        first_finished = len(self._finished_ids)
        for request_id in runner_output.failed:
            self.abort_request(request_id)
        new_tokens = advance_sequences(self, scheduler_output, runner_output)
        if self.drafts is not None:
            self.drafts.release_finished()
        return SchedulerUpdate(
            new_tokens=tuple(new_tokens),
            finished_seq_ids=tuple(self._finished_ids[first_finished:]),
            failed=dict(runner_output.failed),
            prompt_logprobs=runner_output.prompt_logprobs,
        )

    def _record_cache_hit(self, seq: Sequence, start: int) -> None:
        """A request's first chunk starts after its cached prefix: that many tokens were hits
        (of its prompt, and of a resumed request's resume tokens: its sample's first). So
        does the first chunk of a request back from a preemption to recompute."""
        request = seq.request
        if request.num_cached_tokens is None:
            request.num_cached_tokens = start
            self.stats.num_prefix_cache_queries += seq.num_tokens  # nothing sampled here yet
            self.stats.num_prefix_cache_hits += start
        elif seq.recomputing:  # back after a preemption: counted apart, as vLLM does
            seq.recomputing = False
            self.stats.num_preempted_cache_queries += seq.num_tokens
            self.stats.num_preempted_cache_hits += start

    def _accept_drafts(
        self, seq: Sequence, num_drafts: int, tokens: SampledTokens, num_draft_slots: int
    ) -> None:
        """Accepted drafts' K/V are computed; the slots of the rest are rolled back."""
        assert self.drafts is not None
        num_accepted = len(tokens.token_ids) - 1
        self.drafts.accept(seq, num_drafts, num_accepted)
        seq.num_computed_tokens += num_accepted
        if num_draft_slots:
            self.kv.truncate(seq.block_table, seq.num_computed_tokens)

    def apply_stops(self, stops: OutputStops) -> None:
        """The output processor's message back: finish the samples a stop string ended,
        abort the requests whose tokens could not be turned into output."""
        for request_id, index in stops.stopped:
            self.stop_sample(request_id, index)
        for request_id in stops.failed:
            self.abort_request(request_id)

    def stop_sample(self, request_id: str, index: int) -> None:
        """A stop string ended this sample (the output processor found it): finish it."""
        for seq in self.sequences_of(request_id):
            if seq.sample.index == index:
                seq.sample.finish("stop")
                self.finish(seq)

    # --- prefill/decode disaggregation: a sequence leaves after its prefill, or arrives ---

    def detach(self, seq: Sequence) -> None:
        """Take a running sequence out of scheduling but keep its blocks (a prefill instance
        sends its KV, then frees them with `free_detached`)."""
        if seq.status is not SeqStatus.RUNNING or seq.num_uncomputed_tokens != 1:
            raise ValueError(
                f"request {seq.request_id!r} is not a running, fully prefilled request"
            )
        self.running.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.seqs.pop(seq.seq_id, None)

    def free_detached(self, seq: Sequence) -> None:
        self.kv.free(seq.block_table)

    def resume(self, seq: Sequence, first_token: int, num_computed: int) -> NewTokens:
        """A waiting sequence another instance prefilled: append its first token; with
        `num_computed` > 0 its first tokens' KV arrives from there, so blocks are allocated
        for them now (the caller fills `seq.block_table`) and the next step decodes.
        Returns the first token as new tokens (the output processor's text starts there)."""
        first = append_sampled(self, seq, SampledTokens((first_token,), (None,)))
        if seq.status is SeqStatus.FINISHED or num_computed == 0:
            return first
        if not self.kv.can_append(seq.block_table, num_computed):
            raise MemoryError(
                f"no room for {num_computed} transferred tokens: "
                f"{self.kv.allocator.num_free} free blocks of {self.kv.block_size} tokens"
            )
        self.waiting.remove(seq)
        self.kv.append(seq.block_table, num_computed)
        seq.num_computed_tokens = num_computed
        seq.request.num_cached_tokens = 0
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return first

    def sequences_of(self, request_id: str) -> list[Sequence]:
        return [s for s in self.seqs.values() if s.request_id == request_id]

    def abort_request(self, request_id: str) -> None:
        """Finish every sequence of a request, wherever it is; its blocks are freed."""
        for seq in [s for s in self.seqs.values() if s.request_id == request_id]:
            self.finish(seq)


# <<< exercise


# >>> exercise 3.3: update_from_output(): move each sequence on by what the step produced
def advance_sequences(
    scheduler: Scheduler, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
) -> list[NewTokens]:
    """Move every scheduled sequence on by what the step computed and sampled.

    For each chunk of `scheduler_output.chunks`, in order: skip it when its sequence is
    gone (`scheduler.seqs.get(chunk.seq_id)` is None: aborted meanwhile). Otherwise note
    the request's prefix-cache hit (`scheduler._record_cache_hit(seq, chunk.start)`), mark
    the chunk's tokens computed (`seq.num_computed_tokens` becomes the chunk's end) and,
    with a prefix cache (`scheduler.kv.prefix_cache`), cache the blocks they filled
    (`scheduler.kv.cache_computed(seq.block_table, seq.token_ids, num_computed)`). A chunk
    with no entry in `runner_output.sampled` was a prompt chunk before the last: nothing
    was sampled. Otherwise its sequence (and, after a prefill with n > 1, the siblings
    `scheduler.fork(seq)` creates, in that order) each get one `SampledTokens`. With
    speculative decoding (`scheduler.drafts`), each member first accepts its drafts
    (`scheduler._accept_drafts(member, num_drafts, tokens, chunk.num_draft_slots)`, where
    `num_drafts` is `runner_output.num_drafts.get(seq_id, 0)` for the first member and 0
    for the siblings); then its tokens are appended with `append_sampled`. Returns the
    `NewTokens` of every member, in batch order.
    """
    # >>> solution
    new_tokens: list[NewTokens] = []
    for chunk in scheduler_output.chunks:
        seq = scheduler.seqs.get(chunk.seq_id)
        if seq is None:  # aborted since the step was scheduled
            continue
        scheduler._record_cache_hit(seq, chunk.start)
        seq.num_computed_tokens = chunk.start + chunk.num_new_tokens
        if scheduler.kv.prefix_cache is not None:  # blocks this step filled join the cache
            scheduler.kv.cache_computed(seq.block_table, seq.token_ids, seq.num_computed_tokens)
        sampled = runner_output.sampled.get(chunk.seq_id)
        if sampled is None:  # a prompt chunk that is not the last one
            continue
        family = [seq, *scheduler.fork(seq)] if seq.unforked else [seq]
        num_drafts = runner_output.num_drafts.get(chunk.seq_id, 0)
        for member, tokens in zip(family, sampled, strict=True):
            if scheduler.drafts is not None:
                scheduler._accept_drafts(member, num_drafts, tokens, chunk.num_draft_slots)
                num_drafts = 0  # siblings forked this step never speculate
            new_tokens.append(append_sampled(scheduler, member, tokens))
    return new_tokens
    # <<< solution


# <<< exercise


def adopt_computed(
    scheduler: Scheduler, seq: Sequence, table: BlockTable, num_computed: int
) -> None:
    """A waiting sequence whose first `num_computed` tokens' KV another instance computed
    and sent into `table` (live migration): it runs from there, as it would have there."""
    if seq.status is not SeqStatus.WAITING or seq.block_table.blocks:
        raise ValueError(f"request {seq.request_id!r} is not a waiting sequence without blocks")
    if not 0 < num_computed < seq.num_tokens or table.num_tokens != num_computed:
        raise ValueError(
            f"request {seq.request_id!r} has {seq.num_tokens} tokens; a table of "
            f"{table.num_tokens} tokens cannot hold its first {num_computed} computed ones"
        )
    scheduler.waiting.remove(seq)
    seq.block_table = table
    seq.num_computed_tokens = num_computed
    seq.request.num_cached_tokens = 0
    seq.status = SeqStatus.RUNNING
    scheduler.running.append(seq)
