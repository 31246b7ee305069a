"""A discrete-event simulator of a serving cluster: TTFT, TPOT and goodput, before buying it.

DistServe's question, "how many prefill and how many decode instances for this workload
and these SLOs?", cannot be answered by running 128 GPUs here. The simulator replays a
workload against a cluster shape using step times measured on the real engine
(`StepCosts`): events are arrivals, ends of steps and KV transfers landing on a decode
instance. Colocated instances mix prefills and decodes in one step; disaggregated ones
hand each finished prefill's KV to the least-loaded decode instance, which costs
`prompt_len x kv_bytes_per_token / bandwidth` seconds.

`SimConfig(lockstep=True)` instead steps all instances in rounds together, as minserve's own
prefill/decode processes do (`sim_rounds.py`). The event loop (`ClusterRun`) is chapter 08's
exercise 8.5.

What it leaves out (say so when quoting it): KV memory limits and preemption on decode
instances, queueing on the transfer links, prefix caching, step-time noise.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from dataclasses import dataclass

from minserve.disagg.costs import StepCosts
from minserve.disagg.sim_instance import PlannedStep, SimInstance, SimState
from minserve.disagg.workload import SimRequest


@dataclass(frozen=True)
class ClusterShape:
    """N colocated instances, or P prefill + D decode instances; each spans `tp` GPUs."""

    num_colocated: int = 0
    num_prefill: int = 0
    num_decode: int = 0
    tp: int = 1

    def __post_init__(self) -> None:
        colocated = self.num_colocated > 0 and self.num_prefill == self.num_decode == 0
        split = self.num_colocated == 0 and self.num_prefill > 0 and self.num_decode > 0
        if not (colocated or split) or self.tp < 1:
            raise ValueError(
                "a cluster is N > 0 colocated instances or P > 0 prefill + D > 0 decode "
                f"instances, with tp >= 1; got {self}"
            )

    @property
    def num_gpus(self) -> int:
        return (self.num_colocated + self.num_prefill + self.num_decode) * self.tp

    @property
    def label(self) -> str:
        kind = f"{self.num_colocated} colocated" if self.num_colocated else (
            f"{self.num_prefill}P{self.num_decode}D"
        )  # fmt: skip
        return f"{kind} TP{self.tp}"


@dataclass(frozen=True)
class SimConfig:
    """Per-instance batching limits (the engine's) and the KV link between instances."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    transfer_bandwidth_bytes_s: float = 1e9
    transfer_latency_s: float = 0.0
    lockstep: bool = False  # instances step in rounds together, as minserve's pair does

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(f"batching limits must be at least 1, got {self}")
        if self.transfer_bandwidth_bytes_s <= 0 or self.transfer_latency_s < 0:
            raise ValueError(f"transfer bandwidth must be > 0 and latency >= 0, got {self}")


@dataclass(frozen=True)
class SLO:
    """Service-level objectives a request must meet to count toward goodput."""

    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class RequestTimes:
    """One simulated request: vLLM bench serve's TTFT and TPOT (TPOT excludes the first token)."""

    arrival_s: float
    first_token_s: float
    finish_s: float
    output_len: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        if self.output_len == 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.output_len - 1)

    def meets(self, slo: SLO) -> bool:
        return self.ttft_s <= slo.ttft_s and self.tpot_s <= slo.tpot_s


@dataclass(frozen=True)
class SimResult:
    """Every request's times; goodput = requests meeting every SLO per second of the run."""

    requests: tuple[RequestTimes, ...]

    @property
    def duration_s(self) -> float:
        """From the first arrival to the last finish."""
        return max(r.finish_s for r in self.requests) - min(r.arrival_s for r in self.requests)

    def goodput(self, slo: SLO) -> float:
        return sum(r.meets(slo) for r in self.requests) / self.duration_s

    def attainment(self, slo: SLO) -> float:
        return sum(r.meets(slo) for r in self.requests) / len(self.requests)

    @property
    def mean_ttft_s(self) -> float:
        return statistics.fmean(r.ttft_s for r in self.requests)

    @property
    def mean_tpot_s(self) -> float:
        return statistics.fmean(r.tpot_s for r in self.requests if r.output_len > 1)


# >>> exercise 8.5: the cluster simulator's event loop
def simulate(
    workload: list[SimRequest], shape: ClusterShape, costs: StepCosts, config: SimConfig
) -> SimResult:
    """Replay `workload` on `shape`; `costs` are one instance's step times (at shape.tp)."""
    if not workload:
        raise ValueError("the workload has no requests")
    run = ClusterRun(shape, costs, config)
    if config.lockstep:
        from minserve.disagg.sim_rounds import simulate_rounds

        states = simulate_rounds(workload, run.front, run.decoders, costs, run.transfer_s)
        return SimResult(tuple(_times(s) for s in states))
    return run.replay(workload)


class ClusterRun:
    """One simulation's clock, event queue and instances (a discrete-event simulation).

    `events` is a heap of (time, tie-break, kind, what): the next event is always the
    earliest, and events at the same time come out in the order they were pushed (`_push`
    numbers them). Three kinds: "arrive" (what: a `SimState`), "step_done" (what:
    (instance, the `PlannedStep` it ran)) and "kv_landed" (what: (decode instance, state)).
    `front` are the instances requests arrive at (colocated, or prefill); `decoders` the
    decode instances (none when colocated). Each `SimInstance` plans its next step
    (`plan()`: None when it has nothing to run), is told when a step ends
    (`finish_step(step, now)`: the requests whose prefill completed in it), says how
    loaded it is (`load`), and is `busy` while a step runs.
    """

    def __init__(self, shape: ClusterShape, costs: StepCosts, config: SimConfig) -> None:
        self.costs, self.config = costs, config
        self.events: list[tuple[float, int, str, object]] = []  # (time, tie-break, kind, what)
        self.order = itertools.count()

        def make(role: str, n: int) -> list[SimInstance]:
            limits = (config.max_num_batched_tokens, config.max_num_seqs)
            return [SimInstance(role, *limits) for _ in range(n)]

        self.front = make("colocated", shape.num_colocated) or make("prefill", shape.num_prefill)
        self.decoders = make("decode", shape.num_decode)

    def replay(self, workload: list[SimRequest]) -> SimResult:
        """Every request's times, in the order of `workload`.

        One `SimState(spec, spec.prompt_len)` per request and an "arrive" event at its
        arrival time; then pop events in time order until none is left. An arrival joins
        the least-loaded front instance, landed KV its decode instance (both through
        `_enqueue`, which starts the instance if it is idle); a finished step goes to
        `_step_done`. The result: `SimResult` of `_times(state)` for each request."""
        # >>> solution
        states = [SimState(spec, spec.prompt_len) for spec in workload]
        for state in states:
            self._push(state.spec.arrival_s, "arrive", state)
        while self.events:
            now, _, kind, what = heapq.heappop(self.events)
            if kind == "arrive":
                self._enqueue(min(self.front, key=lambda i: i.load), what, now)
            elif kind == "kv_landed":
                instance, state = what
                self._enqueue(instance, state, now)
            else:
                self._step_done(*what, now)
        return SimResult(tuple(_times(s) for s in states))
        # <<< solution

    def _push(self, time: float, kind: str, what: object) -> None:
        heapq.heappush(self.events, (time, next(self.order), kind, what))

    def _enqueue(self, instance: SimInstance, state: SimState, now: float) -> None:
        instance.waiting.append(state)
        self._start(instance, now)

    def _start(self, instance: SimInstance, now: float) -> None:
        """An idle instance with work starts its next step: it is busy until a "step_done"
        event, `costs.step_time(prefill tokens, decodes)` seconds from `now`. A busy
        instance, or one whose `plan()` is None, does nothing."""
        # >>> solution
        if instance.busy:
            return
        step = instance.plan()
        if step is None:
            return
        instance.busy = True
        seconds = self.costs.step_time(step.prefill_tokens, len(step.decodes))
        self._push(now + seconds, "step_done", (instance, step))
        # <<< solution

    def _step_done(self, instance: SimInstance, step: PlannedStep, now: float) -> None:
        """The instance's step ended at `now`: it is idle again; on a prefill instance each
        request whose prefill completed and still has tokens to produce is handed off;
        then the instance starts its next step, if it has one."""
        # >>> solution
        instance.busy = False
        for state in instance.finish_step(step, now):
            if instance.role == "prefill" and not state.done:
                self._hand_off(state, now)
        self._start(instance, now)
        # <<< solution

    def _hand_off(self, state: SimState, now: float) -> None:
        """Send a finished prefill's KV to the decode instance least loaded now: it lands
        there (a "kv_landed" event) `transfer_s(state)` seconds later."""
        # >>> solution
        target = min(self.decoders, key=lambda i: i.load)
        self._push(now + self.transfer_s(state), "kv_landed", (target, state))
        # <<< solution

    def transfer_s(self, state: SimState) -> float:
        """Seconds to move one prompt's KV: `config.transfer_latency_s` + its bytes
        (prompt tokens x `costs.kv_bytes_per_token`) / `config.transfer_bandwidth_bytes_s`."""
        # >>> solution
        nbytes = state.spec.prompt_len * self.costs.kv_bytes_per_token
        return self.config.transfer_latency_s + nbytes / self.config.transfer_bandwidth_bytes_s
        # <<< solution


def _times(state: SimState) -> RequestTimes:
    """A finished request's times; an error names a request the simulation left unfinished."""
    if state.first_token_s is None or state.finish_s is None:
        raise RuntimeError(
            f"the simulation ended with a request unfinished ({state.spec}: "
            f"{state.prefill_left} prompt tokens left to prefill, {state.num_generated} of "
            f"{state.spec.output_len} tokens produced): no event was left to run it"
        )
    return RequestTimes(
        state.spec.arrival_s, state.first_token_s, state.finish_s, state.spec.output_len
    )


# <<< exercise
