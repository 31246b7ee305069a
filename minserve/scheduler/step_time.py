"""The scheduler with a step-time target: decodes keep their TPOT while prompts queue up.

Under overload every step would carry a full `max_num_batched_tokens` prompt chunk beside
the running decodes, so each of their tokens waits for it and TPOT climbs with the queue.
`StepTimeScheduler` is the same scheduler with the step's token budget cut, before it plans
the step, to its decodes plus the prompt tokens the step-time budget allows
(`step_budget.prefill_budget`, from the cost model in `step_cost.py`). Decodes still go
first; the prompt chunks, of running and of waiting sequences, share what is left.

After each step it learns from the worker's measured time (as the draft planner learns its
costs): the cost model's fit, the bank of unused step time, and the rate at which prompt
tokens are computed while there are prompts to compute, which the server's admission reads
(`minserve/server/admission.py`). Until the cost model has a fit, a step with decodes runs
`min_chunk` prompt tokens at most: short steps, measured soon.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minserve.config import SchedulerConfig
from minserve.kvcache.manager import KVCacheManager
from minserve.messages import ModelRunnerOutput, SchedulerOutput, SchedulerUpdate
from minserve.request import StopRules
from minserve.scheduler.draft_planner import DraftPlanner
from minserve.scheduler.scheduler import Scheduler, StepPlan
from minserve.scheduler.sequence import Sequence
from minserve.scheduler.step_budget import StepBudget, prefill_budget
from minserve.scheduler.step_cost import StepCostModel, StepShape, cost_metrics, step_shape


class PrefillRate:
    """Prompt tokens computed per second while there were prompt tokens to compute (recent
    steps weigh more; a step that only decodes while prompts wait counts, with none): how
    fast the queue in front of a new request drains."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self._tokens = 0.0
        self._seconds = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        self._tokens = self.decay * self._tokens + num_tokens
        self._seconds = self.decay * self._seconds + seconds

    @property
    def tokens_per_s(self) -> float:
        """0 until a step ran with prompts waiting."""
        return self._tokens / self._seconds if self._seconds > 0 else 0.0


class StepTimeScheduler(Scheduler):
    """`Scheduler` whose steps keep a step-time target (`target_tpot_ms`) while decodes run.

    `step_cost` (default: a `step_cost_model_cls`, minserve's `StepCostModel` or chapter
    04's, fitted online) and `budget` (default: from the config, None when `target_tpot_ms`
    is off: the steps are not capped, the costs are still learned) can be given, as tests do
    with a fixed cost model.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        rules: StopRules | None = None,
        drafts: DraftPlanner | None = None,
        *,
        step_cost: StepCostModel | None = None,
        budget: StepBudget | None = None,
        step_cost_model_cls: type[StepCostModel] = StepCostModel,
        **scheduling_rules: Callable[..., Any],
    ) -> None:
        super().__init__(config, kv, rules, drafts, **scheduling_rules)
        self.step_cost = step_cost or step_cost_model_cls()
        self.budget = budget if budget is not None else StepBudget.from_config(config)
        self.prefill_rate = PrefillRate()
        self.banked_s = 0.0  # step time decodes have not used yet (< 0: overrun)
        self.num_capped_steps = 0  # steps the cap left prompt tokens waiting in
        self._prefill_demand = 0  # prompt tokens that could run when this step was planned
        self._prefill_allowed: int | None = None  # this step's cap (None: not capped)

    def _schedule_running(self, out: StepPlan, budget: int) -> int:
        """The base scheduler's, within this step's capped token budget (what is left of it
        goes to the waiting sequences)."""
        decodes = [s for s in self.running if s.is_decode]
        prefills = [s for s in self.running if not s.is_decode]
        seated = [*prefills, *self._seatable_waiting()]
        self._prefill_demand = sum(s.num_uncomputed_tokens for s in seated)
        return super()._schedule_running(out, self._token_cap(decodes, prefills, budget))

    def _seatable_waiting(self) -> list[Sequence]:
        """The waiting sequences the free seats can take, in policy order (as admitted)."""
        seats = self.config.max_num_seqs - self._num_seqs()
        seatable = []
        for seq in sorted(self.waiting, key=self.policy):
            if seq.width > seats:
                break
            seats -= seq.width
            seatable.append(seq)
        return seatable

    def _token_cap(self, decodes: list[Sequence], prefills: list[Sequence], budget: int) -> int:
        cost = self.step_cost.current
        self._prefill_allowed = None
        if self.budget is None:
            return budget
        if cost is None:  # nothing measured yet: small chunks beside decodes, so steps are
            allowed = self.budget.min_chunk if decodes else budget  # short and soon measured
        else:
            shape = StepShape(len(decodes), sum(s.num_tokens for s in decodes))
            start = max((s.num_computed_tokens for s in prefills), default=0)
            allowed = prefill_budget(cost, self.budget, shape, self.banked_s,
                                     self._prefill_demand, start)  # fmt: skip
        if len(decodes) + allowed < budget:
            self._prefill_allowed = allowed
        return min(budget, len(decodes) + allowed)

    def schedule(self) -> SchedulerOutput:
        """The base scheduler's step; counted as capped when the cap, not the seats or the
        blocks, kept prompt tokens waiting."""
        output = super().schedule()
        prefill = _prefill_tokens(output)
        if prefill == self._prefill_allowed and prefill < self._prefill_demand:
            self.num_capped_steps += 1
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> SchedulerUpdate:
        if runner_output.timings is not None and not scheduler_output.is_empty:
            self._observe_step(scheduler_output, runner_output.timings.total)
        return super().update_from_output(scheduler_output, runner_output)

    def _observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """A step's measured time: the cost model's next point, the bank, and (while prompts
        waited) the prefill rate."""
        capped = self.budget is not None and self.step_cost.current is not None
        self.step_cost.observe(step_shape(output), seconds)
        if self._prefill_demand:  # prompts were waiting (or running) through this step
            self.prefill_rate.observe(_prefill_tokens(output), seconds)
        if capped:  # the bank starts with the cap (an uncapped start is no debt)
            decoded = any(c.is_decode for c in output.chunks)
            self.banked_s = self.budget.banked_after(self.banked_s, seconds) if decoded else 0.0

    def step_time_metrics(self) -> dict[str, float]:
        """The cost model, the prefill rate, the bank and the capped steps (`get_metrics()`)."""
        return {
            "num_steps_capped": self.num_capped_steps,
            "prefill_tokens_per_second": self.prefill_rate.tokens_per_s,
            "step_time_banked_seconds": self.banked_s,
            **cost_metrics(self.step_cost.current),
        }


def _prefill_tokens(output: SchedulerOutput) -> int:
    return sum(c.num_new_tokens for c in output.chunks if not c.is_decode)


def scheduler_class(
    config: SchedulerConfig, scheduler_cls: Callable[..., Scheduler]
) -> Callable[..., Scheduler]:
    """The scheduler an engine builds: the step-time one when a target is set and minserve's
    `Scheduler` was asked for; a class that cannot keep the targets is refused."""
    if not (config.target_tpot_ms or config.target_ttft_ms):
        return scheduler_cls
    if scheduler_cls is Scheduler:
        return StepTimeScheduler
    if isinstance(scheduler_cls, type) and not issubclass(scheduler_cls, StepTimeScheduler):
        raise ValueError(
            f"target_tpot_ms and target_ttft_ms run on minserve's StepTimeScheduler; "
            f"{scheduler_cls.__name__} does not keep them (drop the targets, or subclass it)"
        )
    return scheduler_cls
