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

The checks of exercises 3.1 and 3.3 drive minserve's own scheduler and hand the step's
result to your `append_sampled` (3.1) and `advance_sequences` (3.3): the worker's part is
played here, with sampled tokens chosen at random, and your update must leave every
sequence, block and counter as minserve's does.

The checks of exercise 3.4, the model runner's flat batch, are in
`checks_ch03_flat_batch.py`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from minserve.config import SchedulerConfig
from minserve.course.checks_ch03_flat_batch import (
    FLAT_BATCH_CHECKS,
    FLAT_BATCH_HINTS,
    FLAT_BATCH_PROGRESS,
)
from minserve.course.randomized import randomized
from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.manager import KVCacheManager
from minserve.kvcache.radix_cache import RadixCache
from minserve.messages import ModelRunnerOutput, NewTokens, SampledTokens, SchedulerOutput
from minserve.request import Request, StopRules
from minserve.sampling_params import SamplingParams
from minserve.scheduler.draft_planner import DraftPlanner
from minserve.scheduler.scheduler import Scheduler as ReferenceScheduler
from minserve.scheduler.scheduler import StepPlan
from minserve.scheduler.sequence import SeqStatus, Sequence
from minserve.speculative.config import SpeculativeConfig

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

    @randomized(150)
    @given(workloads())
    def play(workload: Workload) -> None:
        _play(impl, workload)

    _play(impl, Workload(6, 4, 2, ((0, 3, 2), (0, 5, 1), (1, 2, 3))))  # a stub stops here
    play()


# shrinking a failing workload to its smallest runs the scheduler hundreds of times
check_random_workloads_match_minserves_scheduler.time_limit_factor = 3  # type: ignore[attr-defined]


# --- exercises 3.1 and 3.3: the step's result, on minserve's scheduler -----------------------

EOS = 0


def _reference(
    num_blocks: int = 32, budget: int = 64, max_model_len: int = 1 << 30, **kv_options: Any
) -> ReferenceScheduler:
    """minserve's scheduler, EOS token 0, over a fresh KV cache (your 3.1 and 3.3 move it on)."""
    kv = KVCacheManager(BlockAllocator(num_blocks), BLOCK_SIZE, **kv_options)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget)
    return ReferenceScheduler(config, kv, StopRules((EOS,), max_model_len))


def _decoding(scheduler: ReferenceScheduler, name: str, params: SamplingParams) -> Sequence:
    """A one-sample request with a 3-token prompt, prefilled and decoding (1 output token)."""
    request = Request.create(name, [1, 2, 3], params, 0.0)
    seq = Sequence(request, request.samples[0], scheduler.kv.new_table())
    request.num_cached_tokens = 0
    seq.sample.token_ids.append(9)
    scheduler.kv.append(seq.block_table, 4)
    seq.num_computed_tokens = 4
    seq.status = SeqStatus.RUNNING
    scheduler.running.append(seq)
    scheduler.seqs[seq.seq_id] = seq
    return seq


def _appended(
    impl: ModuleType, params: SamplingParams, tokens: tuple[int, ...]
) -> tuple[NewTokens, Sequence, ReferenceScheduler]:
    scheduler = _reference(num_blocks=8)
    seq = _decoding(scheduler, "a", params)
    new = impl.append_sampled(scheduler, seq, SampledTokens(tokens, (None,) * len(tokens)))
    return new, seq, scheduler


def _assert_new_tokens(got: NewTokens, expected: tuple, what: str) -> None:
    fields = (got.token_ids, got.finish_reason, got.stop_reason)
    assert fields == expected, (
        f"{what}: expected (token_ids, finish_reason, stop_reason) == {expected}, got {fields}"
    )


def check_a_stop_token_among_accepted_drafts_ends_the_sequence(impl: ModuleType) -> None:
    """Tokens (3, 5, 4) with stop token 5: (3, 5) are kept, "stop", and the blocks are freed."""
    params = SamplingParams(stop_token_ids=[5])
    new, seq, scheduler = _appended(impl, params, (3, 5, 4))
    _assert_new_tokens(new, ((3, 5), "stop", 5), "stop_token_ids=[5], tokens (3, 5, 4)")
    state = (seq.status.value, seq.sample.token_ids, scheduler.kv.allocator.num_free)
    assert state == ("finished", [9, 3, 5], 8), (
        "after the stop: expected (status, sample.token_ids, free blocks of 8) == "
        f"('finished', [9, 3, 5], 8), got {state}"
    )
    counted = scheduler.stats.num_generation_tokens
    assert counted == 2, f"expected stats.num_generation_tokens == 2 (tokens kept), got {counted}"


def check_eos_and_max_tokens_end_a_sequence(impl: ModuleType) -> None:
    """EOS ends a sample with "stop" (stop_reason None); max_tokens ends it with "length"."""
    new, _, _ = _appended(impl, SamplingParams(), (4, EOS, 6))
    _assert_new_tokens(new, ((4, EOS), "stop", None), f"EOS is {EOS}, tokens (4, {EOS}, 6)")
    new, seq, _ = _appended(impl, SamplingParams(max_tokens=3), (4, 5, 6))
    _assert_new_tokens(
        new, ((4, 5), "length", None), "max_tokens=3, 1 token so far, tokens (4, 5, 6)"
    )
    new, seq, _ = _appended(impl, SamplingParams(max_tokens=9), (4, 5))
    _assert_new_tokens(new, ((4, 5), None, None), "max_tokens=9, tokens (4, 5)")
    assert seq.status is SeqStatus.RUNNING, (
        f"a sample that did not stop: expected it still RUNNING, got {seq.status.value}"
    )


def _sampled(out: SchedulerOutput, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    """The worker's answer: for each sampling chunk, one token per sample, from `tokens`."""
    sampled = {
        chunk.seq_id: tuple(
            SampledTokens((tokens[chunk.request_id].pop(0),), (None,)) for _ in chunk.samples
        )
        for chunk in out.chunks
        if chunk.samples
    }
    return ModelRunnerOutput(sampled=sampled)


def check_prompt_chunks_advance_and_a_finished_prefill_forks(impl: ModuleType) -> None:
    """A prompt chunk only advances; the last chunk of an n=2 request forks and samples twice."""
    scheduler = _reference(budget=6)
    request = Request.create("pair", list(range(1, 11)), SamplingParams(n=2), 0.0)
    first, sibling = request.samples
    scheduler.add(Sequence(request, first, scheduler.kv.new_table(), unforked=[sibling]))
    steps = []
    for step in range(2):
        out = scheduler.schedule()
        new = impl.advance_sequences(scheduler, out, _sampled(out, {"pair": [4, 7]}))
        steps.append([(t.index, t.token_ids) for t in new])
        if step == 0:
            seq = scheduler.running[0]
            assert (seq.num_computed_tokens, steps[0]) == (6, []), (
                "a 10-token prompt, budget 6, after step 0: expected 6 tokens computed and no "
                f"new tokens, got {seq.num_computed_tokens} computed and {steps[0]}"
            )
    assert steps[1] == [(0, (4,)), (1, (7,))], (
        "step 1 finishes the prompt of an n=2 request: expected new tokens "
        f"[(0, (4,)), (1, (7,))] (index, token_ids), one per sample, got {steps[1]}"
    )
    samples = sorted(
        (s.sample.index, s.num_computed_tokens, s.sample.token_ids) for s in scheduler.running
    )
    assert samples == [(0, 10, [4]), (1, 10, [7])], (
        "after the fork: expected two running sequences (index, computed, tokens) "
        f"[(0, 10, [4]), (1, 10, [7])], got {samples}"
    )


def check_an_aborted_sequence_is_skipped(impl: ModuleType) -> None:
    """A sequence aborted between schedule and update gets no tokens, and the others do."""
    scheduler = _reference()
    for name in ["a", "b"]:
        scheduler.add(_sequence(scheduler, name, prompt_len=3, arrival=0))
    out = scheduler.schedule()
    scheduler.abort_request("a")
    new = impl.advance_sequences(scheduler, out, _sampled(out, {"a": [4], "b": [5]}))
    got = [(t.request_id, t.token_ids) for t in new]
    assert got == [("b", (5,))], (
        f"'a' aborted after the step was scheduled: expected [('b', (5,))], got {got}"
    )


@dataclass(frozen=True)
class ResultCase:
    """Requests as (arrival step, prompt, n, max_tokens, stop token ids, min_tokens), the
    pool, and the worker's random state (a seed value) for sampled tokens and drafts."""

    num_blocks: int
    budget: int
    max_model_len: int
    prefix_cache: bool
    speculate: int  # 0: no drafts; else k
    requests: tuple[tuple[int, tuple[int, ...], int, int, tuple[int, ...], int], ...]
    worker_seed: int

    def __str__(self) -> str:
        requests = "; ".join(
            f"r{i}: step {a}, prompt {list(p)}, n={n}, max_tokens={m}, stop {list(s)}, "
            f"min_tokens={mt}"
            for i, (a, p, n, m, s, mt) in enumerate(self.requests)
        )
        return (
            f"{self.num_blocks} blocks of {BLOCK_SIZE}, budget {self.budget}, max_model_len "
            f"{self.max_model_len}, prefix cache {self.prefix_cache}, k={self.speculate}, "
            f"EOS {EOS}, worker seed value {self.worker_seed}; {requests}"
        )


@st.composite
def result_cases(draw: st.DrawFn) -> ResultCase:
    tokens = st.integers(0, 4)
    request = st.tuples(
        st.integers(0, 3),
        st.lists(st.integers(1, 3), min_size=1, max_size=7).map(tuple),
        st.integers(1, 2),
        st.integers(1, 5),
        st.lists(tokens, max_size=2).map(tuple),
        st.integers(0, 2),
    )
    return ResultCase(
        num_blocks=draw(st.integers(12, 24)),
        budget=draw(st.integers(2, 12)),
        max_model_len=draw(st.sampled_from([8, 10, 64])),
        prefix_cache=draw(st.booleans()),
        speculate=draw(st.sampled_from([0, 0, 2, 3])),
        requests=tuple(draw(st.lists(request, min_size=1, max_size=5))),
        worker_seed=draw(st.integers(0, 2**16)),
    )


class _Worker:
    """Plays the worker: random tokens (EOS and stop tokens among them), drafts verified
    in the reserved slots and a random number of them accepted."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled, num_drafts = {}, {}
        for chunk in out.chunks:
            if not chunk.samples:
                continue
            drafts = self.rng.randint(0, chunk.num_draft_slots)
            accepted = self.rng.randint(0, drafts)
            if drafts:
                num_drafts[chunk.seq_id] = drafts
            rows = []
            for i in range(len(chunk.samples)):
                n = 1 + (accepted if i == 0 else 0)
                ids = tuple(self.rng.randint(0, 4) for _ in range(n))
                rows.append(SampledTokens(ids, (None,) * n))
            sampled[chunk.seq_id] = tuple(rows)
        return ModelRunnerOutput(sampled=sampled, num_drafts=num_drafts)


def _result_scheduler(case: ResultCase) -> ReferenceScheduler:
    allocator = BlockAllocator(case.num_blocks)
    cache = RadixCache(BLOCK_SIZE, allocator) if case.prefix_cache else None
    kv = KVCacheManager(allocator, BLOCK_SIZE, prefix_cache=cache)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=case.budget)
    drafts = None
    if case.speculate:
        drafts = DraftPlanner(SpeculativeConfig("ngram", case.speculate))
    return ReferenceScheduler(config, kv, StopRules((EOS,), case.max_model_len), drafts)


def _state(scheduler: ReferenceScheduler, seqs: list[Sequence]) -> list[tuple]:
    return [
        (
            s.request_id,
            s.sample.index,
            s.status.value,
            s.num_computed_tokens,
            list(s.sample.token_ids),
            len(s.block_table.blocks),
        )
        for s in sorted(seqs, key=lambda s: (s.request_id, s.sample.index))
    ] + [("free blocks", scheduler.kv.allocator.num_free), ("stats", scheduler.stats)]


def _play_result(impl: ModuleType, case: ResultCase) -> None:
    """minserve's update and yours after the same steps: the same new tokens every step,
    and the same sequences, blocks and counters after it."""
    ours, yours = _result_scheduler(case), _result_scheduler(case)
    workers = _Worker(case.worker_seed), _Worker(case.worker_seed)
    seen: tuple[list[Sequence], list[Sequence]] = ([], [])
    for step in range(MAX_STEPS):
        for scheduler in (ours, yours):
            for i, (arrival, prompt, n, max_tokens, stop, min_tokens) in enumerate(case.requests):
                if arrival == step:
                    params = SamplingParams(
                        n=n,
                        max_tokens=max_tokens,
                        stop_token_ids=list(stop),
                        min_tokens=min(min_tokens, max_tokens),
                    )
                    request = Request.create(f"r{i}", list(prompt), params, float(arrival))
                    first, *siblings = request.samples
                    seq = Sequence(
                        request, first, scheduler.kv.new_table(), order=i, unforked=siblings
                    )
                    scheduler.add(seq)
        if step > max(r[0] for r in case.requests) and not ours.has_unfinished:
            break
        out_ours, out_yours = ours.schedule(), yours.schedule()
        expected = list(ours.update_from_output(out_ours, workers[0].run(out_ours)).new_tokens)
        got = impl.advance_sequences(yours, out_yours, workers[1].run(out_yours))
        if yours.drafts is not None:
            yours.drafts.release_finished()
        for scheduler, all_seqs in zip((ours, yours), seen):
            all_seqs.extend(s for s in scheduler.seqs.values() if s not in all_seqs)
        where = f"{case}\nat step {step}"
        assert got == expected, f"{where}: expected the new tokens {expected}, got {got}"
        expected_state, got_state = _state(ours, seen[0]), _state(yours, seen[1])
        assert got_state == expected_state, (
            f"{where}, after the update: expected (request, index, status, computed, tokens, "
            f"blocks) {expected_state}, got {got_state}"
        )


def check_random_steps_match_minserves_update(impl: ModuleType) -> None:
    """Random requests, stop rules, forks, drafts, prefix caching: the same update as minserve's"""

    @randomized(80)
    @given(result_cases())
    def play(case: ResultCase) -> None:
        _play_result(impl, case)

    # a stub stops here
    _play_result(impl, ResultCase(16, 6, 64, True, 2, ((0, (1, 2, 3), 2, 3, (3,), 0),), 1))
    play()


check_random_steps_match_minserves_update.time_limit_factor = 3  # type: ignore[attr-defined]


CHECKS = [
    check_a_stop_token_among_accepted_drafts_ends_the_sequence,
    check_eos_and_max_tokens_end_a_sequence,
    check_decodes_run_before_prefill_chunks,
    check_a_long_prompt_is_chunked_to_the_budget,
    check_max_num_seqs_caps_the_batch,
    check_waiting_requests_are_admitted_first_come_first_served,
    check_admission_stops_at_the_first_request_that_does_not_fit,
    check_out_of_blocks_preempts_the_newest_running_sequence,
    check_a_step_that_preempted_admits_no_one,
    check_a_sequence_with_no_one_to_preempt_preempts_itself,
    check_random_workloads_match_minserves_scheduler,
    check_prompt_chunks_advance_and_a_finished_prefill_forks,
    check_an_aborted_sequence_is_skipped,
    check_random_steps_match_minserves_update,
    *FLAT_BATCH_CHECKS,  # exercise 3.4: checks_ch03_flat_batch.py
]

# What each pass of an exercise's loop must change; a check that runs past its time limit
# in that exercise's code says so.
PROGRESS = {
    "3.1": "appending must move on to the next sampled token and stop at the first token "
    "that finishes the sample",
    "3.2": (
        "each pass must take a sequence off the queue (schedule it, skip it, or preempt "
        "it), and admission must stop at the first waiting sequence that does not fit"
    ),
    "3.3": "each pass must move on to the next chunk",
    "3.4": FLAT_BATCH_PROGRESS,
}

HINTS = {
    "3.2": (
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
HINTS["3.1"] = (
    "A step may bring a sequence more than one token (a target token after accepted "
    "drafts), and the stop rules must see them one at a time: a stop can come in the "
    "middle, and the tokens after it were never generated as far as the user is concerned. "
    "A finished sample gives back its blocks at once.",
    "One loop over tokens.token_ids: append each token to seq.sample under "
    "scheduler.rules, count it kept, and when seq.sample.finished, finish the sequence "
    "(scheduler.finish) and break. "
    "Then add the count to the scheduler's generation-token counter; the given return "
    "builds the NewTokens from the first `kept` tokens.",
    "Inside the loop: append the token to the sample with the scheduler's rules, add one "
    "to kept, and if the sample is now finished, finish the sequence and break. After the "
    "loop, add kept to the stats' count of generation tokens.",
)
HINTS["3.3"] = (
    "The scheduler is the one writer of its state: after the worker ran the step, every "
    "scheduled chunk becomes computed, and each sample's tokens go through your "
    "append_sampled (3.1). A chunk that did not end its prompt sampled nothing.",
    "advance_sequences: one loop over the chunks; look the sequence up (skip the gone "
    "ones); record the cache hit, move num_computed_tokens to the chunk's end, cache the "
    "filled blocks when there is a prefix cache; then, if the chunk sampled, build the "
    "family (the sequence, plus its forks when it still has unforked samples), and pair "
    "each member with its SampledTokens: drafts first (only the first member has any), "
    "then append_sampled.",
    "The chunk's end is chunk.start + chunk.num_new_tokens. The family is a list that "
    "starts with seq and continues with whatever scheduler.fork(seq) returns; zip it with "
    "the sampled rows (strict). Keep a num_drafts variable, read from "
    "runner_output.num_drafts with a default of 0, and reset it to 0 after the first "
    "member.",
)
HINTS["3.4"] = FLAT_BATCH_HINTS
