"""Exercise 8.5's checks: the solutions pass them, the usual wrong event loops are caught with
a message that says what went wrong, and the planner runs the simulator it is given."""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest

from minserve.course import checks_ch08 as checks
from minserve.disagg.planner import search_shapes
from minserve.disagg.sim_instance import SimState
from minserve.disagg.simulator import SLO, ClusterRun, SimResult, _times, simulate
from minserve.disagg.workload import poisson_workload
from solutions import ch08_transfer_rule as solutions

CHECKS = [
    checks.check_one_colocated_request_is_one_prefill_step_then_decode_steps,
    checks.check_a_hand_off_costs_latency_plus_bytes_over_bandwidth,
    checks.check_the_kv_goes_to_the_least_loaded_decode_instance,
    checks.check_arrivals_join_the_least_loaded_front_instance,
    checks.check_a_busy_instance_finishes_its_step_before_starting_another,
    checks.check_a_poisson_workload_keeps_every_request_s_bounds,
]


def _student(run_cls: type[ClusterRun]) -> types.SimpleNamespace:
    """A module whose `simulate` replays with `run_cls` (minserve's loop, one mistake in)."""

    def student_simulate(workload, shape, costs, config):
        return run_cls(shape, costs, config).replay(workload)

    return types.SimpleNamespace(simulate=student_simulate, ClusterRun=run_cls)


class _NoLatency(ClusterRun):
    def transfer_s(self, state) -> float:
        nbytes = state.spec.prompt_len * self.costs.kv_bytes_per_token
        return nbytes / self.config.transfer_bandwidth_bytes_s  # the latency forgotten


class _FirstDecoder(ClusterRun):
    def _hand_off(self, state, now: float) -> None:
        self._push(now + self.transfer_s(state), "kv_landed", (self.decoders[0], state))


class _FirstFront(ClusterRun):
    def replay(self, workload):
        self.front = self.front[:1] * len(self.front)  # every arrival to the first instance
        return super().replay(workload)


class _IgnoresBusy(ClusterRun):
    def _start(self, instance, now: float) -> None:
        instance.busy = False  # starts a step even while one runs
        super()._start(instance, now)


class _FirstInFirstOut(ClusterRun):
    """Runs events in the order they were pushed, not in time order."""

    def _push(self, time: float, kind: str, what: object) -> None:
        self.events.append((time, next(self.order), kind, what))

    def replay(self, workload):
        states = [SimState(spec, spec.prompt_len) for spec in workload]
        for state in states:
            self._push(state.spec.arrival_s, "arrive", state)
        while self.events:
            now, _, kind, what = self.events.pop(0)
            if kind == "arrive":
                self._enqueue(min(self.front, key=lambda i: i.load), what, now)
            elif kind == "kv_landed":
                self._enqueue(*what, now)
            else:
                self._step_done(*what, now)
        return SimResult(tuple(_times(s) for s in states))


class _HandsOffFinished(ClusterRun):
    """Hands off every completed prefill, even one whose only token is already out."""

    def _step_done(self, instance, step, now: float) -> None:
        instance.busy = False
        for state in instance.finish_step(step, now):
            if instance.role == "prefill":
                self._hand_off(state, now)
        self._start(instance, now)


class _NeverRestarts(ClusterRun):
    def _step_done(self, instance, step, now: float) -> None:
        instance.busy = False
        for state in instance.finish_step(step, now):
            if instance.role == "prefill" and not state.done:
                self._hand_off(state, now)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_solution_passes(check: Callable) -> None:
    check(solutions)


@pytest.mark.parametrize(
    ("run_cls", "check", "error", "message"),
    [
        (
            _NoLatency,
            checks.check_a_hand_off_costs_latency_plus_bytes_over_bandwidth,
            AssertionError,
            r"expected 0.05 \+ 100000 / 1e6 = 0.15 s, got 0.1",
        ),
        (
            _FirstDecoder,
            checks.check_the_kv_goes_to_the_least_loaded_decode_instance,
            AssertionError,
            r"B's KV must go to the decode instance that is not decoding A",
        ),
        (
            _FirstFront,
            checks.check_arrivals_join_the_least_loaded_front_instance,
            AssertionError,
            r"the second must join the idle instance: expected \[\(0.11, 0.122\)",
        ),
        (
            _IgnoresBusy,
            checks.check_a_busy_instance_finishes_its_step_before_starting_another,
            AssertionError,
            r"two steps of one instance overlapped",
        ),
        (
            _FirstInFirstOut,
            checks.check_a_poisson_workload_keeps_every_request_s_bounds,
            AssertionError,
            r"events out of time order, or steps that overlap\?",
        ),
        (
            _HandsOffFinished,
            checks.check_a_poisson_workload_keeps_every_request_s_bounds,
            AssertionError,
            r"1 output\): its only token is its first, so it finishes there",
        ),
        (
            _NeverRestarts,
            checks.check_one_colocated_request_is_one_prefill_step_then_decode_steps,
            RuntimeError,
            r"the simulation ended with a request unfinished .* no event was left to run it",
        ),
    ],
    ids=["no-latency", "first-decoder", "first-front", "busy", "fifo", "done", "no-restart"],
)
def test_a_wrong_event_loop_is_caught(
    run_cls: type[ClusterRun], check: Callable, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        check(_student(run_cls))


def test_the_planner_runs_the_simulator_it_is_given() -> None:
    """search_shapes(..., simulator=solutions.simulate) ranks as minserve's simulate does."""
    calls = []

    def counted(*args):
        calls.append(args[1])
        return solutions.simulate(*args)

    work = poisson_workload(rate=20, num_requests=30, prompt_len=(20, 300), output_len=(1, 20))
    args = (4, work, {1: checks.SIM_COSTS}, SLO(ttft_s=0.5, tpot_s=0.05), checks.SIM_CONFIG)
    plugged = search_shapes(*args, simulator=counted)
    ours = search_shapes(*args, simulator=simulate)
    assert [p.shape for p in plugged] == [p.shape for p in ours] and len(calls) == len(ours)
    assert [p.goodput for p in plugged] == [p.goodput for p in ours]
