"""The stage planner of live migration's pre-copy: hand-worked cases, then a brute-force
oracle that times blocks one by one and decode steps one by one, then whole migrations
driven by the planner (every block sent exactly once, the pause bounded as promised)."""

from __future__ import annotations

import random

import pytest

from minserve.disagg.stage_planner import FINAL, next_stage

# 1 ms a block (1000 B at 1 MB/s), 0.5 ms latency, a 10 ms decode step, 16 tokens a block
LINK = dict(block_bytes=1000, bandwidth_bytes_s=1e6, latency_s=5e-4, step_s=0.01)


def plan(filled: int, sent: int, stages: int = 0, max_stages: int = 4, tpb: int = 16, **link):
    return next_stage(filled, sent, **{**LINK, **link}, tokens_per_block=tpb,
                      stages_done=stages, max_stages=max_stages)  # fmt: skip


def test_a_long_context_is_pre_copied_a_step_at_a_time():
    # going final would pause 0.5 + 101 x 1 = 101.5 ms > 10 ms; one step hides 9.5 ms of
    # copying: 9 blocks, while the source fills 10 / 10 / 16 = 0.06 blocks < 9
    assert plan(100, 0) == range(0, 9)


def test_once_what_is_left_fits_a_decode_step_it_goes_final():
    assert plan(101, 100, stages=1) == FINAL  # 0.5 + 2 x 1 = 2.5 ms <= 10 ms
    assert plan(108, 100, stages=1) == FINAL  # 0.5 + 9 = 9.5 ms
    assert plan(110, 100, stages=1) == range(100, 109)  # 0.5 + 11 = 11.5 ms: one more stage


def test_the_stage_cap_and_stop_and_copy():
    assert plan(100, 0, stages=4, max_stages=4) == FINAL
    assert plan(100, 0, stages=0, max_stages=0) == FINAL  # stop-and-copy: one final stage


def test_a_pre_copy_that_cannot_catch_up_goes_final():
    # 100 ms a block, one token a block: a 1-block stage lasts 100.5 ms, in which the source
    # fills 10 blocks: copying again would leave more, not less
    slow = dict(bandwidth_bytes_s=1e4)
    assert plan(3, 2, tpb=1, **slow) == FINAL
    assert plan(3, 3, tpb=1, **slow) == FINAL  # nothing new to send, and the final is slow


def test_it_refuses_inputs_it_cannot_plan_with():
    with pytest.raises(ValueError, match="5 blocks sent but only 4 filled"):
        plan(4, 5)
    with pytest.raises(ValueError, match="step_s and bandwidth_bytes_s must be positive"):
        plan(4, 0, step_s=0.0)


def oracle(filled, sent, block_bytes, bandwidth_bytes_s, latency_s, step_s, tpb, stages, cap):
    """The rule, the slow way: blocks timed one at a time, decode steps counted one by one."""
    per_block = block_bytes / bandwidth_bytes_s
    pause = latency_s
    for _ in range(filled - sent + 1):
        pause += per_block
    if pause <= step_s * (1 + 1e-12) or stages >= cap:
        return FINAL

    def filled_meanwhile(n: int) -> float:
        stage_s = max(step_s, latency_s + sum(per_block for _ in range(n)))
        tokens, clock = 0, 0.0
        while clock + step_s <= stage_s * (1 + 1e-12):  # decode steps that fit the stage
            clock += step_s
            tokens += 1
        return (tokens + (stage_s - clock) / step_s) / tpb  # and the part of one under way

    hidden = 0  # blocks whose copy one step hides, counted one at a time
    while latency_s + (hidden + 1) * per_block <= step_s * (1 + 1e-12):
        hidden += 1
    n = min(filled - sent, max(1, hidden))
    if filled_meanwhile(n) >= n:
        n = filled - sent
        if filled_meanwhile(n) >= n:
            return FINAL
    return range(sent, sent + n)


def test_it_agrees_with_the_brute_force_oracle():
    rng = random.Random(0)
    for _ in range(3000):
        sent = rng.randrange(0, 300)
        case = dict(
            filled=sent + rng.randrange(0, 300), sent=sent, block_bytes=rng.choice([512, 4096,
            94_208, 1 << 20]), bandwidth_bytes_s=10 ** rng.uniform(5, 11),
            latency_s=10 ** rng.uniform(-6, -2), step_s=10 ** rng.uniform(-3, -1),
            tpb=rng.choice([1, 4, 16, 32]), stages=rng.randrange(0, 6), cap=rng.randrange(0, 6),
        )  # fmt: skip
        got = next_stage(
            case["filled"], case["sent"], case["block_bytes"], case["bandwidth_bytes_s"],
            case["latency_s"], case["step_s"], case["tpb"], case["stages"], case["cap"],
        )  # fmt: skip
        assert got == oracle(**case), case


def migrate(context_blocks: int, tpb: int, max_stages: int, **link) -> tuple[list, float, range]:
    """Drive the planner through one migration: the source fills blocks as it decodes
    during each stage. (the stages' blocks, the final pause, the final stage's blocks)"""
    link = {**LINK, **link}
    step_s, per_block = link["step_s"], link["block_bytes"] / link["bandwidth_bytes_s"]
    tokens = context_blocks * tpb + tpb // 2  # a partly filled last block
    sent, stages = 0, []
    while True:
        filled = tokens // tpb
        stage = next_stage(filled, sent, **link, tokens_per_block=tpb, stages_done=len(stages),
                           max_stages=max_stages)  # fmt: skip
        if stage == FINAL:
            final = range(sent, filled + 1)  # the rest, and the partly filled last block
            return stages, link["latency_s"] + len(final) * per_block, final
        stages.append(stage)
        stage_s = max(step_s, link["latency_s"] + len(stage) * per_block)
        tokens += max(1, round(stage_s / step_s))  # it decodes while the blocks travel
        sent = stage.stop


@pytest.mark.parametrize(
    ("context_blocks", "expected_stages", "expected_final"),
    [
        (4, [], range(0, 5)),  # 0.5 + 5 x 1 ms fits a 10 ms step: final at once
        # 9 blocks a stage (9.5 ms of copying hides in a 10 ms step), a token a stage: after
        # 7 stages 63 are sent, 64 filled: 0.5 + 2 x 1 ms fits a step
        (64, [range(i, i + 9) for i in range(0, 63, 9)], range(63, 65)),
        # after 114 stages 1026 are sent of 1031 filled (122 tokens decoded meanwhile)
        (1024, [range(i, i + 9) for i in range(0, 1026, 9)], range(1026, 1032)),
    ],
)
def test_a_whole_migration_sends_every_block_once(context_blocks, expected_stages, expected_final):
    stages, pause, final = migrate(context_blocks, tpb=16, max_stages=200)
    assert (stages, final) == (expected_stages, expected_final)
    sent = [b for stage in [*stages, final] for b in stage]
    assert sent == list(range(final.stop))  # in order, each block once, the last one partial
    assert pause <= LINK["step_s"]  # a fast link: the pause hides in one decode step


def test_stop_and_copy_pauses_for_the_whole_context():
    stages, pause, final = migrate(1024, tpb=16, max_stages=0)
    assert stages == [] and final == range(0, 1025)
    assert pause == pytest.approx(5e-4 + 1025 * 1e-3)  # every block while the request waits
    pre_copied = migrate(1024, tpb=16, max_stages=200)[1]
    assert pre_copied < pause / 100


def test_each_stage_sends_what_the_last_one_let_the_source_fill():
    # 5 ms a block and a block a step: a stage of n blocks lets the source fill n / 2 more,
    # so each stage halves what is left, until going final costs about one step
    stages, pause, final = migrate(64, tpb=1, max_stages=8, bandwidth_bytes_s=2e5)
    assert stages == [range(0, 64), range(64, 96), range(96, 112), range(112, 120),
                      range(120, 124), range(124, 126)]  # fmt: skip
    assert final == range(126, 128)  # a 1-block stage would let one more fill: no progress
    assert pause == pytest.approx(5e-4 + 2 * 5e-3)
