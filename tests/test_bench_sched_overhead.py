"""The engine's per-phase step clock and the scheduler-overhead benchmark built on it."""

from __future__ import annotations

import time

import pytest

from minserve import LLM, SamplingParams
from minserve.bench.sched_overhead import is_all_decoding, measure, timed_step
from minserve.cli import main
from minserve.step_timings import PhaseClock, StepTimings

PHASES = ("schedule", "prepare", "forward", "sample", "update")


@pytest.fixture(scope="module")
def model(tiny_model):
    return LLM(tiny_model("llama"))


def test_phase_clock_charges_each_lap_to_its_phase() -> None:
    clock = PhaseClock()
    time.sleep(0.02)
    clock.lap("forward")
    clock.lap("update")
    time.sleep(0.01)
    clock.lap("update")
    t = clock.timings
    assert 0.02 <= t.forward < 0.2 and 0.01 <= t.update < 0.1
    assert t.total == pytest.approx(t.forward + t.update)
    assert t.overhead == pytest.approx(t.update)


def test_engine_step_times_every_phase_and_sums_them_in_metrics(model) -> None:
    llm = LLM(model.loaded, num_blocks=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", None, [10 + i, 11, 12, 13], params)
    summed, walls = StepTimings(), 0.0
    while engine.has_unfinished_requests():
        wall, record = timed_step(engine)
        step = record.timings
        assert all(getattr(step, p) > 0 for p in PHASES)
        assert step.total <= wall  # the laps cover the step, never more
        summed.add(step)
        walls += wall
    metrics = llm.get_metrics()
    for p in PHASES:
        assert metrics[f"step_seconds_{p}"] == pytest.approx(getattr(summed, p))
    assert summed.total > 0.5 * walls  # untimed gaps between laps are small


def test_measure_runs_only_steady_state_decode_steps(model) -> None:
    llm = LLM(model.loaded, num_blocks=64)
    result = measure(llm.engine, num_requests=5, prompt_len=4, steps=3, warmup=1)
    assert result.num_requests == 5 and result.num_steps == 3
    assert set(result.phase_ms) == {*PHASES, "propose"}  # propose: speculative decoding's
    overhead_ms = sum(result.phase_ms[p] for p in ("schedule", "prepare", "update"))
    assert result.overhead_fraction == pytest.approx(overhead_ms / result.step_ms)
    assert 0 < result.overhead_fraction < 1 and result.untimed_ms >= 0
    assert result.overhead_us_per_request == pytest.approx(1000 * overhead_ms / 5)
    assert not llm.engine.has_unfinished_requests()  # measure aborts what it started
    assert llm.get_metrics()["num_free_blocks"] == llm.get_metrics()["num_blocks"]


def test_is_all_decoding_is_false_for_a_prefill_step(model) -> None:
    engine = LLM(model.loaded, num_blocks=64).engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", None, [5, 6, 7], params)
    _, prefill = timed_step(engine)
    assert not is_all_decoding(prefill.scheduler_output, 1)
    _, decode = timed_step(engine)
    assert is_all_decoding(decode.scheduler_output, 1)
    assert not is_all_decoding(decode.scheduler_output, 2)


def test_measure_says_when_requests_cannot_all_decode(model) -> None:
    engine = LLM(model.loaded, num_blocks=64, max_num_seqs=2).engine
    with pytest.raises(RuntimeError, match="3 requests were not all decoding"):
        measure(engine, num_requests=3, prompt_len=4, steps=1)


def test_command_prints_a_row_per_batch_size(tiny_model, capsys) -> None:
    args = ["bench", "scheduler-overhead", "--model", str(tiny_model("llama"))]
    assert main([*args, "--batch-sizes", "2,4", "--steps", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| running requests | step ms | schedule |")
    assert [row.split(" | ")[0] for row in rows[1:]] == ["| 2", "| 4"]


def test_command_rejects_bad_batch_sizes(capsys) -> None:
    assert main(["bench", "scheduler-overhead", "--batch-sizes", "0,8"]) == 2
    assert "--batch-sizes must be positive integers" in capsys.readouterr().err
