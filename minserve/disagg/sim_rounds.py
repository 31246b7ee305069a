"""Lockstep rounds: the simulator's model of minserve's own prefill/decode processes.

`PrefillDecodePair` and `minserve serve --disaggregation` run in rounds: the prefill side
first sends last round's finished prefills' KV, then every instance runs one step at the
same time, and the round ends when the slowest step has reported. A decode step therefore
waits for a concurrent prefill step: a long prompt stretches every running sequence's
next token, which is the interference disaggregation is meant to remove, kept by the
rounds. `SimConfig(lockstep=True)` simulates this instead of free-running instances:

    round = sum of the KV sends at its start + max(step time of every busy instance)

Requests that arrive during a round join at the start of the next one, as in the pair.
"""

from __future__ import annotations

from collections.abc import Callable

from minserve.disagg.costs import StepCosts
from minserve.disagg.sim_instance import SimInstance, SimState
from minserve.disagg.workload import SimRequest


def simulate_rounds(
    workload: list[SimRequest],
    front: list[SimInstance],
    decoders: list[SimInstance],
    costs: StepCosts,
    transfer_s: Callable[[SimState], float],
) -> list[SimState]:
    """Replay `workload` round by round; `transfer_s(state)` is one hand-off's seconds."""
    states = sorted((SimState(spec, spec.prompt_len) for spec in workload),
                    key=lambda s: s.spec.arrival_s)  # fmt: skip
    now, arrived, handoffs = 0.0, 0, []
    while arrived < len(states) or any(s.finish_s is None for s in states):
        while arrived < len(states) and states[arrived].spec.arrival_s <= now:
            min(front, key=lambda i: i.load).waiting.append(states[arrived])
            arrived += 1
        sends = 0.0
        for state in handoffs:
            min(decoders, key=lambda i: i.load).waiting.append(state)
            sends += transfer_s(state)
        steps = [(i, step) for i in front + decoders if (step := i.plan()) is not None]
        if not steps:  # nothing in flight: skip to the next arrival
            if arrived == len(states):
                raise RuntimeError("requests are left that no instance will run")
            now = max(now, states[arrived].spec.arrival_s)
            handoffs = []
            continue
        now += sends + max(costs.step_time(s.prefill_tokens, len(s.decodes)) for _, s in steps)
        handoffs = []
        for instance, step in steps:
            prefilled = instance.finish_step(step, now)
            if instance.role == "prefill":
                handoffs += [s for s in prefilled if not s.done]
    return states
