"""Checks for chapter 04 (chunked prefill and preemption), run against any module that
defines `prefill_chunk`, `preemption_mode`, `HostSwapSpace` and the step-time model
(`StepCost`, `StepCostModel`, `nonnegative_least_squares`: its checks are in
`checks_ch04_step_cost`): minserve's own, the solutions, or a student's exercise file.

The oracles are minserve's own functions and class (`minserve.scheduler.budget`,
`minserve.scheduler.preemption`, `minserve.kvcache.swap`), the invariants of a step (never
past the budget, decodes first), and minserve's real `Scheduler` run with your function
(or your swap space) plugged in, on a KV cache of a few 2-token blocks, the way the engine
runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from hypothesis import HealthCheck, Verbosity, given, settings
from hypothesis import strategies as st

from minserve.config import SchedulerConfig
from minserve.course.checks_ch04_step_cost import STEP_COST_CHECKS
from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.manager import KVCacheManager
from minserve.kvcache.swap import HostSwapSpace, SwapSpaceFullError
from minserve.messages import DropSwapped, SwapIn, SwapOut
from minserve.request import Request
from minserve.sampling_params import SamplingParams
from minserve.scheduler import budget as reference_budget
from minserve.scheduler import preemption as reference_preemption
from minserve.scheduler.scheduler import Scheduler
from minserve.scheduler.sequence import SeqStatus, Sequence

BLOCK_SIZE = 2
BLOCK_NBYTES = 1024  # a made-up block size in bytes, for the swap space's accounting
ChunkRule = Callable[[int, int, bool], int]

HINTS: dict[str, tuple[str, str, str]] = {
    "4.1": (
        "A step computes at most the budget. What a sequence still needs either fits in "
        "what is left, or it does not; chunked prefill decides what happens then.",
        "Two cases. Everything fits: return all of it. It does not fit: with chunked "
        "prefill the sequence takes the rest of the budget (a chunk, finished in later "
        "steps); without it, it takes nothing and waits for a step with room.",
        "if num_needed fits in budget_left, that is the answer; otherwise the answer is "
        "either budget_left or 0, and enable_chunked_prefill says which.",
    ),
    "4.2": (
        "Swapping keeps a victim's keys and values on the host instead of recomputing "
        "them, but only if the swap space has room for all of its blocks.",
        "First the cases with nothing to swap, or nowhere to put it (no blocks, no free "
        "swap space): recompute. Otherwise compare the bytes the victim holds with the "
        "bytes free in the swap space.",
        'the victim holds num_blocks * block_nbytes bytes; "swap" when that is at most '
        'swap_free_bytes, "recompute" when it is more.',
    ),
    "4.3": (
        "The swap space is an account, not memory: for each swapped-out sequence it "
        "remembers how many blocks it holds, and in bytes how much of the capacity is "
        "used. Every refusal happens before anything changes.",
        "can_swap_out compares used plus the new blocks' bytes with the capacity. swap_out: "
        "refuse a key already there, refuse what does not fit, then record the key's block "
        "count and add the bytes to used and to bytes_out, and return the SwapOut. swap_in: "
        "check the block count against what went out, count the bytes in, release, return "
        "the SwapIn. discard: release, return DropSwapped. _release: give the bytes back and "
        "forget the key; num_blocks: the count, or KeyError.",
        "the bytes of n blocks are n * self.block_nbytes; the dict self._blocks maps a key to "
        "its block count; build the operations with a tuple of the blocks, e.g. "
        "SwapOut(key, tuple(blocks)); swap_in and _release both call self.num_blocks(key), "
        "which raises KeyError for a key that was never swapped out.",
    ),
    "4.4": (
        "A step's time is a sum of coefficient x feature (shape.features() lists the "
        "features in the fields' order). Inverting it for a chunk of n prompt tokens is "
        "linear in n; fitting it is least squares on running sums, with every coefficient "
        "kept >= 0 (a step cannot get cheaper for running more).",
        "max_prefill_tokens: subtract from the seconds what the decodes cost, the jump (not "
        "if they already run a chunk) and the context cost of the `start` tokens; each "
        "prompt token then costs per_token_s + per_context_token_s; floor the quotient, with "
        "1e-9 of slack. observe: decay both sums, add x x^T and seconds * x, count, refit "
        "from min_steps on. nonnegative_least_squares: keep the unconstrained solve if it "
        "has no negative entry; else solve on each subset of features (itertools."
        "combinations, gram[np.ix_(idx, idx)]) and keep the best nonnegative one by loss.",
        "predict: sum(c * x over zip(astuple(self), shape.features())). max_prefill_tokens: "
        "left = seconds - predict(decodes) - jump - per_context_token_s * start; 0 if left is "
        "below one token's cost; sys.maxsize when a token costs nothing; else "
        "int(left / per_token + 1e-9). observe: _gram = decay * _gram + np.outer(x, x), the "
        "same for _moment with seconds * x. In the subset search, a candidate full vector has "
        "zeros off idx, and its loss is full @ gram @ full - 2 * full @ moment; all zeros "
        "score 0.",
    ),
}


# --- exercise 4.1: a sequence's share of the token budget ---


def _chunk(impl: ModuleType, num_needed: int, budget_left: int, chunked: bool) -> int:
    got = impl.prefill_chunk(num_needed, budget_left, chunked)
    assert isinstance(got, int), (
        f"prefill_chunk({num_needed}, {budget_left}, {chunked}): expected an int, "
        f"got {got!r} ({type(got).__name__})"
    )
    return got


def _assert_chunks(impl: ModuleType, cases: list[tuple[int, int, bool, int]]) -> None:
    for num_needed, budget_left, chunked, expected in cases:
        got = _chunk(impl, num_needed, budget_left, chunked)
        assert got == expected, (
            f"prefill_chunk(num_needed={num_needed}, budget_left={budget_left}, "
            f"enable_chunked_prefill={chunked}): expected {expected}, got {got}"
        )


def check_what_fits_runs_whole(impl: ModuleType) -> None:
    """A decode (1 token) or a prompt that fits the budget left runs whole, chunked or not."""
    _assert_chunks(
        impl,
        [(1, 16, True, 1), (1, 1, False, 1), (12, 20, True, 12), (12, 12, False, 12)],
    )


def check_a_prompt_too_long_takes_a_chunk_of_what_is_left(impl: ModuleType) -> None:
    """With chunked prefill, a 40-token prompt takes the 14 tokens left; none when none are."""
    _assert_chunks(impl, [(40, 14, True, 14), (40, 1, True, 1), (40, 0, True, 0)])


def check_without_chunking_a_prompt_too_long_waits(impl: ModuleType) -> None:
    """Without chunked prefill, a 40-token prompt with 14 tokens left gets 0: it waits."""
    _assert_chunks(impl, [(40, 14, False, 0), (40, 39, False, 0), (40, 40, False, 40)])


def split_budget(
    rule: ChunkRule, budget: int, num_decodes: int, prefills: list[int], chunked: bool
) -> tuple[list[int], list[int]]:
    """One step's budget as the scheduler shares it: each decode asks for its 1 token
    first, then each prefill for what it still needs, in order, out of what is left.
    Returns the tokens each decode and each prefill got."""
    left = budget
    decodes = []
    for _ in range(num_decodes):
        decodes.append(rule(1, left, chunked))
        left -= decodes[-1]
    chunks = []
    for needed in prefills:
        chunks.append(rule(needed, left, chunked))
        left -= chunks[-1]
    return decodes, chunks


def _split_problems(
    impl: ModuleType, budget: int, num_decodes: int, prefills: list[int], chunked: bool
) -> str:
    """What is wrong with the implementation's split of one step's budget ("" if nothing)."""
    step = (
        f"budget {budget}, {num_decodes} decodes, prefills needing {prefills}, "
        f"enable_chunked_prefill={chunked}"
    )
    decodes, chunks = split_budget(impl.prefill_chunk, budget, num_decodes, prefills, chunked)
    expected = split_budget(reference_budget.prefill_chunk, budget, num_decodes, prefills, chunked)
    if sum(decodes) + sum(chunks) > budget:
        return f"{step}: the step computes {sum(decodes) + sum(chunks)} tokens, past the budget"
    if any(not 0 <= got <= needed for got, needed in zip(chunks, prefills)):
        return f"{step}: chunks {chunks}, each must be between 0 and what the prefill needs"
    if (decodes, chunks) != expected:
        return (
            f"{step}: expected decodes {expected[0]} and prefill chunks {expected[1]}, "
            f"got decodes {decodes} and prefill chunks {chunks}"
        )
    return ""


def check_decodes_first_then_chunks_of_the_rest(impl: ModuleType) -> None:
    """Budget 16, two decodes, a 40-token document: chunks of 14, 14 and 12 over three steps."""
    needed, chunks = 40, []
    while needed:
        _, (chunk,) = split_budget(impl.prefill_chunk, 16, 2, [needed], True)
        assert 0 < chunk <= needed and len(chunks) < 3, (
            f"budget 16 with two decodes, the document needing {needed} more tokens after "
            f"chunks {chunks}: expected a chunk of {min(needed, 14)}, got {chunk}"
        )
        chunks.append(chunk)
        needed -= chunk
    assert chunks == [14, 14, 12], f"expected chunks [14, 14, 12], got {chunks}"


def check_the_budget_split_matches_minserve_on_random_steps(impl: ModuleType) -> None:
    """Random steps (budget, decodes, prefills): never past the budget, same split as minserve."""
    problems: list[str] = []

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(
        budget=st.integers(0, 64),
        num_decodes=st.integers(0, 8),
        prefills=st.lists(st.integers(1, 100), max_size=4),
        chunked=st.booleans(),
    )
    def split_matches(budget: int, num_decodes: int, prefills: list[int], chunked: bool) -> None:
        problem = _split_problems(impl, budget, num_decodes, prefills, chunked)
        if problem:
            problems.append(problem)
        assert not problem, problem

    try:
        split_matches()
    except AssertionError:
        # hypothesis shrinks before re-raising: the last problem is the smallest example
        raise AssertionError(problems[-1]) from None


def _plan_chunks(rule: ChunkRule, budget: int, chunked: bool) -> list[list[tuple[str, int]]]:
    """minserve's Scheduler with `rule` plugged in: a 20-token prompt arrives while one
    request decodes; the batches of the first steps as (request, tokens) pairs."""
    kv = KVCacheManager(BlockAllocator(64), BLOCK_SIZE)
    config = SchedulerConfig(max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    scheduler = Scheduler(config, kv, chunk_rule=rule)
    chat = _sequence(kv, "chat", 3, arrival=0)
    _make_running(scheduler, chat, decoding=True)
    scheduler.add(_sequence(kv, "doc", 20, arrival=1))
    steps = []
    for _ in range(4):
        plan = scheduler.plan()
        steps.append([(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled])
        for s in plan.scheduled:  # the engine's part: compute, sample at the end
            s.seq.num_computed_tokens += s.num_new_tokens
            if s.seq.num_uncomputed_tokens == 0:
                s.seq.sample.token_ids.append(7)
    return steps


def check_the_engines_scheduler_chunks_with_your_rule(impl: ModuleType) -> None:
    """minserve's scheduler with your rule: a 20-token prompt next to a decode, budget 8."""
    got = _plan_chunks(impl.prefill_chunk, budget=8, chunked=True)
    expected = _plan_chunks(reference_budget.prefill_chunk, budget=8, chunked=True)
    assert got == expected, (
        "Scheduler(..., chunk_rule=prefill_chunk), 'chat' decoding and a 20-token 'doc' "
        f"arriving, budget 8: expected the batches {expected}, got {got}  (request, tokens)"
    )


# --- exercise 4.2: recompute or swap ---


def _mode(impl: ModuleType, num_blocks: int, block_nbytes: int, swap_free_bytes: int) -> str:
    return impl.preemption_mode(num_blocks, block_nbytes, swap_free_bytes)


def _assert_modes(impl: ModuleType, cases: list[tuple[int, int, int, str]]) -> None:
    for num_blocks, block_nbytes, free, expected in cases:
        got = _mode(impl, num_blocks, block_nbytes, free)
        assert got == expected, (
            f"preemption_mode(num_blocks={num_blocks}, block_nbytes={block_nbytes}, "
            f"swap_free_bytes={free}): expected {expected!r}, got {got!r}"
        )


def check_without_swap_space_a_victim_is_recomputed(impl: ModuleType) -> None:
    """No swap space (both sizes 0), or a full one: recompute."""
    _assert_modes(impl, [(3, 0, 0, "recompute"), (3, 1024, 0, "recompute")])


def check_a_victim_is_swapped_when_all_its_blocks_fit(impl: ModuleType) -> None:
    """4 blocks of 1 KiB: swapped with 4 KiB free or more, recomputed with a byte less."""
    _assert_modes(
        impl,
        [
            (4, 1024, 8192, "swap"),
            (4, 1024, 4096, "swap"),
            (4, 1024, 4095, "recompute"),
            (1, 4096, 3072, "recompute"),
        ],
    )


def check_a_victim_without_blocks_is_recomputed(impl: ModuleType) -> None:
    """A victim holding no block has nothing to swap: recompute, however much room is free."""
    _assert_modes(impl, [(0, 1024, 1 << 20, "recompute")])


def check_the_rule_matches_minserve_on_random_victims(impl: ModuleType) -> None:
    """Random victims and swap spaces: the same choice as minserve's rule."""
    problems: list[str] = []

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(
        num_blocks=st.integers(0, 64),
        block_nbytes=st.integers(1, 1 << 16),
        swap_free_bytes=st.integers(0, 1 << 22),
    )
    def same_choice(num_blocks: int, block_nbytes: int, swap_free_bytes: int) -> None:
        expected = reference_preemption.preemption_mode(num_blocks, block_nbytes, swap_free_bytes)
        got = _mode(impl, num_blocks, block_nbytes, swap_free_bytes)
        problem = (
            f"preemption_mode(num_blocks={num_blocks}, block_nbytes={block_nbytes}, "
            f"swap_free_bytes={swap_free_bytes}): expected {expected!r}, got {got!r}"
        )
        if got != expected:
            problems.append(problem)
        assert got == expected, problem

    try:
        same_choice()
    except AssertionError:
        raise AssertionError(problems[-1]) from None


def _sequence(kv: KVCacheManager, name: str, prompt_len: int, arrival: int) -> Sequence:
    request = Request.create(name, list(range(prompt_len)), SamplingParams(), float(arrival))
    return Sequence(request, request.samples[0], kv.new_table(), order=arrival)


def _make_running(scheduler: Scheduler, seq: Sequence, decoding: bool) -> None:
    """Put `seq` in the running list with its prompt computed (and a sampled token)."""
    if decoding:
        seq.sample.token_ids.append(7)
    computed = len(seq.sample.prompt_token_ids)
    scheduler.kv.append(seq.block_table, computed)
    seq.num_computed_tokens = computed
    seq.status = SeqStatus.RUNNING
    scheduler.seqs[seq.seq_id] = seq
    scheduler.running.append(seq)


def _preempt_newest(impl: ModuleType, swap_blocks: int) -> tuple[str, str, int]:
    """Three decodes of 2 full blocks each in a 6-block pool, a host swap space of
    `swap_blocks` blocks: the newest, 'c', is preempted. Its (status, where it went,
    computed tokens)."""
    swap = HostSwapSpace(swap_blocks * BLOCK_NBYTES, BLOCK_NBYTES)
    kv = KVCacheManager(BlockAllocator(6), BLOCK_SIZE, swap)
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16), kv, preemption_rule=impl.preemption_mode
    )
    for arrival, name in enumerate("abc"):
        _make_running(scheduler, _sequence(kv, name, 4, arrival), decoding=True)
    plan = scheduler.plan()
    (victim,) = plan.preempted
    where = (
        "swapped"
        if victim in scheduler.swapped
        else "waiting"
        if victim in scheduler.waiting
        else "?"
    )
    return victim.status.value, where, victim.num_computed_tokens


def check_the_engines_scheduler_swaps_or_recomputes_with_your_rule(impl: ModuleType) -> None:
    """minserve's scheduler with your rule: the victim's 2 blocks swap into room for 2, not 1."""
    for swap_blocks, expected in [(2, ("swapped", "swapped", 4)), (1, ("waiting", "waiting", 0))]:
        got = _preempt_newest(impl, swap_blocks)
        assert got == expected, (
            f"Scheduler(..., preemption_rule=preemption_mode), victim 'c' holding 2 blocks of "
            f"{BLOCK_NBYTES} bytes, swap space for {swap_blocks}: expected (status, queue, "
            f"num_computed_tokens) == {expected}, got {got}"
        )


# --- exercise 4.3: the host swap space's accounting ---


def _state(space) -> dict[str, int]:
    """What a swap space's account holds: bytes used, copied out and in."""
    return {name: getattr(space, name) for name in ("used_bytes", "bytes_out", "bytes_in")}


def _expect_state(space, expected: dict[str, int], after: str) -> None:
    got = _state(space)
    assert got == expected, f"after {after}: expected {expected}, got {got}"


def _expect_op(got: object, expected: object, call: str) -> None:
    assert type(got) is type(expected) and got == expected, (
        f"{call}: expected {expected!r}, got {got!r}"
    )


def check_swap_out_and_in_account_for_every_byte(impl: ModuleType) -> None:
    """Swap space of 4 blocks of 1 KiB: out 2 blocks (2 KiB used), back into 2 fresh blocks"""
    space = impl.HostSwapSpace(4 * BLOCK_NBYTES, BLOCK_NBYTES)
    _expect_op(space.swap_out(7, [3, 5]), SwapOut(7, (3, 5)), "swap_out(7, [3, 5])")
    _expect_state(
        space, {"used_bytes": 2048, "bytes_out": 2048, "bytes_in": 0}, "swap_out(7, [3, 5])"
    )
    assert 7 in space and space.num_blocks(7) == 2, (
        f"after swap_out(7, [3, 5]): expected 7 in the space with 2 blocks, got "
        f"{7 in space} with {space.num_blocks(7) if 7 in space else 'none'}"
    )
    fits = [space.can_swap_out(n) for n in (0, 2, 3)]
    assert fits == [True, True, False], (
        f"2 of 4 blocks used: can_swap_out(0), (2), (3): expected [True, True, False], got {fits}"
    )
    _expect_op(space.swap_in(7, [0, 6]), SwapIn(7, (0, 6)), "swap_in(7, [0, 6])")
    after = "swap_out(7, [3, 5]); swap_in(7, [0, 6])"
    _expect_state(space, {"used_bytes": 0, "bytes_out": 2048, "bytes_in": 2048}, after)
    assert 7 not in space, f"after {after}: 7 is back in the pool, expected it gone from the space"


def check_a_full_swap_space_refuses_and_changes_nothing(impl: ModuleType) -> None:
    """3 blocks of room: 2 then 2 more is refused (SwapSpaceFullError), 2 then 1 fills it exactly"""
    space = impl.HostSwapSpace(3 * BLOCK_NBYTES, BLOCK_NBYTES)
    space.swap_out(1, [0, 1])
    try:
        got = space.swap_out(2, [2, 3])
    except SwapSpaceFullError:
        pass
    else:
        raise AssertionError(
            f"2 of 3 blocks used, swap_out(2, [2, 3]): expected SwapSpaceFullError, got {got!r}"
        )
    after = "swap_out(1, [0, 1]) and a refused swap_out(2, [2, 3])"
    _expect_state(space, {"used_bytes": 2048, "bytes_out": 2048, "bytes_in": 0}, after)
    assert 2 not in space, f"after {after}: expected 2 not swapped out (all or nothing)"
    _expect_op(space.swap_out(2, [4]), SwapOut(2, (4,)), "2 of 3 blocks used, swap_out(2, [4])")
    _expect_state(space, {"used_bytes": 3072, "bytes_out": 3072, "bytes_in": 0}, "filling it")


def check_discard_frees_the_room_without_copying_back(impl: ModuleType) -> None:
    """discard (an aborted request): its bytes are free again, bytes_in unchanged"""
    space = impl.HostSwapSpace(4 * BLOCK_NBYTES, BLOCK_NBYTES)
    space.swap_out(1, [0, 1, 2])
    space.swap_out(2, [3])
    _expect_op(space.discard(1), DropSwapped(1), "discard(1)")
    after = "swap_out(1, [0, 1, 2]); swap_out(2, [3]); discard(1)"
    _expect_state(space, {"used_bytes": 1024, "bytes_out": 4096, "bytes_in": 0}, after)
    assert 1 not in space and 2 in space, (
        f"after {after}: expected only 2 swapped out, got 1: {1 in space}, 2: {2 in space}"
    )


def _raises(call: Callable[[], object], error: type[Exception], what: str) -> None:
    try:
        got = call()
    except error:
        return
    except Exception as other:  # noqa: BLE001  (the message names what came instead)
        raise AssertionError(f"{what}: expected {error.__name__}, got {other!r}") from None
    raise AssertionError(f"{what}: expected {error.__name__}, got {got!r}")


def check_the_swap_space_refuses_what_it_cannot_account_for(impl: ModuleType) -> None:
    """Swapped out twice, swapped in with 1 block of 2, or unknown: ValueError, KeyError"""
    space = impl.HostSwapSpace(8 * BLOCK_NBYTES, BLOCK_NBYTES)
    space.swap_out(1, [0, 1])
    _raises(lambda: space.swap_out(1, [2]), ValueError, "swap_out(1, [0, 1]); swap_out(1, [2])")
    _raises(lambda: space.swap_in(1, [5]), ValueError, "swap_out(1, [0, 1]); swap_in(1, [5])")
    _expect_state(space, {"used_bytes": 2048, "bytes_out": 2048, "bytes_in": 0}, "both refusals")
    for call, what in [
        (lambda: space.swap_in(9, [0]), "swap_in(9, [0])"),
        (lambda: space.discard(9), "discard(9)"),
        (lambda: space.num_blocks(9), "num_blocks(9)"),
    ]:
        _raises(call, KeyError, f"9 never swapped out, {what}")


SwapCall = tuple[str, int, int]  # (method, sequence id, number of blocks)
swap_calls = st.lists(
    st.tuples(
        st.sampled_from(["swap_out", "swap_in", "discard", "can_swap_out"]),
        st.integers(0, 3),
        st.integers(0, 4),
    ),
    max_size=12,
)


def _call(space, method: str, key: int, n: int, first_block: int) -> object:
    """One call on a swap space; an exception is returned as its type, to compare."""
    blocks = list(range(first_block, first_block + n))
    try:
        if method == "can_swap_out":
            return space.can_swap_out(n)
        if method == "discard":
            return space.discard(key)
        return getattr(space, method)(key, blocks)
    except (SwapSpaceFullError, ValueError, KeyError) as error:
        return type(error)


def _show(calls: list[SwapCall]) -> str:
    return "; ".join(
        f"{m}({k})" if m == "discard" else f"{m}({k}, {n} blocks)" for m, k, n in calls
    )


def check_random_swaps_match_minserve(impl: ModuleType) -> None:
    """Random swap-outs, swap-ins, discards in a 6-block swap space: the same ops and bytes"""

    def replay(calls: list[SwapCall]) -> None:
        yours = impl.HostSwapSpace(6 * BLOCK_NBYTES, BLOCK_NBYTES)
        ours = HostSwapSpace(6 * BLOCK_NBYTES, BLOCK_NBYTES)
        for i, (method, key, n) in enumerate(calls):
            done = f"{_show(calls[: i + 1])} (a swap space of 6 blocks)"
            expected, got = (
                _call(ours, method, key, n, 10 * i),
                _call(yours, method, key, n, 10 * i),
            )
            assert got == expected, f"{done}: the last call expected {expected!r}, got {got!r}"
            _expect_state(yours, _state(ours), done)
            held = {k: (k in yours) for k in range(4)}
            assert held == {k: (k in ours) for k in range(4)}, (
                f"{done}: expected swapped out {sorted(k for k in range(4) if k in ours)}, "
                f"got {sorted(k for k, h in held.items() if h)}"
            )

    replay([("swap_out", 0, 2), ("swap_in", 0, 2)])  # a stub raises here at once

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              verbosity=Verbosity.quiet, report_multiple_bugs=False,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(swap_calls)
    def same_ops_and_bytes(calls: list[SwapCall]) -> None:
        replay(calls)

    same_ops_and_bytes()


check_random_swaps_match_minserve.time_limit_factor = 3


def check_the_engines_scheduler_swaps_through_your_space(impl: ModuleType) -> None:
    """minserve's scheduler and KV cache on your swap space: the victim's 2 blocks out, then in"""
    swap = impl.HostSwapSpace(2 * BLOCK_NBYTES, BLOCK_NBYTES)
    kv = KVCacheManager(BlockAllocator(6), BLOCK_SIZE, swap)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv)
    for arrival, name in enumerate("abc"):
        _make_running(scheduler, _sequence(kv, name, 4, arrival), decoding=True)
    victim_blocks = tuple(scheduler.running[-1].block_table.blocks)
    plan = scheduler.plan()
    (victim,) = plan.preempted
    ops = [op for op in kv.take_block_ops() if isinstance(op, SwapOut | SwapIn)]
    expected = [SwapOut(victim.seq_id, victim_blocks)]
    assert victim in scheduler.swapped and ops == expected, (
        f"three decodes of 2 blocks each in a 6-block pool, swap space for 2 blocks: expected "
        f"the newest swapped out, {expected}, got {ops} (queue: "
        f"{'swapped' if victim in scheduler.swapped else 'waiting'})"
    )
    _expect_state(swap, {"used_bytes": 2048, "bytes_out": 2048, "bytes_in": 0}, "the swap-out")
    for seq in list(scheduler.running):  # the others finish: their blocks come free
        scheduler.running.remove(seq)
        kv.free(seq.block_table)
    scheduler.plan()
    ops = [op for op in kv.take_block_ops() if isinstance(op, SwapOut | SwapIn)]
    back = tuple(victim.block_table.blocks[:2])  # then the step's decode may take a third
    assert ops == [SwapIn(victim.seq_id, back)] and victim in scheduler.running, (
        f"the next step, with the pool free: expected [SwapIn({victim.seq_id}, {back})] and the "
        f"victim running, got {ops}"
    )
    _expect_state(swap, {"used_bytes": 0, "bytes_out": 2048, "bytes_in": 2048}, "the swap-in")


CHECKS = [
    check_what_fits_runs_whole,
    check_a_prompt_too_long_takes_a_chunk_of_what_is_left,
    check_without_chunking_a_prompt_too_long_waits,
    check_decodes_first_then_chunks_of_the_rest,
    check_the_budget_split_matches_minserve_on_random_steps,
    check_the_engines_scheduler_chunks_with_your_rule,
    check_without_swap_space_a_victim_is_recomputed,
    check_a_victim_is_swapped_when_all_its_blocks_fit,
    check_a_victim_without_blocks_is_recomputed,
    check_the_rule_matches_minserve_on_random_victims,
    check_the_engines_scheduler_swaps_or_recomputes_with_your_rule,
    check_swap_out_and_in_account_for_every_byte,
    check_a_full_swap_space_refuses_and_changes_nothing,
    check_discard_frees_the_room_without_copying_back,
    check_the_swap_space_refuses_what_it_cannot_account_for,
    check_random_swaps_match_minserve,
    check_the_engines_scheduler_swaps_through_your_space,
    *STEP_COST_CHECKS,
]
