"""Replay a simulator workload on the real engine, in real time: the simulator's check.

Requests are added when their arrival time comes (between steps, as a server would);
TTFT and TPOT come from each request's own timestamps. Simulating the same workload
with calibrated `StepCosts` and comparing the two is how the simulator is validated
(we aim for agreement within 20% on what runs here).

`replay` drives one colocated engine; `replay_pair` drives a `PrefillDecodePair` (1P1D):
its rounds (hand off, one prefill step here while the decode process steps, collect the
finished) run with requests joining the prefill engine as they arrive.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from minserve.disagg.simulator import RequestTimes, SimResult
from minserve.disagg.workload import SimRequest
from minserve.engine import LLMEngine
from minserve.outputs import OutputAccumulator, RequestMetrics
from minserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minserve.disagg.pd_pair import PrefillDecodePair


def replay(engine: LLMEngine, workload: list[SimRequest]) -> SimResult:
    """Run `workload` on `engine` (colocated, one instance); its measured request times."""
    if engine.has_unfinished_requests():
        raise ValueError("replay on an idle engine: it has requests in flight")
    vocab = engine.loaded.config.vocab_size
    pending = sorted(workload, key=lambda r: r.arrival_s)
    started: list[tuple[float, SimRequest, str]] = []
    whole = OutputAccumulator()
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0].arrival_s <= now:
            started.append(_add(engine, pending.pop(0), len(started), start, vocab))
        if engine.has_unfinished_requests():
            for delta in engine.step():
                whole.add(delta)
        elif pending:
            time.sleep(max(0.0, pending[0].arrival_s - (time.monotonic() - start)))
    return SimResult(tuple(_times(a, spec, _metrics(whole, rid)) for a, spec, rid in started))


def replay_pair(pair: PrefillDecodePair, workload: list[SimRequest]) -> SimResult:
    """Run `workload` through a prefill/decode pair in real time; its measured request times.

    A request finishes when its last token reaches this (the prefill and proxy) process.
    """

    engine = pair.llm.engine
    if engine.has_unfinished_requests():
        raise ValueError("replay on an idle pair: it has requests in flight")
    vocab = engine.loaded.config.vocab_size
    pending = sorted(workload, key=lambda r: r.arrival_s)
    started: list[tuple[float, SimRequest, str]] = []
    whole = OutputAccumulator()  # request id -> its output (the pair's rounds fill it)
    leaving: list = []  # sequences whose prefill finished last round, to hand off
    start = time.monotonic()

    def num_finished() -> int:
        return sum(out.finished for out in whole.outputs.values())

    while pending or num_finished() < len(started):
        while pending and pending[0].arrival_s <= time.monotonic() - start:
            started.append(_add(engine, pending.pop(0), len(started), start, vocab))
        if num_finished() == len(started) and not leaving:  # idle until the next arrival
            time.sleep(max(0.0, pending[0].arrival_s - (time.monotonic() - start)))
            continue
        leaving = pair.run_round(leaving, whole)
    return SimResult(tuple(_times(a, spec, _metrics(whole, rid)) for a, spec, rid in started))


def _add(
    engine: LLMEngine, spec: SimRequest, index: int, start: float, vocab: int
) -> tuple[float, SimRequest, str]:
    """Add one workload request (made-up prompt ids, greedy, exact output length)."""
    prompt = [(7 * i + 3 * index) % vocab for i in range(spec.prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=spec.output_len, ignore_eos=True)
    request_id = f"replay-{index}"
    engine.add_request(request_id, None, prompt, params)
    return start + spec.arrival_s, spec, request_id


def _metrics(whole: OutputAccumulator, request_id: str) -> RequestMetrics:
    metrics = whole.outputs[request_id].metrics
    assert metrics is not None
    return metrics


def _times(arrival: float, spec: SimRequest, metrics: RequestMetrics) -> RequestTimes:
    """A request's measured times (for a pair: its finish is when its last token got here)."""
    assert metrics.first_token_time is not None and metrics.finished_time is not None
    return RequestTimes(arrival, metrics.first_token_time, metrics.finished_time, spec.output_len)
