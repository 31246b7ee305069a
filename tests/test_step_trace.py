"""Step traces record exactly what the engine ran: every step, every token, every chunk."""

from __future__ import annotations

import pytest

from minserve import LLM, SamplingParams
from minserve.viz.step_trace import (
    Arrival,
    ScheduledWork,
    StepTrace,
    TracedStep,
    fastest_of,
    fastest_runs,
    trace_engine,
    trace_static_batches,
)

BUDGET = 16


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


ARRIVALS = [
    Arrival("short", tuple(range(10, 15)), greedy(6)),
    Arrival("other", tuple(range(20, 28)), greedy(3)),
    Arrival("long", tuple(range(100, 150)), greedy(2), step=2),  # 50 tokens: 4 chunks at least
]


@pytest.fixture(scope="module")
def llm_and_trace(tiny_model) -> tuple[LLM, StepTrace]:
    llm = LLM(tiny_model("llama"), block_size=4, max_num_batched_tokens=BUDGET)
    return llm, trace_engine(llm.engine, ARRIVALS)


def test_one_record_per_engine_step(llm_and_trace) -> None:
    llm, trace = llm_and_trace
    assert len(trace.steps) == llm.get_metrics()["num_steps"]
    assert sum(step.num_tokens for step in trace.steps) == llm.get_metrics()["batched_tokens"]


def test_every_generated_token_is_accounted_for(llm_and_trace) -> None:
    _, trace = llm_and_trace
    for arrival in ARRIVALS:
        tokens = trace.token_ids(arrival.request_id)[0]
        assert len(tokens) == arrival.params.max_tokens
        assert len(trace.token_times(arrival.request_id)) == len(tokens)
        assert len(trace.inter_token_latencies(arrival.request_id)) == len(tokens) - 1
    assert trace.num_generated == 6 + 3 + 2


def test_every_prompt_token_is_computed_once_without_preemption(llm_and_trace) -> None:
    _, trace = llm_and_trace
    for arrival in ARRIVALS:
        prefill = [
            w.num_tokens
            for step in trace.steps
            for w in step.scheduled
            if w.request_id == arrival.request_id and not w.is_decode
        ]
        assert sum(prefill) == len(arrival.prompt_token_ids)


def test_chunks_of_a_long_prompt_never_exceed_the_budget(llm_and_trace) -> None:
    _, trace = llm_and_trace
    chunks = [w.num_tokens for s in trace.steps for w in s.scheduled if w.request_id == "long"]
    assert len(chunks) >= 4 and max(chunks) <= BUDGET
    assert all(step.num_tokens <= BUDGET for step in trace.steps)


def test_a_request_arrives_before_its_step(llm_and_trace) -> None:
    _, trace = llm_and_trace
    assert trace.steps[0].added == ("short", "other")
    assert trace.steps[2].added == ("long",)
    assert trace.request_ids == ["short", "other", "long"]
    assert trace.arrival_time("long") == pytest.approx(trace.starts[2])


def test_decodes_are_one_token_after_the_prompt(llm_and_trace) -> None:
    _, trace = llm_and_trace
    first = trace.steps[0].scheduled
    assert first == (ScheduledWork("short", 5, False), ScheduledWork("other", 8, False))
    assert ScheduledWork("short", 1, True) in trace.steps[1].scheduled


def test_static_batches_wait_for_the_whole_batch(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), block_size=4)
    trace = trace_static_batches(llm.engine, ARRIVALS, batch_size=2)
    assert trace.steps[0].added == ("short", "other")
    second = next(i for i, step in enumerate(trace.steps) if step.added == ("long",))
    assert second == 6  # "short" needs 6 steps; "other" finished after 3 and left a seat idle
    assert trace.num_generated == 11


def test_fastest_of_keeps_each_steps_minimum() -> None:
    work = (ScheduledWork("a", 1, True),)
    one = StepTrace([TracedStep(0.3, work), TracedStep(0.1, work)])
    two = StepTrace([TracedStep(0.2, work), TracedStep(0.4, work)])
    best = fastest_of([one, two])
    assert [s.duration for s in best.steps] == [0.2, 0.1]
    assert best.ends == pytest.approx([0.2, 0.3])
    with pytest.raises(ValueError, match="different work"):
        fastest_of([one, StepTrace([TracedStep(0.1, work)])])


def test_fastest_runs_take_turns_and_keep_the_fastest() -> None:
    calls: list[str] = []
    work = (ScheduledWork("a", 1, True),)

    def run(name: str, duration: float):
        def traced() -> StepTrace:
            calls.append(name)
            return StepTrace([TracedStep(duration + 0.1 * calls.count(name), work)])

        return traced

    best = fastest_runs({"x": run("x", 1.0), "y": run("y", 2.0)}, repeats=2)
    assert calls == ["x", "y", "x", "y"]
    assert best["x"].wall_time == pytest.approx(1.1)
    assert best["y"].wall_time == pytest.approx(2.1)
