"""How many prompt tokens a step may run beside its decodes: a step-time budget.

Sarathi-Serve's stall-free batching runs every decode each step and fills what is left of a
token budget with prompt chunks; its budget is sized offline so a step stays inside the
TPOT SLO. Here the budget is the time itself: the cost model (`step_cost.py`) says how many
prompt tokens fit beside this step's decodes within the target step time.

TPOT is a mean over a request's steps, so a step may also spend time earlier steps left
unused: every step with decodes banks `target - its time` (a debt when it ran over), up to
`carry_steps` targets either way. A step whose prompt chunk would pay the prefill jump (the
cost model's `prefill_s`) for a sliver of prompt runs its decodes alone instead and banks
their slack; the chunk runs once the target plus the bank hold a worthwhile one: tokens
worth `jump_ratio` jumps (`break_even_chunk`; at least `min_chunk`), or all the prompt
tokens waiting if fewer, or the largest chunk a full bank holds if that is less. So the
jump is a small share of a prompt's time, and the mean step stays at the target.

Prompts always progress: a step without decodes is not capped, and when the target is out
of reach (the decodes alone take it, or not even `min_chunk` tokens fit beside them with a
full bank) every step runs `min_chunk` prompt tokens. With `carry_steps=0` it is a per-step
cap: as many prompt tokens as fit the target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minserve.config import SchedulerConfig
from minserve.scheduler.step_cost import StepCost, StepShape


@dataclass(frozen=True)
class StepBudget:
    """The step-time target and how it is kept."""

    target_s: float  # the mean step time decodes should see (the TPOT target)
    max_num_batched_tokens: int
    min_chunk: int = 16  # the fewest prompt tokens a capped step runs (but a prompt's last)
    carry_steps: float = 4.0  # unused (or overrun) time carried to later steps, in targets
    jump_ratio: float = 4.0  # a chunk's tokens cost this many prefill jumps, or more

    def __post_init__(self) -> None:
        if self.target_s <= 0:
            raise ValueError(f"target_s must be positive, got {self.target_s}")
        if self.min_chunk < 1 or self.carry_steps < 0 or self.jump_ratio < 0:
            raise ValueError(
                f"min_chunk must be >= 1, carry_steps and jump_ratio >= 0; got "
                f"{self.min_chunk}, {self.carry_steps}, {self.jump_ratio}"
            )

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> StepBudget | None:
        """The budget `target_tpot_ms` asks for; None when it is off."""
        if not config.target_tpot_ms:
            return None
        return cls(config.target_tpot_ms / 1000, config.max_num_batched_tokens)

    @property
    def carry_s(self) -> float:
        return self.carry_steps * self.target_s

    def banked_after(self, banked_s: float, step_s: float) -> float:
        """The bank after a step with decodes that took `step_s`."""
        return min(self.carry_s, max(-self.carry_s, banked_s + self.target_s - step_s))


def prefill_budget(
    cost: StepCost,
    budget: StepBudget,
    decodes: StepShape,
    banked_s: float,
    demand: int | None = None,
    start: int = 0,
) -> int:
    """Prompt tokens this step may run beside `decodes` (its decodes' shape), with `banked_s`
    in the bank and `demand` prompt tokens waiting (None: more than any step holds);
    `start`: the tokens computed before the chunk (its context)."""
    room = max(0, budget.max_num_batched_tokens - decodes.num_tokens)
    if decodes.num_tokens == 0:  # no decode waits on this step
        return room
    target = budget.target_s
    minimum = min(room, budget.min_chunk)
    largest = min(room, cost.max_prefill_tokens(decodes, target + budget.carry_s, start))
    if largest < minimum or cost.predict(decodes) >= target:
        return minimum  # the target is out of reach: keep prompts moving
    worthwhile = max(minimum, math.ceil(budget.jump_ratio * cost.break_even_chunk()))
    wanted = min(largest, worthwhile, demand or worthwhile)
    fits = min(room, cost.max_prefill_tokens(decodes, target + banked_s, start))
    return fits if fits >= wanted else 0
