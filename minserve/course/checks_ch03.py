"""Checks for chapter 03 (continuous batching), run against any module that defines
`Scheduler`: minserve's own, the solutions, or a student's exercise file.

Each check builds a real KV cache manager (a `BlockAllocator` and block tables of a tiny
model, blocks of 2 tokens), puts a few sequences in it whose fate can be worked out on
paper, calls `Scheduler(config, kv).plan()` and compares the batch, written as
(request, tokens) pairs, with what it should be. `_advance` plays the engine's part
between steps: the scheduled tokens are computed, and a sequence whose tokens are all
computed samples one more.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from minserve.config import SchedulerConfig
from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.manager import KVCacheManager
from minserve.request import Request
from minserve.sampling_params import SamplingParams
from minserve.scheduler.scheduler import StepPlan
from minserve.scheduler.sequence import SeqStatus, Sequence

BLOCK_SIZE = 2
Batch = list[tuple[str, int]]


def _scheduler(impl: ModuleType, num_blocks: int, budget: int, max_num_seqs: int = 8) -> Any:
    """The implementation's Scheduler over a fresh KV cache of `num_blocks` blocks."""
    kv = KVCacheManager(BlockAllocator(num_blocks), BLOCK_SIZE)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return impl.Scheduler(config, kv)


def _sequence(scheduler: Any, name: str, prompt_len: int, arrival: int) -> Sequence:
    """A one-sample request named `name` that arrived at time `arrival`."""
    request = Request.create(name, list(range(prompt_len)), SamplingParams(), float(arrival))
    return Sequence(request, request.samples[0], scheduler.kv.new_table(), order=arrival)


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


CHECKS = [
    check_decodes_run_before_prefill_chunks,
    check_a_long_prompt_is_chunked_to_the_budget,
    check_max_num_seqs_caps_the_batch,
    check_waiting_requests_are_admitted_first_come_first_served,
    check_admission_stops_at_the_first_request_that_does_not_fit,
    check_out_of_blocks_preempts_the_newest_running_sequence,
    check_a_step_that_preempted_admits_no_one,
    check_a_sequence_with_no_one_to_preempt_preempts_itself,
]
