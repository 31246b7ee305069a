"""Chapter 04's checks of the step-time model (exercise 4.4); `checks_ch04` lists them after
the swap space's.

The oracles: the model's formula written out; a brute-force search over chunk sizes for its
inverse; numpy's least squares for a fit with nothing to constrain, and the optimality (KKT)
conditions of nonnegative least squares otherwise; running sums recomputed from the steps
with their decayed weights; and minserve's step budget (`step_budget.prefill_budget`) on the
true cost against the same rule on your fitted model. Coefficients are powers of two, so the
model's arithmetic is exact and a chunk that fits exactly is never lost to rounding.
"""

from __future__ import annotations

import math
import sys
from types import ModuleType
from typing import Any

import numpy as np

from minserve.scheduler.step_budget import StepBudget, prefill_budget
from minserve.scheduler.step_cost import StepShape

# fixed 7.8 ms, prefill jump 31 ms, 0.98 ms a token, 15 us a context token: exact in binary
FIXED, JUMP, PER_TOKEN, PER_CONTEXT = 2.0**-7, 2.0**-5, 2.0**-10, 2.0**-16
COEFFICIENTS = (FIXED, JUMP, PER_TOKEN, PER_CONTEXT)
FIELDS = ("fixed_s", "prefill_s", "per_token_s", "per_context_token_s")


def _seconds(coefficients: tuple[float, ...], shape: StepShape) -> float:
    """The model written out: fixed + jump if a chunk runs + per token + per context token."""
    fixed, jump, per_token, per_context = coefficients
    return (
        fixed
        + (jump if shape.has_prefill else 0.0)
        + per_token * shape.num_tokens
        + per_context * shape.num_context_tokens
    )


def _cost(impl: ModuleType, coefficients: tuple[float, ...] = COEFFICIENTS) -> Any:
    return impl.StepCost(*coefficients)


def _shape(shape: StepShape) -> str:
    prefill = ", a prompt chunk" if shape.has_prefill else ""
    return f"{shape.num_tokens} tokens, {shape.num_context_tokens} context{prefill}"


def _largest_chunk(coefficients: tuple[float, ...], decodes: StepShape, seconds: float,
                   start: int, limit: int = 20_000) -> int:  # fmt: skip
    """Brute force: the largest n >= 1 whose step fits `seconds`, else 0 (or `limit`)."""
    best = 0
    for n in range(1, limit + 1):
        if _seconds(coefficients, decodes.plus_prefill(n, start)) > seconds:
            break
        best = n
    return best


def _random_steps(coefficients: tuple[float, ...], count: int, seed: int) -> list[tuple]:
    """(shape, seconds) of `count` steps like a server's: decodes, some with a prompt chunk."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(count):
        decodes = int(rng.integers(1, 48))
        shape = StepShape(decodes, decodes * int(rng.integers(50, 800)))
        shape = shape.plus_prefill(int(rng.choice([0, 0, 16, 64, 256])), int(rng.integers(0, 512)))
        steps.append((shape, _seconds(coefficients, shape)))
    return steps


def _kkt_problems(coef: np.ndarray, gram: np.ndarray, moment: np.ndarray) -> str:
    """What breaks the optimality of nonnegative least squares ("" if nothing): every
    coefficient >= 0, a zero gradient where one is positive, a gradient >= 0 where it is 0."""
    gradient = gram @ coef - moment
    tolerance = 1e-7 * max(np.abs(moment).max(), 1e-30)
    problems = [f"coefficient {i} is {c:.3g} < 0" for i, c in enumerate(coef) if c < 0]
    problems += [
        f"coefficient {i} is {c:.3g} > 0 but the loss still falls along it (gradient "
        f"{g:.3g}): it is not the best value"
        for i, (c, g) in enumerate(zip(coef, gradient))
        if c > 0 and abs(g) > tolerance
    ]
    problems += [
        f"coefficient {i} is held at 0 but the loss falls as it grows (gradient {g:.3g} < 0)"
        for i, (c, g) in enumerate(zip(coef, gradient))
        if c == 0 and g < -tolerance
    ]
    return "; ".join(problems)


def _design(rng: np.random.Generator, rows: int) -> np.ndarray:
    """Feature rows like a server's steps: 1, chunk or not, tokens, context tokens."""
    return np.column_stack([
        np.ones(rows), rng.integers(0, 2, rows), rng.integers(1, 300, rows),
        rng.integers(1, 5000, rows),
    ]).astype(float)  # fmt: skip


def _fit(impl: ModuleType, gram: np.ndarray, moment: np.ndarray) -> np.ndarray:
    got = impl.nonnegative_least_squares(gram, moment)
    assert len(got) == 4, f"nonnegative_least_squares: expected 4 coefficients, got {got!r}"
    return np.array([float(c) for c in got])


# --- the model and its inverse ----------------------------------------------------------


def check_predict_is_the_linear_model(impl: ModuleType) -> None:
    """predict: fixed + the prefill jump if a chunk runs + per token + per context token."""
    cost = _cost(impl)
    shapes = [StepShape(), StepShape(8, 800), StepShape(40, 1200, True), StepShape(1, 5, False)]
    for shape in shapes:
        got, expected = cost.predict(shape), _seconds(COEFFICIENTS, shape)
        assert isinstance(got, float) and math.isclose(got, expected, rel_tol=1e-12), (
            f"StepCost{COEFFICIENTS}.predict(step of {_shape(shape)}): expected {expected!r} s "
            f"(fixed + jump if a chunk runs + per_token x tokens + per_context x context), "
            f"got {got!r}"
        )


def check_max_prefill_tokens_is_the_largest_chunk_that_fits(impl: ModuleType) -> None:
    """max_prefill_tokens: the largest chunk whose step fits the seconds, as a brute-force search
    finds it (the jump paid once, the chunk's context after `start`, an exact fit kept)."""
    cost = _cost(impl)
    decodes, chunked = StepShape(8, 800), StepShape(8, 800).plus_prefill(32, 64)
    exact = _seconds(COEFFICIENTS, decodes.plus_prefill(37, 100))  # holds 37 tokens exactly
    cases = [  # (decodes, seconds, start)
        (decodes, 0.25, 0), (decodes, 0.25, 512), (chunked, 0.25, 0), (decodes, exact, 100),
        (decodes, 0.05, 0), (decodes, 0.0, 0), (StepShape(), 0.5, 0), (chunked, 0.03, 96),
    ]  # fmt: skip
    rng = np.random.default_rng(4)
    for _ in range(24):  # random dyadic steps and budgets
        shape = StepShape(int(rng.integers(0, 40)), int(rng.integers(0, 4000)))
        shape = shape.plus_prefill(int(rng.choice([0, 0, 8, 64])), int(rng.integers(0, 256)))
        cases.append((shape, int(rng.integers(0, 2**10)) * 2.0**-10, int(rng.integers(0, 300))))
    for shape, seconds, start in cases:
        got = cost.max_prefill_tokens(shape, seconds, start)
        expected = _largest_chunk(COEFFICIENTS, shape, seconds, start)
        assert got == expected, (
            f"StepCost{COEFFICIENTS}.max_prefill_tokens(step of {_shape(shape)}, "
            f"seconds={seconds!r}, start={start}): expected {expected} (the largest chunk n whose "
            f"step, decodes.plus_prefill(n, start), takes at most the seconds), got {got!r}"
        )
    free = _cost(impl, (FIXED, JUMP, 0.0, 0.0))  # tokens cost nothing: any chunk fits
    got = (free.max_prefill_tokens(decodes, 1.0), free.max_prefill_tokens(decodes, 0.01))
    assert got == (sys.maxsize, 0), (
        f"StepCost(fixed_s={FIXED}, prefill_s={JUMP}) (no per-token cost): max_prefill_tokens "
        f"with 1.0 s and with 0.01 s (less than fixed + jump): expected (sys.maxsize, 0), "
        f"got {got}"
    )


def check_break_even_chunk_is_the_jump_in_tokens(impl: ModuleType) -> None:
    """break_even_chunk: the prefill jump over a prompt token's cost (0.0 if tokens are free)."""
    cases = [
        (COEFFICIENTS, JUMP / (PER_TOKEN + PER_CONTEXT)),
        ((FIXED, JUMP, PER_TOKEN, 0.0), 32.0),
        ((FIXED, 0.0, PER_TOKEN, PER_CONTEXT), 0.0),
        ((FIXED, JUMP, 0.0, 0.0), 0.0),
    ]
    for coefficients, expected in cases:
        got = _cost(impl, coefficients).break_even_chunk()
        assert math.isclose(got, expected, rel_tol=1e-12), (
            f"StepCost{coefficients}.break_even_chunk(): expected {expected!r} (prefill_s / "
            f"(per_token_s + per_context_token_s), 0.0 if that is 0), got {got!r}"
        )


# --- the fit ------------------------------------------------------------------------------


def check_an_unconstrained_fit_is_least_squares(impl: ModuleType) -> None:
    """Steps from a nonnegative cost plus noise: the fit is numpy's least squares, unchanged."""
    rng = np.random.default_rng(7)
    x = _design(rng, 80)
    y = x @ np.array([0.04, 0.03, 0.0012, 2e-6]) * (1 + 0.01 * rng.standard_normal(80))
    expected = np.linalg.lstsq(x, y, rcond=None)[0]
    assert (expected > 0).all()  # nothing to constrain in this data
    got = _fit(impl, x.T @ x, x.T @ y)
    assert np.allclose(got, expected, rtol=1e-6, atol=0), (
        f"nonnegative_least_squares of 80 steps whose least-squares fit is nonnegative: "
        f"expected numpy's fit {expected.tolist()}, got {got.tolist()}"
    )


def check_a_constrained_fit_is_the_best_nonnegative_one(impl: ModuleType) -> None:
    """Times that fall as tokens grow: the best fit with every coefficient >= 0 (KKT)."""
    rng = np.random.default_rng(3)
    x = _design(rng, 60)
    falling = 0.2 - 0.0004 * x[:, 2] + 1e-5 * x[:, 3] + 0.01 * rng.standard_normal(60)
    negative = -0.1 - 0.001 * x[:, 2]  # every coefficient wants to be < 0: all zeros
    jumpless = 0.05 - 0.02 * x[:, 1] + 0.001 * x[:, 2]  # a negative jump: it is held at 0
    for name, y in [("falling per-token times", falling), ("negative times", negative),
                    ("a chunk that saves time", jumpless)]:  # fmt: skip
        assert (np.linalg.lstsq(x, y, rcond=None)[0] < 0).any()  # unconstrained, it would be
        gram, moment = x.T @ x, x.T @ y
        got = _fit(impl, gram, moment)
        problems = _kkt_problems(got, gram, moment)
        assert not problems, (
            f"nonnegative_least_squares of 60 steps with {name} (their least-squares fit has a "
            f"negative coefficient): got {got.tolist()}, not the best nonnegative fit: {problems}"
        )


def check_observe_fits_the_decayed_steps(impl: ModuleType) -> None:
    """observe: nothing until min_steps, then the nonnegative fit of the steps weighted by decay."""
    model = impl.StepCostModel(decay=0.7, min_steps=6)
    slow = (2 * FIXED, JUMP, 2 * PER_TOKEN, PER_CONTEXT)  # the machine got slower half way
    steps = _random_steps(COEFFICIENTS, 12, seed=1) + _random_steps(slow, 12, seed=2)
    for count, (shape, seconds) in enumerate(steps, start=1):
        model.observe(shape, seconds)
        if count < 6:
            assert model.current is None, (
                f"StepCostModel(min_steps=6) after {count} steps: expected current None (too "
                f"few steps to fit), got {model.current!r}"
            )
            continue
        assert model.num_steps == count and isinstance(model.current, impl.StepCost), (
            f"StepCostModel(min_steps=6) after {count} steps: expected num_steps {count} and a "
            f"StepCost in current, got {model.num_steps} and {model.current!r}"
        )
        weights = 0.7 ** np.arange(count - 1, -1, -1)  # the newest step weighs 1
        x = np.array([s.features() for s, _ in steps[:count]])
        y = np.array([t for _, t in steps[:count]])
        gram, moment = (x.T * weights) @ x, (x.T * weights) @ y
        got = np.array([getattr(model.current, f) for f in FIELDS])
        problems = _kkt_problems(got, gram, moment)
        assert not problems, (
            f"StepCostModel(decay=0.7, min_steps=6) after {count} steps: current "
            f"{got.tolist()} is not the nonnegative fit of the steps weighted 0.7 ** age "
            f"(the newest 1): {problems}"
        )


def check_minserve_s_step_budget_runs_on_your_fitted_model(impl: ModuleType) -> None:
    """minserve's step budget on your fitted model gives the prompt tokens of the true cost."""
    model = impl.StepCostModel(decay=1.0)
    for shape, seconds in _random_steps(COEFFICIENTS, 40, seed=5):
        model.observe(shape, seconds)
    true = _cost(impl)  # your StepCost class, with the true coefficients
    budget = StepBudget(target_s=0.125, max_num_batched_tokens=2048, min_chunk=8)
    rng = np.random.default_rng(6)
    compared = 0
    for _ in range(40):
        decodes = StepShape(int(rng.integers(1, 24)), int(rng.integers(24, 3000)))
        banked = float(rng.choice([0.0, 0.05, 0.25, -0.05]))
        demand = int(rng.choice([20, 200, 5000]))
        left = 0.125 - _seconds(COEFFICIENTS, decodes) - JUMP  # what a chunk may take
        tokens = [(left + extra) / (PER_TOKEN + PER_CONTEXT) for extra in (banked, budget.carry_s)]
        if any(abs(t % 1 - 0.5) > 0.4 for t in tokens):
            continue  # a chunk that fits almost exactly: the fit's rounding could tip it
        expected = prefill_budget(true, budget, decodes, banked, demand)
        got = prefill_budget(model.current, budget, decodes, banked, demand)
        assert got == expected, (
            f"40 steps of StepCost{COEFFICIENTS} observed; minserve's prefill_budget beside "
            f"decodes of {_shape(decodes)}, {banked} s banked, {demand} prompt tokens waiting: "
            f"expected {expected} prompt tokens (as with the true cost), got {got} with your "
            f"fitted {model.current!r}"
        )
        compared += 1
    assert compared >= 10  # the check's own guard: enough steps were compared


STEP_COST_CHECKS = [
    check_predict_is_the_linear_model,
    check_max_prefill_tokens_is_the_largest_chunk_that_fits,
    check_break_even_chunk_is_the_jump_in_tokens,
    check_an_unconstrained_fit_is_least_squares,
    check_a_constrained_fit_is_the_best_nonnegative_one,
    check_observe_fits_the_decayed_steps,
    check_minserve_s_step_budget_runs_on_your_fitted_model,
]
