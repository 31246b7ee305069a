"""Checks for chapter 03 (continuous batching), run against any module that defines
`Scheduler`: minserve's own, the solutions, or a student's exercise file.

Each check builds a real KV cache manager (a `BlockAllocator` and block tables of a tiny
model, blocks of 2 tokens), puts a few sequences in it whose fate can be worked out on
paper, calls `Scheduler(config, kv).plan()` and compares the batch, written as
(request, tokens) pairs, with what it should be. `_advance` plays the engine's part
between steps: the scheduled tokens are computed, and a sequence whose tokens are all
computed samples one more. The last check is randomized (hypothesis): random arrivals,
prompt and output lengths, pool sizes, budgets and seats, your scheduler and minserve's
side by side, batch for batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from hypothesis import HealthCheck, Verbosity, given, settings
from hypothesis import strategies as st

from minserve.config import SchedulerConfig
from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.manager import KVCacheManager
from minserve.request import Request
from minserve.sampling_params import SamplingParams
from minserve.scheduler.scheduler import Scheduler as ReferenceScheduler
from minserve.scheduler.scheduler import StepPlan
from minserve.scheduler.sequence import SeqStatus, Sequence

BLOCK_SIZE = 2
Batch = list[tuple[str, int]]


def _scheduler(impl: ModuleType, num_blocks: int, budget: int, max_num_seqs: int = 8) -> Any:
    """The implementation's Scheduler over a fresh KV cache of `num_blocks` blocks."""
    kv = KVCacheManager(BlockAllocator(num_blocks), BLOCK_SIZE)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return impl.Scheduler(config, kv)


def _sequence(
    scheduler: Any, name: str, prompt_len: int, arrival: int, order: int | None = None
) -> Sequence:
    """A one-sample request named `name` that arrived at time `arrival`."""
    request = Request.create(name, list(range(prompt_len)), SamplingParams(), float(arrival))
    order = arrival if order is None else order
    return Sequence(request, request.samples[0], scheduler.kv.new_table(), order=order)


def _waiting(scheduler: Any, name: str, prompt_len: int, arrival: int) -> Sequence:
    """A new request, queued with `scheduler.add` as the engine does."""
    seq = _sequence(scheduler, name, prompt_len, arrival)
    scheduler.add(seq)
    return seq


def _running(
    scheduler: Any, name: str, prompt_len: int, arrival: int, computed: int | None = None
) -> Sequence:
    """A sequence already running: `computed` prompt tokens in the cache, or (None) its
    whole prompt plus one sampled token, so that it is decoding."""
    seq = _sequence(scheduler, name, prompt_len, arrival)
    if computed is None:
        seq.sample.token_ids.append(7)
        computed = prompt_len
    scheduler.kv.append(seq.block_table, computed)
    seq.num_computed_tokens = computed
    seq.status = SeqStatus.RUNNING
    scheduler.running.append(seq)
    return seq


def _advance(out: StepPlan) -> None:
    """The engine's part of a step: compute the scheduled tokens, sample when done."""
    for scheduled in out.scheduled:
        scheduled.seq.num_computed_tokens += scheduled.num_new_tokens
        if scheduled.seq.num_uncomputed_tokens == 0:
            scheduled.seq.sample.token_ids.append(7)


def _batch(out: StepPlan) -> Batch:
    return [(s.seq.request.request_id, s.num_new_tokens) for s in out.scheduled]


def _names(seqs: list[Sequence]) -> list[str]:
    return [seq.request.request_id for seq in seqs]


def _assert_batch(out: StepPlan, expected: Batch, what: str) -> None:
    got = _batch(out)
    assert got == expected, f"{what}: expected the batch {expected}, got {got}  (request, tokens)"


def check_decodes_run_before_prefill_chunks(impl: ModuleType) -> None:
    """A decode runs before an older request's prefill chunk, which gets the budget left."""
    scheduler = _scheduler(impl, num_blocks=32, budget=8)
    _running(scheduler, "long", prompt_len=20, arrival=0, computed=8)  # mid-prefill
    _running(scheduler, "chat", prompt_len=3, arrival=1)  # decoding
    _assert_batch(
        scheduler.plan(),
        [("chat", 1), ("long", 7)],
        "'long' has 12 prompt tokens to go and 'chat' decodes, budget 8",
    )


def check_a_long_prompt_is_chunked_to_the_budget(impl: ModuleType) -> None:
    """A 20-token prompt under a budget of 8 runs as chunks of 8, 8 and 4, then decodes."""
    scheduler = _scheduler(impl, num_blocks=32, budget=8)
    _waiting(scheduler, "long", prompt_len=20, arrival=0)
    for step, tokens in enumerate([8, 8, 4, 1], start=1):
        out = scheduler.plan()
        _assert_batch(out, [("long", tokens)], f"step {step} of a 20-token prompt, budget 8")
        _advance(out)


def check_max_num_seqs_caps_the_batch(impl: ModuleType) -> None:
    """With max_num_seqs = 2, a third request waits (holding no blocks) while two run."""
    scheduler = _scheduler(impl, num_blocks=32, budget=64, max_num_seqs=2)
    third = None
    for arrival, name in enumerate(["a", "b", "c"]):
        third = _waiting(scheduler, name, prompt_len=2, arrival=arrival)
    for step, tokens in enumerate([2, 1], start=1):
        out = scheduler.plan()
        _assert_batch(out, [("a", tokens), ("b", tokens)], f"step {step}, max_num_seqs=2")
        _advance(out)
    assert _names(scheduler.waiting) == ["c"] and not third.block_table.blocks, (
        "after two steps with max_num_seqs=2: expected 'c' still waiting with no blocks, "
        f"got waiting {_names(scheduler.waiting)}, 'c' holding blocks {third.block_table.blocks}"
    )


def check_waiting_requests_are_admitted_first_come_first_served(impl: ModuleType) -> None:
    """Requests queued out of order are admitted in arrival order and become RUNNING."""
    scheduler = _scheduler(impl, num_blocks=32, budget=64)
    for name, arrival in [("c", 2), ("a", 0), ("b", 1)]:
        _waiting(scheduler, name, prompt_len=3, arrival=arrival)
    _assert_batch(
        scheduler.plan(),
        [("a", 3), ("b", 3), ("c", 3)],
        "'c', 'a', 'b' queued (arrived at 2, 0, 1)",
    )
    statuses = {seq.request.request_id: seq.status.value for seq in scheduler.running}
    assert statuses == {"a": "running", "b": "running", "c": "running"} and not scheduler.waiting, (
        "after admitting all three: expected each in scheduler.running with status RUNNING and "
        f"nothing waiting, got running {statuses}, waiting {_names(scheduler.waiting)}"
    )


def check_admission_stops_at_the_first_request_that_does_not_fit(impl: ModuleType) -> None:
    """With 3 free blocks, 'a' (2 blocks) is admitted; 'b' (2) waits, and 'c' (1) behind it."""
    scheduler = _scheduler(impl, num_blocks=3, budget=64)
    for arrival, (name, prompt_len) in enumerate([("a", 4), ("b", 4), ("c", 1)]):
        _waiting(scheduler, name, prompt_len, arrival)
    _assert_batch(
        scheduler.plan(),
        [("a", 4)],
        "3 free blocks of 2 tokens for prompts of 4, 4 and 1 tokens (first come, first served)",
    )
    assert _names(scheduler.waiting) == ["b", "c"], (
        f"expected 'b' and 'c' still waiting, got waiting {_names(scheduler.waiting)}"
    )


def check_out_of_blocks_preempts_the_newest_running_sequence(impl: ModuleType) -> None:
    """Out of blocks, the newest running sequence is preempted: blocks freed, back to waiting."""
    scheduler = _scheduler(impl, num_blocks=6, budget=16)
    for name, arrival in [("a", 0), ("c", 2), ("b", 1)]:  # running in this list order
        _running(scheduler, name, prompt_len=4, arrival=arrival)  # 2 full blocks each
    out = scheduler.plan()
    assert _names(out.preempted) == ["c"], (
        "three decodes, each needing a new block, and no free block: expected to preempt "
        f"'c' (the newest), got out.preempted == {_names(out.preempted)}"
    )
    _assert_batch(out, [("a", 1), ("b", 1)], "after preempting 'c'")
    victim = scheduler.waiting[0] if scheduler.waiting else None
    assert victim is not None and _names(scheduler.waiting) == ["c"], (
        f"expected 'c' back in scheduler.waiting, got waiting {_names(scheduler.waiting)}"
    )
    state = (victim.status.value, victim.num_computed_tokens, victim.block_table.blocks)
    assert state == ("waiting", 0, []), (
        "the preempted 'c' (recompute): expected (status, num_computed_tokens, blocks) == "
        f"('waiting', 0, []), got {state}"
    )
    free = scheduler.kv.allocator.num_free
    assert free == 0 and scheduler.stats.num_preemptions == 1, (
        "expected 0 free blocks ('c' gave back 2, 'a' and 'b' took one each) and "
        f"stats.num_preemptions == 1, got {free} free and {scheduler.stats.num_preemptions}"
    )


def check_a_step_that_preempted_admits_no_one(impl: ModuleType) -> None:
    """A step that preempted admits nothing, though room is left; the next step re-admits."""
    scheduler = _scheduler(impl, num_blocks=4, budget=3)
    _running(scheduler, "a", prompt_len=4, arrival=0)
    _running(scheduler, "b", prompt_len=4, arrival=1)
    out = scheduler.plan()
    _assert_batch(
        out,
        [("a", 1)],
        "'b' was just preempted; 1 block and 2 tokens of budget are left, but admitting "
        "in the step that evicted would thrash",
    )
    _advance(out)
    _assert_batch(
        scheduler.plan(),
        [("a", 1), ("b", 2)],
        "the next step: 'b' is admitted again and recomputes from its first token",
    )


def check_a_sequence_with_no_one_to_preempt_preempts_itself(impl: ModuleType) -> None:
    """A lone sequence that cannot grow is preempted itself, and the step is empty."""
    scheduler = _scheduler(impl, num_blocks=2, budget=16)
    _running(scheduler, "a", prompt_len=4, arrival=0)  # both blocks, full
    out = scheduler.plan()
    got = (_batch(out), _names(out.preempted), _names(scheduler.waiting))
    assert got == ([], ["a"], ["a"]), (
        "'a' needs a third block of a 2-block pool: expected (batch, preempted, waiting) == "
        f"([], ['a'], ['a']), got {got}"
    )


# --- randomized: your scheduler against minserve's, step by step ---------------------------


@dataclass(frozen=True)
class Workload:
    """A pool, limits, and requests as (arrival step, prompt tokens, output tokens)."""

    num_blocks: int
    budget: int
    max_num_seqs: int
    requests: tuple[tuple[int, int, int], ...]

    def __str__(self) -> str:
        requests = "; ".join(
            f"r{i}: step {arrival}, {prompt} prompt, {output} output"
            for i, (arrival, prompt, output) in enumerate(self.requests)
        )
        return (
            f"{self.num_blocks} blocks of {BLOCK_SIZE} tokens, budget {self.budget}, "
            f"max_num_seqs {self.max_num_seqs}; requests (arrives at, tokens) {requests}"
        )


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    """Small pools under pressure, so preemption and chunking happen often. Every request
    fits the pool alone, so minserve's scheduler always finishes: a stall or a mismatch is
    the scheduler under test's."""
    num_blocks = draw(st.integers(3, 8))
    request = st.integers(1, 4).flatmap(
        lambda output: st.tuples(
            st.integers(0, 3), st.integers(1, BLOCK_SIZE * num_blocks - output), st.just(output)
        )
    )
    return Workload(
        num_blocks,
        budget=draw(st.integers(1, 10)),
        max_num_seqs=draw(st.integers(1, 4)),
        requests=tuple(draw(st.lists(request, min_size=1, max_size=6))),
    )


MAX_STEPS = 300


class _Run:
    """One scheduler playing a workload, with the engine's part done here."""

    def __init__(self, scheduler: Any, workload: Workload) -> None:
        self.scheduler = scheduler
        self.workload = workload
        self.outputs: dict[str, int] = {}  # request -> output tokens it stops at

    def arrive(self, step: int) -> None:
        for i, (arrival, prompt, output) in enumerate(self.workload.requests):
            if arrival == step:
                self.outputs[f"r{i}"] = output
                self.scheduler.add(_sequence(self.scheduler, f"r{i}", prompt, arrival, order=i))

    def step(self) -> tuple[Batch, list[str], StepPlan]:
        out = self.scheduler.plan()
        batch, preempted = _batch(out), _names(out.preempted)
        _advance(out)
        for scheduled in out.scheduled:
            seq = scheduled.seq
            if len(seq.sample.token_ids) >= self.outputs[seq.request.request_id]:
                self.scheduler.finish(seq)
        return batch, preempted, out


def _play(impl: ModuleType, workload: Workload) -> None:
    """Your scheduler and minserve's on one workload: the same batch and preemptions every
    step, within the budget and the seats, and every block free at the end."""
    config = SchedulerConfig(
        max_num_seqs=workload.max_num_seqs, max_num_batched_tokens=workload.budget
    )
    yours, ours = (
        _Run(cls(config, KVCacheManager(BlockAllocator(workload.num_blocks), BLOCK_SIZE)), workload)
        for cls in (impl.Scheduler, ReferenceScheduler)
    )
    last_arrival = max(arrival for arrival, _, _ in workload.requests)
    history: list[str] = []
    for step in range(MAX_STEPS):
        yours.arrive(step)
        ours.arrive(step)
        if step > last_arrival and not ours.scheduler.has_unfinished:
            break
        expected, expected_preempted, _ = ours.step()
        got, got_preempted, out = yours.step()
        so_far = "; ".join(history[-6:]) or "none"
        where = f"{workload}\nat step {step} (steps before it, minserve's: {so_far})"
        assert out.num_batched_tokens <= workload.budget, (
            f"{where}: your batch {got} has {out.num_batched_tokens} tokens, over the budget"
        )
        seats = sum(seq.width for seq in yours.scheduler.running)
        assert seats <= workload.max_num_seqs, (
            f"{where}: {seats} sequences running, over max_num_seqs"
        )
        assert (got, got_preempted) == (expected, expected_preempted), (
            f"{where}: expected the batch {expected} preempting {expected_preempted}, "
            f"got {got} preempting {got_preempted}  (request, tokens)"
        )
        history.append(f"{step}: {expected}")
    left = _names(yours.scheduler.waiting + yours.scheduler.running)
    free = yours.scheduler.kv.allocator.num_free
    assert not left and free == workload.num_blocks, (
        f"{workload}\nafter every request finished: expected nothing waiting or running and "
        f"all {workload.num_blocks} blocks free, got {left} and {free} free"
    )


def check_random_workloads_match_minserves_scheduler(impl: ModuleType) -> None:
    """Random arrivals, lengths, pools, budgets and seats: the same batches as minserve's"""

    @settings(
        max_examples=150,
        report_multiple_bugs=False,
        deadline=None,
        database=None,
        derandomize=True,
        verbosity=Verbosity.quiet,
        suppress_health_check=list(HealthCheck),
    )
    @given(workloads())
    def play(workload: Workload) -> None:
        _play(impl, workload)

    _play(impl, Workload(6, 4, 2, ((0, 3, 2), (0, 5, 1), (1, 2, 3))))  # a stub stops here
    play()


# shrinking a failing workload to its smallest runs the scheduler hundreds of times
check_random_workloads_match_minserves_scheduler.time_limit_factor = 3  # type: ignore[attr-defined]


CHECKS = [
    check_decodes_run_before_prefill_chunks,
    check_a_long_prompt_is_chunked_to_the_budget,
    check_max_num_seqs_caps_the_batch,
    check_waiting_requests_are_admitted_first_come_first_served,
    check_admission_stops_at_the_first_request_that_does_not_fit,
    check_out_of_blocks_preempts_the_newest_running_sequence,
    check_a_step_that_preempted_admits_no_one,
    check_a_sequence_with_no_one_to_preempt_preempts_itself,
    check_random_workloads_match_minserves_scheduler,
]

# What each pass of an exercise's loop must change; a check that runs past its time limit
# in that exercise's code says so.
PROGRESS = {
    "3.1": (
        "each pass must take a sequence off the queue (schedule it, skip it, or preempt "
        "it), and admission must stop at the first waiting sequence that does not fit"
    ),
}

HINTS = {
    "3.1": (
        "Two passes build the batch. Running sequences go first, decodes before prefill "
        "chunks, because a stream that stalls is worse than a late start; when the KV "
        "cache cannot grow, free blocks by preempting the sequence the policy serves last. "
        "Then admit waiting sequences in policy order, and stop at the first one that does "
        "not fit, so a small late request cannot overtake a large early one.",
        "_schedule_running: sort a copy of self.running by (not a decode, policy key); pop "
        "from the front; ask self._chunk for its tokens (0: skip it); while "
        "self.kv.can_append says no, preempt the last of the queue (or the sequence itself "
        "when the queue is empty, then move on); else append its blocks, add a ScheduledSeq "
        "and spend the budget; return what is left. _admit_waiting: sort self.waiting by "
        "the policy; look at the front one; return when its seats, its chunk or its blocks "
        "do not fit; else take it off the queue and admit it.",
        "Sort key for the running pass: a tuple, (not seq.is_decode, self.policy(seq)), so "
        "decodes sort first. Grow loop: `while not self.kv.can_append(seq.block_table, n):` "
        "pick the victim with max(..., key=self.policy) over the sequences still queued "
        "(seq itself when none are), hand it to self._preempt with out, and leave the loop "
        "once seq was the victim; a while-else then appends and schedules. Admission "
        "returns when self._num_seqs() + seq.width exceeds config.max_num_seqs, or the "
        "chunk is 0, or the blocks are short; an admitted sequence becomes "
        "SeqStatus.RUNNING.",
    ),
}
