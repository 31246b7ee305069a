"""Step traces: drive `LLMEngine.step()` yourself and record what every step ran.

Per step: the requests added just before it, which requests ran and how many tokens
each computed (a prefill chunk or one decode token), who was preempted, who got a new
token, and the step's wall time. Time in a trace is engine time: step durations laid
end to end, so a request's token times and inter-token latencies (ITL) follow from the
steps. Chapters 03 and 04 draw their timelines and latency plots from these traces
(`minserve.viz.timeline`).

    trace = trace_engine(llm.engine, [Arrival("a", ids, params), ...])
    trace.steps[0].scheduled        # (ScheduledWork("a", 12, is_decode=False), ...)
    trace.inter_token_latencies("a")
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from minserve.engine import LLMEngine, observe_steps
from minserve.outputs import OutputAccumulator, RequestOutput
from minserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Arrival:
    """A request to add before step number `step` (0: before the first step)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    step: int = 0


@dataclass(frozen=True)
class ScheduledWork:
    """One request's share of a step: a prefill chunk, or one decode token."""

    request_id: str
    num_tokens: int
    is_decode: bool


@dataclass(frozen=True)
class TracedStep:
    """One engine step: what it ran, what came out of it, and how long it took."""

    duration: float  # seconds
    scheduled: tuple[ScheduledWork, ...]
    preempted: tuple[str, ...] = ()
    sampled: tuple[str, ...] = ()  # one entry per token sampled at the end of the step
    added: tuple[str, ...] = ()  # requests added just before the step

    @property
    def num_tokens(self) -> int:
        """Tokens this step computed (what the token budget limits)."""
        return sum(work.num_tokens for work in self.scheduled)


@dataclass
class StepTrace:
    """Every step of a run, in order, and each request's final output."""

    steps: list[TracedStep] = field(default_factory=list)
    outputs: dict[str, RequestOutput] = field(default_factory=dict)

    @property
    def ends(self) -> list[float]:
        """When each step finished, in seconds of engine time since the first began."""
        return list(itertools.accumulate(step.duration for step in self.steps))

    @property
    def starts(self) -> list[float]:
        return [end - step.duration for end, step in zip(self.ends, self.steps)]

    @property
    def wall_time(self) -> float:
        return sum(step.duration for step in self.steps)

    @property
    def request_ids(self) -> list[str]:
        """Requests in the order they were added."""
        return [request_id for step in self.steps for request_id in step.added]

    @property
    def num_generated(self) -> int:
        return sum(len(step.sampled) for step in self.steps)

    @property
    def throughput(self) -> float:
        """Generated tokens per second of engine time."""
        return self.num_generated / self.wall_time if self.wall_time else 0.0

    @property
    def num_preemptions(self) -> int:
        return sum(len(step.preempted) for step in self.steps)

    def token_times(self, request_id: str) -> list[float]:
        """When each of the request's tokens came out (the end of the step that sampled it)."""
        return [end for end, s in zip(self.ends, self.steps) for r in s.sampled if r == request_id]

    def arrival_time(self, request_id: str) -> float:
        """The start of the first step after the request was added."""
        return next(t for t, s in zip(self.starts, self.steps) if request_id in s.added)

    def inter_token_latencies(self, request_id: str) -> list[float]:
        """Seconds between successive tokens of one request."""
        times = self.token_times(request_id)
        return [b - a for a, b in zip(times, times[1:])]

    def time_to_first_token(self, request_id: str) -> float:
        return self.token_times(request_id)[0] - self.arrival_time(request_id)

    def token_ids(self, request_id: str) -> list[list[int]]:
        """The final token ids of each of the request's samples."""
        return [c.token_ids for c in self.outputs[request_id].outputs]

    def schedule_lines(self) -> list[str]:
        """Each step as one line, "step  3: a decode 1, b prefill 5", for printing."""
        return [f"step {i:>2}: {_describe(step)}" for i, step in enumerate(self.steps)]


def _describe(step: TracedStep) -> str:
    parts = [
        f"{w.request_id} {'decode' if w.is_decode else 'prefill'} {w.num_tokens}"
        for w in step.scheduled
    ]
    parts += [f"{request_id} preempted" for request_id in step.preempted]
    return ", ".join(parts)


def fastest_of(traces: Sequence[StepTrace]) -> StepTrace:
    """Runs of one deterministic schedule, combined step by step into the fastest time.

    Step i does the same work in every run, so its minimum time over the runs filters out
    the moments the machine was busy with something else.
    """
    first = traces[0]
    for other in traces[1:]:
        if [s.scheduled for s in other.steps] != [s.scheduled for s in first.steps]:
            raise ValueError("the runs scheduled different work; only repeats can be combined")
    runs = zip(*(trace.steps for trace in traces))  # step i of every run
    steps = [
        replace(step, duration=min(s.duration for s in same))
        for step, same in zip(first.steps, runs)
    ]
    return StepTrace(steps, dict(first.outputs))


def fastest_runs(
    runs: Mapping[str, Callable[[], StepTrace]], repeats: int = 3
) -> dict[str, StepTrace]:
    """Each run `repeats` times, combined with `fastest_of`.

    The runs take turns (A, B, A, B, ...), so a busy spell of the machine hits every
    configuration alike instead of one of them.
    """
    traces: dict[str, list[StepTrace]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            traces[name].append(run())
    return {name: fastest_of(repeated) for name, repeated in traces.items()}


class _Recorder:
    """Adds requests to an engine, runs its steps and writes down what happened."""

    def __init__(self, engine: LLMEngine, clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine = engine
        self.clock = clock  # wall time; time.process_time counts only this process's CPU time
        self.trace = StepTrace()
        self._added: list[str] = []
        self._whole = OutputAccumulator()  # each request's output so far

    def add(self, arrival: Arrival) -> None:
        ids = list(arrival.prompt_token_ids)
        self.engine.add_request(arrival.request_id, None, ids, arrival.params)
        self._added.append(arrival.request_id)

    def step(self) -> None:
        with observe_steps(self.engine) as records:
            start = self.clock()
            outputs = self.engine.step()
            duration = self.clock() - start
        if not records:
            return  # an empty step: the engine does not count it either
        batch = records[-1].scheduler_output
        self.trace.steps.append(
            TracedStep(
                duration=duration,
                scheduled=tuple(
                    ScheduledWork(c.request_id, c.num_new_tokens, c.is_decode) for c in batch.chunks
                ),
                preempted=batch.preempted_request_ids,
                sampled=tuple(r for output in outputs for r in self._new_tokens(output)),
                added=tuple(self._added),
            )
        )
        self._added = []

    def _new_tokens(self, delta: RequestOutput) -> list[str]:
        """The request's id once per token it got this step."""
        whole = self._whole.add(delta)
        if whole.finished:
            self.trace.outputs[delta.request_id] = whole
        return [delta.request_id] * sum(len(c.token_ids) for c in delta.outputs)

    def run_until_done(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()


def trace_engine(
    engine: LLMEngine, arrivals: Sequence[Arrival], clock: Callable[[], float] = time.perf_counter
) -> StepTrace:
    """Continuous batching: add each request before its step, run until all finish.

    When the engine runs dry before the next arrival's step, that arrival comes at once.
    `clock` times the steps: wall time, or `time.process_time` (this process's CPU time,
    steadier on a machine shared with other jobs).
    """
    recorder = _Recorder(engine, clock)
    pending = sorted(arrivals, key=lambda a: a.step)
    while pending or engine.has_unfinished_requests():
        now = len(recorder.trace.steps)
        while pending and (pending[0].step <= now or not engine.has_unfinished_requests()):
            recorder.add(pending.pop(0))
        recorder.step()
    return recorder.trace


def trace_static_batches(
    engine: LLMEngine, arrivals: Sequence[Arrival], batch_size: int
) -> StepTrace:
    """Static batching on the same engine: admit `batch_size` requests, run them all to
    completion, only then admit the next batch (arrival steps are ignored)."""
    recorder = _Recorder(engine)
    for first in range(0, len(arrivals), batch_size):
        for arrival in arrivals[first : first + batch_size]:
            recorder.add(arrival)
        recorder.run_until_done()
    return recorder.trace
