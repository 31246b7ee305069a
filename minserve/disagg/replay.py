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
from minserve.request import Request
from minserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minserve.disagg.pd_pair import PrefillDecodePair


def replay(engine: LLMEngine, workload: list[SimRequest]) -> SimResult:
    """Run `workload` on `engine` (colocated, one instance); its measured request times."""
    if engine.has_unfinished_requests():
        raise ValueError("replay on an idle engine: it has requests in flight")
    vocab = engine.loaded.config.vocab_size
    pending = sorted(workload, key=lambda r: r.arrival_s)
    started: list[tuple[float, SimRequest, Request]] = []
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0].arrival_s <= now:
            started.append(_add(engine, pending.pop(0), len(started), start, vocab))
        if engine.has_unfinished_requests():
            engine.step()
        elif pending:
            time.sleep(max(0.0, pending[0].arrival_s - (time.monotonic() - start)))
    return SimResult(tuple(_times(*entry) for entry in started))


def replay_pair(pair: PrefillDecodePair, workload: list[SimRequest]) -> SimResult:
    """Run `workload` through a prefill/decode pair in real time; its measured request times.

    A request finishes when its last token reaches this (the prefill and proxy) process.
    """

    engine = pair.llm.engine
    if engine.has_unfinished_requests():
        raise ValueError("replay on an idle pair: it has requests in flight")
    vocab = engine.loaded.config.vocab_size
    pending = sorted(workload, key=lambda r: r.arrival_s)
    started: list[tuple[float, SimRequest, Request]] = []
    done: dict[str, object] = {}  # request id -> its output (the pair's loop fills it)
    finished: dict[str, float] = {}  # request id -> when its last token got here
    leaving: list = []  # sequences whose prefill finished last round, to hand off
    start = time.monotonic()
    while pending or len(finished) < len(started):
        while pending and pending[0].arrival_s <= time.monotonic() - start:
            started.append(_add(engine, pending.pop(0), len(started), start, vocab))
        if len(finished) == len(started) and not leaving:  # idle until the next arrival
            time.sleep(max(0.0, pending[0].arrival_s - (time.monotonic() - start)))
            continue
        leaving, results = pair.run_round(leaving, done)
        done.update((r["request_id"], r) for r in results)
        now = time.monotonic()
        finished.update((rid, now) for rid in done if rid not in finished)
    return SimResult(tuple(_pair_times(entry, finished) for entry in started))


def _add(
    engine: LLMEngine, spec: SimRequest, index: int, start: float, vocab: int
) -> tuple[float, SimRequest, Request]:
    """Add one workload request (made-up prompt ids, greedy, exact output length)."""
    prompt = [(7 * i + 3 * index) % vocab for i in range(spec.prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=spec.output_len, ignore_eos=True)
    request = engine.add_request(f"replay-{index}", None, prompt, params)
    return start + spec.arrival_s, spec, request


def _times(arrival: float, spec: SimRequest, request: Request) -> RequestTimes:
    metrics = request.metrics
    assert metrics.first_token_time is not None and metrics.finished_time is not None
    return RequestTimes(arrival, metrics.first_token_time, metrics.finished_time, spec.output_len)


def _pair_times(
    entry: tuple[float, SimRequest, Request], finished: dict[str, float]
) -> RequestTimes:
    arrival, spec, request = entry
    assert request.metrics.first_token_time is not None
    first, last = request.metrics.first_token_time, finished[request.request_id]
    return RequestTimes(arrival, first, last, spec.output_len)
