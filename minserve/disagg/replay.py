"""Replay a simulator workload on the real engine, in real time: the simulator's check.

Requests are added when their arrival time comes (between steps, as a server would);
TTFT and TPOT come from each request's own timestamps. Simulating the same workload
with calibrated `StepCosts` and comparing the two is how the simulator is validated
(issue 7 asks for agreement within 20% on what runs here).
"""

from __future__ import annotations

import time

from minserve.disagg.simulator import RequestTimes, SimResult
from minserve.disagg.workload import SimRequest
from minserve.engine import LLMEngine
from minserve.request import Request
from minserve.sampling_params import SamplingParams


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
            spec = pending.pop(0)
            prompt = [(7 * i + 3 * len(started)) % vocab for i in range(spec.prompt_len)]
            params = SamplingParams(temperature=0, max_tokens=spec.output_len, ignore_eos=True)
            request = engine.add_request(f"replay-{len(started)}", None, prompt, params)
            started.append((start + spec.arrival_s, spec, request))
        if engine.has_unfinished_requests():
            engine.step()
        elif pending:
            time.sleep(max(0.0, pending[0].arrival_s - (time.monotonic() - start)))
    return SimResult(tuple(_times(*entry) for entry in started))


def _times(arrival: float, spec: SimRequest, request: Request) -> RequestTimes:
    metrics = request.metrics
    assert metrics.first_token_time is not None and metrics.finished_time is not None
    return RequestTimes(arrival, metrics.first_token_time, metrics.finished_time, spec.output_len)
