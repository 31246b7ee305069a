"""Finishes travel in the step's messages: the scheduler's update aborts the requests the
worker failed and reports them with the sequences it finished (`SchedulerUpdate`); the next
step's `SchedulerOutput.finished_seq_ids` names every sequence finished since the last step,
and the worker drops what it keeps for them in `execute`; the output processor's one
message back (`OutputStops`) finishes stopped samples and aborts requests whose text failed.
"""

from __future__ import annotations

import dataclasses

import pytest

from minserve import LLM, SamplingParams
from minserve.engine import LLMEngine, observe_steps
from minserve.messages import OutputStops

PROMPT = [5, 6, 7, 8]


def one_seq_id(engine: LLMEngine, request_id: str) -> int:
    (seq,) = engine.scheduler.sequences_of(request_id)
    return seq.seq_id


@pytest.fixture
def engine(tiny_model) -> LLMEngine:
    return LLM(tiny_model("llama")).engine


def test_the_step_after_a_finish_names_the_finished_sequences_to_the_worker(engine) -> None:
    released: list[tuple[int, ...]] = []
    real = engine.worker.release
    engine.worker.release = lambda ids: released.append(tuple(ids)) or real(ids)
    engine.add_request("short", None, PROMPT, SamplingParams(max_tokens=1, ignore_eos=True))
    engine.add_request("long", None, PROMPT[::-1], SamplingParams(max_tokens=3, ignore_eos=True))
    short, long = one_seq_id(engine, "short"), one_seq_id(engine, "long")
    with observe_steps(engine) as records:
        while engine.has_unfinished_requests():
            engine.step()
    named = [r.scheduler_output.finished_seq_ids for r in records]
    assert named == [(), (short,), ()]  # prefill (short finishes), decode, decode (long does)
    assert engine.step() == []  # idle: its message names the last one
    assert released == [(), (short,), (), (long,)]  # every execute, in order


def test_the_update_aborts_the_requests_the_worker_failed_and_reports_them(engine) -> None:
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("good", None, PROMPT, greedy)
    engine.add_request("bad", None, PROMPT[::-1], greedy)
    bad = one_seq_id(engine, "bad")
    sched_out = engine.scheduler.schedule()
    run_out = engine.worker.execute(sched_out)
    failed = dataclasses.replace(
        run_out,
        sampled={k: v for k, v in run_out.sampled.items() if k != bad},
        failed={"bad": "its logits hold NaN"},
    )
    update = engine.scheduler.update_from_output(sched_out, failed)
    assert update.failed == {"bad": "its logits hold NaN"}
    assert update.finished_seq_ids == (bad,)
    assert [new.request_id for new in update.new_tokens] == ["good"]
    assert engine.scheduler.sequences_of("bad") == []
    assert engine.scheduler.schedule().finished_seq_ids == (bad,)


def test_output_stops_finish_the_stopped_sample_and_abort_the_failed_request(engine) -> None:
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("stopped", None, PROMPT, greedy)
    engine.add_request("failed", None, PROMPT[::-1], greedy)
    engine.add_request("going", None, PROMPT[1:], greedy)
    ids = [one_seq_id(engine, r) for r in ("stopped", "failed")]
    (stopped,) = engine.scheduler.sequences_of("stopped")
    engine.step()
    engine.scheduler.apply_stops(OutputStops((("stopped", 0),), {"failed": "bad text"}))
    assert stopped.sample.finish_reason == "stop"
    assert [s.request_id for s in engine.scheduler.running] == ["going"]
    assert engine.scheduler.schedule().finished_seq_ids == tuple(ids)
