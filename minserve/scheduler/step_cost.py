"""What a step costs: a linear model of step time, fitted online from the steps measured.

    seconds = fixed + prefill * [the step runs a prompt chunk] + per_token * tokens
              + per_context_token * context tokens

`tokens` are those the step runs through the model (decodes, prompt chunks, draft slots);
`context tokens` the KV positions its sequences hold after it (what attention reads). The
prefill term is the jump a step pays once any sequence runs more than one token: on a CPU a
step of single-token decodes takes a fused path, and one prompt chunk sends the whole step
down the general one. Step-time-aware schedulers (Sarathi-Serve's token budget, profiled
offline; SLO-aware ones such as SLOs-Serve) predict a step this way; here the fit is online,
so it follows the machine as it is (load, contention, another model).

The fit is least squares over recent steps (each new step multiplies the weight of the
older ones by `decay`), with every coefficient kept >= 0: a step cannot get cheaper for
running more. Four coefficients make fifteen subsets; the best nonnegative fit is the least-
squares fit on one of them, so trying each is exact.

The model, its inverse and its fit are chapter 04's exercise 4.4 (the marked region below).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import astuple, dataclass

import numpy as np

from minserve.messages import SchedulerOutput

NUM_FEATURES = 4  # fixed, prefill, tokens, context tokens


@dataclass(frozen=True)
class StepShape:
    """What a step's time depends on: its tokens, its context, whether it runs a prompt chunk."""

    num_tokens: int = 0
    num_context_tokens: int = 0
    has_prefill: bool = False

    def features(self) -> tuple[float, ...]:
        """In the order of `StepCost`'s coefficients."""
        return (1.0, float(self.has_prefill), self.num_tokens, self.num_context_tokens)

    def plus_prefill(self, num_tokens: int, start: int = 0) -> StepShape:
        """This step with a prompt chunk of `num_tokens` after `start` computed tokens."""
        if num_tokens <= 0:
            return self
        context = self.num_context_tokens + start + num_tokens
        return StepShape(self.num_tokens + num_tokens, context, True)


def step_shape(output: SchedulerOutput) -> StepShape:
    """The shape of a scheduled step (draft slots run through the model too)."""
    sizes = [(c.start, c.num_new_tokens + c.num_draft_slots) for c in output.chunks]
    return StepShape(
        num_tokens=sum(n for _, n in sizes),
        num_context_tokens=sum(start + n for start, n in sizes),
        has_prefill=any(n > 1 for _, n in sizes),
    )


COEFFICIENT_NAMES = ("fixed_seconds", "prefill_seconds", "per_token_seconds",
                     "per_context_token_seconds")  # fmt: skip


# >>> exercise 4.4: the step-time model (predict a step, invert it, fit it online)
@dataclass(frozen=True)
class StepCost:
    """The model's coefficients, in seconds: per step, per prefill step, per token, per
    context token.

    You write `predict` (the model), `max_prefill_tokens` (the model inverted: the largest
    prompt chunk a time budget holds beside a step's decodes) and `break_even_chunk`; then
    `StepCostModel.observe` and `nonnegative_least_squares` below, which fit the four
    coefficients to the steps measured. With `LLM(target_tpot_ms=...)` the step-time
    scheduler sizes every prompt chunk with them; plug yours in with
    `CoursePlugins(step_cost_model_cls=StepCostModel)`.
    """

    fixed_s: float
    prefill_s: float = 0.0
    per_token_s: float = 0.0
    per_context_token_s: float = 0.0

    def predict(self, shape: StepShape) -> float:
        """Seconds a step of this shape takes: each coefficient times its feature
        (`shape.features()`, in the order of the fields), summed."""
        # >>> solution
        return sum(c * x for c, x in zip(astuple(self), shape.features()))
        # <<< solution

    def max_prefill_tokens(self, decodes: StepShape, seconds: float, start: int = 0) -> int:
        """The most prompt tokens a step of `decodes` may add (a chunk after `start` computed
        tokens) and still take at most `seconds`; 0 when not even one fits.

        The step with the chunk is `decodes.plus_prefill(n, start)`: each prompt token costs
        per_token_s and, as context, per_context_token_s; the chunk's context includes the
        `start` tokens before it; the prefill jump is paid unless `decodes` already runs a
        prompt chunk. Without a per-token cost any chunk fits: `sys.maxsize`. Rounded down,
        forgiving float dust of 1e-9 token (a budget that holds exactly n tokens gives n).
        """
        # >>> solution
        per_token = self.per_token_s + self.per_context_token_s
        jump = 0.0 if decodes.has_prefill else self.prefill_s
        left = seconds - self.predict(decodes) - jump - self.per_context_token_s * start
        if left < 0 or left < per_token:
            return 0
        return sys.maxsize if per_token == 0 else int(left / per_token + 1e-9)  # float dust
        # <<< solution

    @classmethod
    def from_metrics(cls, stats: dict[str, float]) -> StepCost | None:
        """The cost an engine reported in `get_metrics()` (`cost_metrics`); None if unfitted."""
        if not stats.get("step_cost_fitted"):
            return None
        return cls(*(stats[f"step_cost_{name}"] for name in COEFFICIENT_NAMES))

    def break_even_chunk(self) -> float:
        """Prompt tokens that cost what the prefill jump costs: a smaller chunk spends more on
        the jump than on the prompt (0.0 without a per-token cost)."""
        # >>> solution
        per_token = self.per_token_s + self.per_context_token_s
        return 0.0 if per_token == 0 else self.prefill_s / per_token
        # <<< solution


class StepCostModel:
    """A `StepCost` fitted online: `observe` each step's shape and seconds, read `current`.

    `current` is None until `min_steps` steps were seen (nothing to predict from), unless a
    `prior` is given. `StepCostModel.fixed(cost)` keeps `cost` whatever it observes (tests;
    a machine calibrated offline).
    """

    def __init__(
        self,
        decay: float = 0.99,
        min_steps: int = 8,
        prior: StepCost | None = None,
        learn: bool = True,
    ) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay, self.min_steps, self.learn = decay, min_steps, learn
        self.current: StepCost | None = prior
        self.num_steps = 0
        self._gram = np.zeros((NUM_FEATURES, NUM_FEATURES))  # sum of w * x x^T
        self._moment = np.zeros(NUM_FEATURES)  # sum of w * x * seconds

    @classmethod
    def fixed(cls, cost: StepCost) -> StepCostModel:
        return cls(prior=cost, learn=False)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One measured step; refits once `min_steps` were seen.

        The fit needs only two running sums over the steps, weighted (each new step
        multiplies the older ones' weights by `decay`): `_gram`, sum of w x x^T, and
        `_moment`, sum of w x seconds, x being `shape.features()`. Count the step in
        `num_steps`; from `min_steps` on, `current` is the `StepCost` of
        `nonnegative_least_squares(_gram, _moment)`.
        """
        if not self.learn:
            return
        # >>> solution
        x = np.array(shape.features())
        self._gram = self.decay * self._gram + np.outer(x, x)
        self._moment = self.decay * self._moment + seconds * x
        self.num_steps += 1
        if self.num_steps >= self.min_steps:
            self.current = StepCost(*nonnegative_least_squares(self._gram, self._moment))
        # <<< solution


def nonnegative_least_squares(gram: np.ndarray, moment: np.ndarray) -> list[float]:
    """argmin over c >= 0 of sum w (x.c - y)^2, given gram = sum w x x^T, moment = sum w x y.

    The minimum is the unconstrained fit on the features it leaves nonzero, so the best
    nonnegative fit among all subsets is the answer (the empty subset, all zeros, included).
    First the unconstrained fit (`np.linalg.lstsq(gram, moment, rcond=None)`): when no
    coefficient is negative, that is the answer. Else try every proper subset of the
    features: its fit, zeros elsewhere, skipped if any coefficient is negative; keep the
    one with the lowest loss `c @ gram @ c - 2 * c @ moment` (the squared error, less a
    constant: all zeros score 0).
    """
    # >>> solution
    unconstrained = np.linalg.lstsq(gram, moment, rcond=None)[0]
    if (unconstrained >= 0).all():  # the usual case: nothing to constrain
        return [float(c) for c in unconstrained]
    best, best_loss = np.zeros(len(moment)), 0.0
    for size in range(1, len(moment)):
        for subset in itertools.combinations(range(len(moment)), size):
            idx = list(subset)
            coef = np.linalg.lstsq(gram[np.ix_(idx, idx)], moment[idx], rcond=None)[0]
            if (coef < 0).any():
                continue
            full = np.zeros(len(moment))
            full[idx] = coef
            loss = full @ gram @ full - 2 * full @ moment  # the squared error, less a constant
            if loss < best_loss - 1e-15:
                best, best_loss = full, loss
    return [float(c) for c in best]
    # <<< solution


# <<< exercise


def cost_metrics(cost: StepCost | None) -> dict[str, float]:
    """The coefficients as metrics (`step_cost_fixed_seconds`, ...); all 0 until fitted."""
    values = astuple(cost) if cost is not None else (0.0,) * NUM_FEATURES
    named = {f"step_cost_{name}": value for name, value in zip(COEFFICIENT_NAMES, values)}
    return {"step_cost_fitted": float(cost is not None), **named}
