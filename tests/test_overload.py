"""Under overload the server degrades gracefully: decodes keep a step-time target while
prompts queue, and requests that would miss their targets are refused at arrival (503).

Oracles: the coefficients synthetic steps were drawn from; the KKT conditions of a
nonnegative least-squares fit; arithmetic on fixed cost models (a step of D decodes and P
prompt tokens costs fixed + per_token * (D + P)); `LLM.generate` without a target, token for
token; the bench client's records of a 503.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from minserve import LLM, CoursePlugins, SamplingParams
from minserve.bench.serve_client import Endpoint, send
from minserve.bench.serve_metrics import parse_goodput, summarize
from minserve.config import SchedulerConfig
from minserve.course import checks_ch04_step_cost as step_checks
from minserve.engine import observe_steps
from minserve.scheduler.scheduler import Scheduler
from minserve.scheduler.step_budget import StepBudget, prefill_budget
from minserve.scheduler.step_cost import (
    StepCost,
    StepCostModel,
    StepShape,
    cost_metrics,
    nonnegative_least_squares,
    step_shape,
)
from minserve.scheduler.step_time import StepTimeScheduler, scheduler_class
from minserve.server.admission import (
    Admission,
    AdmissionConfig,
    RequestRefusedError,
    Work,
    check_admission,
)
from minserve.server.app import Server, create_app
from minserve.server.async_engine import AsyncEngine
from minserve.server.background import BackgroundServer
from minserve.server.cli import add_serve_parser
from minserve.server.metrics import ServerMetrics
from minserve.server.serving import ServerConfig

MODEL = "tiny-llama"
# 2 ms a step plus 1 ms a token: a 12 ms target holds 10 tokens, decodes and prompt together
LINEAR = StepCost(fixed_s=0.002, per_token_s=0.001)


# --- the step cost model ------------------------------------------------------------------


def synthetic_steps(cost: StepCost, count: int, noise: float, seed: int = 0):
    """(shape, seconds) of `count` steps like a server's: decodes, some with a prompt chunk."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        decodes = int(rng.integers(1, 48))
        shape = StepShape(decodes, decodes * int(rng.integers(50, 800)))
        shape = shape.plus_prefill(int(rng.choice([0, 0, 16, 64, 256])), int(rng.integers(0, 512)))
        yield shape, cost.predict(shape) * (1 + noise * rng.standard_normal())


def test_the_cost_model_recovers_its_coefficients_from_synthetic_steps() -> None:
    true = StepCost(fixed_s=0.040, prefill_s=0.030, per_token_s=0.0012, per_context_token_s=2e-6)
    model = StepCostModel(decay=1.0)
    for shape, seconds in synthetic_steps(true, 300, noise=0.01):
        model.observe(shape, seconds)
    fitted = model.current
    for name in ("fixed_s", "prefill_s", "per_token_s", "per_context_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=0.05), name


def test_a_decaying_fit_follows_a_machine_that_got_slower() -> None:
    model = StepCostModel(decay=0.95)
    for shape, seconds in synthetic_steps(LINEAR, 200, noise=0.0):
        model.observe(shape, seconds)
    slower = StepCost(fixed_s=0.004, per_token_s=0.002)
    for shape, seconds in synthetic_steps(slower, 300, noise=0.0, seed=1):
        model.observe(shape, seconds)
    assert model.current.per_token_s == pytest.approx(0.002, rel=1e-3)
    assert model.current.fixed_s == pytest.approx(0.004, rel=1e-2)


def test_the_fit_keeps_every_coefficient_nonnegative_and_optimal() -> None:
    """Times that fall as tokens grow would fit a negative per-token cost: the fit is the
    best one with every coefficient >= 0 (KKT: zero gradient where a coefficient is
    positive, a gradient >= 0 where it is held at 0)."""
    rng = np.random.default_rng(3)
    x = np.column_stack([np.ones(60), rng.integers(0, 2, 60), rng.integers(1, 300, 60),
                         rng.integers(1, 5000, 60)]).astype(float)  # fmt: skip
    y = 0.2 - 0.0004 * x[:, 2] + 1e-5 * x[:, 3] + 0.01 * rng.standard_normal(60)
    gram, moment = x.T @ x, x.T @ y
    assert (np.linalg.lstsq(x, y, rcond=None)[0] < 0).any()  # unconstrained, it would be
    coef = np.array(nonnegative_least_squares(gram, moment))
    gradient = gram @ coef - moment
    assert (coef >= 0).all()
    scale = np.abs(moment).max()
    assert np.allclose(gradient[coef > 0], 0, atol=1e-9 * scale)
    assert (gradient[coef == 0] >= -1e-9 * scale).all()


def test_the_model_predicts_nothing_until_it_has_seen_enough_steps() -> None:
    model = StepCostModel(min_steps=8)
    steps = list(synthetic_steps(LINEAR, 8, noise=0.0))
    for shape, seconds in steps[:7]:
        model.observe(shape, seconds)
    assert model.current is None
    model.observe(*steps[7])
    assert model.current is not None


def test_a_fixed_model_ignores_what_it_observes() -> None:
    model = StepCostModel.fixed(LINEAR)
    for shape, seconds in synthetic_steps(StepCost(1.0, 1.0, 1.0, 1.0), 20, noise=0.0):
        model.observe(shape, seconds)
    assert model.current == LINEAR


def test_the_cost_travels_through_the_metrics_unchanged() -> None:
    cost = StepCost(0.01, 0.02, 0.003, 4e-6)
    assert StepCost.from_metrics(cost_metrics(cost)) == cost
    assert StepCost.from_metrics(cost_metrics(None)) is None


# --- exercise 4.4's checks catch the usual wrong models ------------------------------------


@dataclass(frozen=True)
class _JumpEveryTime(StepCost):
    def max_prefill_tokens(self, decodes: StepShape, seconds: float, start: int = 0) -> int:
        left = seconds - self.predict(decodes) - self.prefill_s - self.per_context_token_s * start
        return max(0, int(left / (self.per_token_s + self.per_context_token_s)))  # twice


@dataclass(frozen=True)
class _ContextForgotten(StepCost):
    def max_prefill_tokens(self, decodes: StepShape, seconds: float, start: int = 0) -> int:
        return super().max_prefill_tokens(decodes, seconds, 0)  # the `start` tokens' context


@dataclass(frozen=True)
class _TokenOnlyBreakEven(StepCost):
    def break_even_chunk(self) -> float:
        return 0.0 if self.per_token_s == 0 else self.prefill_s / self.per_token_s


def _clamped_least_squares(gram: np.ndarray, moment: np.ndarray) -> list[float]:
    return np.maximum(np.linalg.lstsq(gram, moment, rcond=None)[0], 0).tolist()


class _NoDecay(StepCostModel):
    def observe(self, shape: StepShape, seconds: float) -> None:
        self.decay = 1.0  # every step weighs the same, however old
        super().observe(shape, seconds)


class _FitsAtOnce(StepCostModel):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.min_steps = 1  # a fit from the first step


def _student(**parts) -> SimpleNamespace:
    reference = dict(StepCost=StepCost, StepCostModel=StepCostModel,
                     nonnegative_least_squares=nonnegative_least_squares)  # fmt: skip
    return SimpleNamespace(**{**reference, **parts})


_FITS = step_checks.check_max_prefill_tokens_is_the_largest_chunk_that_fits
_KKT = step_checks.check_a_constrained_fit_is_the_best_nonnegative_one
_OBSERVE = step_checks.check_observe_fits_the_decayed_steps


@pytest.mark.parametrize(
    ("parts", "check", "message"),
    [
        (dict(StepCost=_JumpEveryTime), _FITS,
         r"40 tokens, 896 context, a prompt chunk, seconds=0.25, start=0\): expected 159 .* "
         r"got 128"),
        (dict(StepCost=_ContextForgotten), _FITS,
         r"step of 8 tokens, 800 context, seconds=0.25, start=512\): expected 184 .* got 192"),
        (dict(StepCost=_TokenOnlyBreakEven),
         step_checks.check_break_even_chunk_is_the_jump_in_tokens,
         r"break_even_chunk\(\): expected 31.50.* got 32.0"),
        (dict(nonnegative_least_squares=_clamped_least_squares), _KKT,
         r"with falling per-token times .* not the best nonnegative fit: coefficient \d is .* > 0"),
        (dict(StepCostModel=_NoDecay), _OBSERVE,
         r"after 13 steps: current .* is not the nonnegative fit of the steps weighted 0.7 \*\* "),
        (dict(StepCostModel=_FitsAtOnce), _OBSERVE,
         r"StepCostModel\(min_steps=6\) after 1 steps: expected current None"),
    ],
    ids=["jump-every-time", "context-forgotten", "token-only-break-even", "clamped-fit",
         "no-decay", "fits-at-once"],
)  # fmt: skip
def test_the_step_cost_checks_catch_a_wrong_model(parts, check, message) -> None:
    with pytest.raises(AssertionError, match=message):
        check(_student(**parts))


def test_the_step_cost_checks_pass_minserve_s_model() -> None:
    for check in step_checks.STEP_COST_CHECKS:
        check(_student())


# --- the budget rule ----------------------------------------------------------------------

STRICT = StepBudget(target_s=0.012, max_num_batched_tokens=2048, min_chunk=4, carry_steps=0)
# 20 ms a step, 30 ms more with a prompt chunk, 1 ms a token
JUMPY = StepCost(fixed_s=0.020, prefill_s=0.030, per_token_s=0.001)


@pytest.mark.parametrize(("decodes", "prefill"), [(1, 9), (3, 7), (6, 4)])
def test_the_budget_caps_prefill_so_the_predicted_step_stays_under_the_target(
    decodes, prefill
) -> None:
    shape = StepShape(decodes, decodes * 100)
    assert prefill_budget(LINEAR, STRICT, shape, banked_s=0.0) == prefill  # 2 + D + P <= 12 ms
    assert LINEAR.predict(shape.plus_prefill(prefill)) <= STRICT.target_s + 1e-12
    assert LINEAR.predict(shape.plus_prefill(prefill + 1)) > STRICT.target_s


def test_prompts_still_get_the_minimum_chunk_when_the_target_is_out_of_reach() -> None:
    assert prefill_budget(LINEAR, STRICT, StepShape(9, 900), banked_s=0.0) == 4  # 2 + 9 + 4
    assert prefill_budget(LINEAR, STRICT, StepShape(30, 3000), banked_s=0.0) == 4  # decodes: 32


def test_a_step_without_decodes_is_not_capped() -> None:
    assert prefill_budget(LINEAR, STRICT, StepShape(), banked_s=0.0) == 2048


def test_the_bank_keeps_the_mean_step_at_the_target_while_prompts_progress() -> None:
    """A prompt chunk costs a 30 ms jump on top of its tokens, so none fits a 50 ms step
    beside 10 decodes (30 ms): decode-only steps bank 20 ms each until a chunk worth 4 jumps
    (120 tokens) fits, 7 steps later: 130 tokens in 190 ms, every 8th step."""
    budget = StepBudget(target_s=0.050, max_num_batched_tokens=2048, min_chunk=16)
    decodes, bank, times, chunks = StepShape(10, 1000), 0.0, [], []
    for _ in range(400):  # a queue of prompts that never empties
        prefill = prefill_budget(JUMPY, budget, decodes, bank, demand=100_000)
        seconds = JUMPY.predict(decodes.plus_prefill(prefill))
        bank = budget.banked_after(bank, seconds)
        times.append(seconds)
        chunks += [prefill] if prefill else []
    assert np.mean(times) <= budget.target_s + budget.carry_s / len(times)
    assert chunks == [130] * 50 and max(times) == pytest.approx(0.190)


def test_a_short_prompt_runs_whole_once_the_bank_holds_it() -> None:
    budget = StepBudget(target_s=0.050, max_num_batched_tokens=2048, min_chunk=16)
    decodes = StepShape(10, 1000)  # 40 tokens beside them: 100 ms, a 50 ms bank
    assert prefill_budget(JUMPY, budget, decodes, banked_s=0.049, demand=40) == 0
    assert prefill_budget(JUMPY, budget, decodes, banked_s=0.050, demand=40) == 40
    # a bank of one target holds 40 tokens at most, less than 4 jumps' worth: those run
    tight = StepBudget(target_s=0.050, max_num_batched_tokens=2048, carry_steps=1)
    assert prefill_budget(JUMPY, tight, decodes, banked_s=0.049, demand=1000) == 0
    assert prefill_budget(JUMPY, tight, decodes, banked_s=0.050, demand=1000) == 40


# --- the scheduler ------------------------------------------------------------------------


def test_targets_choose_the_step_time_scheduler_and_refuse_one_that_cannot_keep_them() -> None:
    targets = SchedulerConfig(target_tpot_ms=100.0, target_ttft_ms=1000.0)
    assert scheduler_class(SchedulerConfig(), Scheduler) is Scheduler
    assert scheduler_class(targets, Scheduler) is StepTimeScheduler
    assert scheduler_class(SchedulerConfig(target_ttft_ms=500.0), Scheduler) is StepTimeScheduler

    class Mine(Scheduler):
        pass

    with pytest.raises(ValueError, match="Mine does not keep them"):
        scheduler_class(targets, Mine)


@pytest.mark.parametrize(
    ("options", "message"),
    [({"target_tpot_ms": -1.0}, "target_tpot_ms must be"),
     ({"target_ttft_ms": math.nan}, "target_ttft_ms must be"),
     ({"target_tpot_ms": 50.0, "enable_chunked_prefill": False}, "enable_chunked_prefill")],
)  # fmt: skip
def test_a_bad_target_is_refused_naming_it(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**options)


def test_the_server_turns_both_targets_on_by_default_and_0_turns_them_off() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert (args.target_tpot_ms, args.target_ttft_ms) == (80.0, 800.0)
    args = parser.parse_args(["serve", "--target-tpot-ms", "0", "--target-ttft-ms", "0"])
    assert (args.target_tpot_ms, args.target_ttft_ms) == (0.0, 0.0)


def test_off_by_default_and_0_is_off() -> None:
    assert StepBudget.from_config(SchedulerConfig()) is None
    assert StepBudget.from_config(SchedulerConfig(target_tpot_ms=0.0)) is None
    assert AdmissionConfig.from_config(SchedulerConfig(target_ttft_ms=0.0)) is None
    assert AdmissionConfig.from_config(SchedulerConfig(target_ttft_ms=800.0)) == AdmissionConfig(
        target_ttft_s=0.8
    )


@pytest.fixture(scope="module")
def oracle(tiny_model) -> LLM:
    """The engine without targets: what every schedule must generate."""
    return LLM(tiny_model("llama"), num_blocks=256, block_size=4, max_num_seqs=4)


def capped_llm(oracle: LLM, cost: StepCost, budget: StepBudget | None, **options) -> LLM:
    scheduler = partial(StepTimeScheduler, step_cost=StepCostModel.fixed(cost), budget=budget)
    return LLM(oracle.loaded, num_blocks=256, block_size=4,
               plugins=CoursePlugins(scheduler_cls=scheduler), **options)  # fmt: skip


def test_capped_steps_keep_the_target_and_greedy_tokens_match_the_unconstrained_engine(
    oracle,
) -> None:
    """Four seats, six prompts of 30-60 tokens, outputs of 4 to 20 tokens: a prompt that gets
    a seat while others decode is prefilled in chunks that keep 2 ms + 1 ms a token under
    12 ms (10 tokens a step, decodes included)."""
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, n).tolist()}
               for n in (30, 45, 60, 38, 52, 41)]  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (4, 20, 12, 16, 8, 20)]  # fmt: skip
    llm = capped_llm(oracle, LINEAR, STRICT, max_num_seqs=4)
    with observe_steps(llm.engine) as records:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = oracle.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    beside_decodes = [r.scheduler_output for r in records
                      if any(c.is_decode for c in r.scheduler_output.chunks)]  # fmt: skip
    assert all(out.num_batched_tokens <= 10 for out in beside_decodes)
    assert all(LINEAR.predict(step_shape(out)) <= STRICT.target_s + 1e-12 for out in beside_decodes)
    mixed = [out for out in beside_decodes if any(not c.is_decode for c in out.chunks)]
    assert len(mixed) >= 10  # the two late prompts ran in chunks beside the decodes
    # every mixed step left prompt tokens waiting but each late prompt's last one
    assert llm.get_metrics()["num_steps_capped"] == len(mixed) - 2


def test_before_its_cost_model_is_fitted_a_step_runs_the_minimum_chunk_beside_decodes(
    oracle,
) -> None:
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (30, 45, 60, 38)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 9, 6, 8)]
    scheduler = partial(StepTimeScheduler, step_cost=StepCostModel(min_steps=10**6), budget=STRICT)
    llm = LLM(oracle.loaded, num_blocks=256, block_size=4, max_num_seqs=2,
              plugins=CoursePlugins(scheduler_cls=scheduler))  # fmt: skip
    with observe_steps(llm.engine) as records:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = oracle.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    prompt_tokens_beside_decodes = [
        sum(c.num_new_tokens for c in r.scheduler_output.chunks if not c.is_decode)
        for r in records
        if any(c.is_decode for c in r.scheduler_output.chunks)
    ]
    assert max(prompt_tokens_beside_decodes) == STRICT.min_chunk


def test_the_solutions_step_cost_model_is_the_one_the_step_time_scheduler_fits(oracle) -> None:
    """Exercise 4.4 plugged in: the scheduler fits the solution's model on the measured steps,
    sizes the prompt chunks with it, and the greedy tokens are the unconstrained engine's."""
    import solutions.ch04_chunked_prefill as student

    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (30, 45, 60, 38)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 9, 6, 8)]
    llm = LLM(oracle.loaded, num_blocks=256, block_size=4, max_num_seqs=2, target_tpot_ms=50.0,
              plugins=CoursePlugins(step_cost_model_cls=student.StepCostModel))  # fmt: skip
    model = llm.engine.scheduler.step_cost
    assert isinstance(model, student.StepCostModel)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = oracle.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert isinstance(model.current, student.StepCost) and model.num_steps >= model.min_steps
    assert llm.get_metrics()["step_cost_fitted"] == 1.0


def test_without_a_tpot_target_the_step_time_scheduler_schedules_as_before(oracle) -> None:
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (30, 45, 60, 38, 52)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 9, 6, 3, 5)]
    plain = LLM(oracle.loaded, num_blocks=256, block_size=4, max_num_seqs=2)
    measuring = capped_llm(oracle, LINEAR, None, max_num_seqs=2)
    batches = []
    for llm in (plain, measuring):
        with observe_steps(llm.engine) as records:
            llm.generate(prompts, params, use_tqdm=False)
        batches.append([[(c.request_id[-1], c.num_new_tokens) for c in r.scheduler_output.chunks]
                        for r in records])  # fmt: skip
    assert batches[0] == batches[1]
    assert measuring.get_metrics()["num_steps_capped"] == 0


# --- admission ----------------------------------------------------------------------------

BOTH = AdmissionConfig(target_ttft_s=1.0, target_tpot_s=0.1)
QUEUED = Work(num_seqs=4, num_context_tokens=4 * 192, num_prefill_tokens=900)
ARRIVING = Work(num_seqs=1, num_context_tokens=192, num_prefill_tokens=128)


def test_admission_refuses_a_request_predicted_to_start_after_the_ttft_target() -> None:
    refusal = check_admission(BOTH, QUEUED, ARRIVING, None, prefill_tokens_per_s=1000.0)
    assert isinstance(refusal, RequestRefusedError)  # (900 + 128) / 1000 = 1.028 s
    assert refusal.reason == "ttft" and refusal.retry_after_s == 1
    assert "1.03 s" in str(refusal) and "900 prompt tokens" in str(refusal)
    slow = check_admission(BOTH, QUEUED, ARRIVING, None, prefill_tokens_per_s=250.0)
    assert slow.retry_after_s == 4  # (1028 / 250 = 4.112 s) - 1 s, rounded up


def test_admission_admits_a_request_predicted_to_start_in_time() -> None:
    queued = Work(4, 4 * 192, 800)  # (800 + 128) / 1000 = 0.928 s
    assert check_admission(BOTH, queued, ARRIVING, None, prefill_tokens_per_s=1000.0) is None


def test_admission_refuses_a_decode_that_would_slow_the_running_ones() -> None:
    cost = StepCost(fixed_s=0.010, per_token_s=0.002)  # 45 decodes: 100 ms
    running = Work(num_seqs=44, num_context_tokens=44 * 200)
    assert check_admission(BOTH, running, ARRIVING, cost, 0.0) is None
    refusal = check_admission(BOTH, running + Work(1, 200), ARRIVING, cost, 0.0)
    assert refusal.reason == "tpot" and "46 sequences" in str(refusal)
    assert "102 ms" in str(refusal)


def test_an_idle_server_admits_anything_and_an_unmeasured_one_admits() -> None:
    huge = Work(num_seqs=16, num_context_tokens=16 * 4000, num_prefill_tokens=4000)
    assert check_admission(BOTH, Work(), huge, LINEAR, prefill_tokens_per_s=1.0) is None
    assert check_admission(BOTH, QUEUED, huge, None, prefill_tokens_per_s=0.0) is None


def test_a_prefilled_request_no_longer_stands_in_front_and_a_released_one_is_gone() -> None:
    admission = Admission(AdmissionConfig(target_ttft_s=1.0))
    stats = {"prefill_tokens_per_second": 1000.0, **cost_metrics(None)}
    admission.admit({"a": Work(1, 1000, 900)}, stats)
    with pytest.raises(RequestRefusedError, match="900 prompt tokens"):
        admission.admit({"b": ARRIVING}, stats)
    admission.prefilled("a")  # its first token came: the queue in front is empty
    admission.admit({"b": ARRIVING}, stats)
    admission.admit({"c": Work(1, 1000, 800)}, stats)  # (128 + 800) / 1000 s
    with pytest.raises(RequestRefusedError):
        admission.admit({"d": ARRIVING}, stats)
    admission.release("c")
    admission.admit({"d": ARRIVING}, stats)


# --- over HTTP ----------------------------------------------------------------------------


class SlowForward:
    """Wraps `runner.sampled_hidden`: every step takes at least `delay_s` (a long request
    stays in flight while the test sends another)."""

    def __init__(self, forward, delay_s: float) -> None:
        self.forward, self.delay_s = forward, delay_s

    def __call__(self, inputs):
        time.sleep(self.delay_s)
        return self.forward(inputs)


@pytest.fixture
def one_seat_of_tpot(oracle, monkeypatch) -> Iterator[BackgroundServer]:
    """A server whose decodes cost 60 ms each (a fixed model) against a 100 ms TPOT target:
    one request decodes, a second one would make the step 120 ms and is refused."""
    llm = capped_llm(oracle, StepCost(fixed_s=0.0, per_token_s=0.060), None)
    runner = llm.engine.worker.runner
    monkeypatch.setattr(runner, "sampled_hidden", SlowForward(runner.sampled_hidden, 0.005))
    loop = AsyncEngine(llm.engine, ServerMetrics(), admission=AdmissionConfig(target_tpot_s=0.1))
    config = ServerConfig(MODEL)
    background = BackgroundServer(Server(create_app(loop, config), loop, config))
    background.start()
    yield background
    background.stop()


def expected_text(oracle: LLM, prompt: str, max_tokens: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return oracle.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def test_an_overloaded_server_answers_503_with_retry_after_and_keeps_serving(
    one_seat_of_tpot, oracle
) -> None:
    url = one_seat_of_tpot.url
    body = {"model": MODEL, "temperature": 0, "ignore_eos": True}
    long = {**body, "prompt": "The capital of France is", "max_tokens": 200, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=long) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            refused = client.post("/v1/completions", json={**body, "prompt": "Hi", "max_tokens": 4})
            rest = [line for line in lines if line.startswith("data:")]
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("overloaded_error", "server_overloaded")
        assert "2 sequences would decode in steps of about 120 ms" in error["message"]
        chunks = [json.loads(line[len("data:") :]) for line in [first, *rest][:-1]]  # [DONE] last
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == expected_text(oracle, "The capital of France is", 200)
        after = client.post("/v1/completions", json={**body, "prompt": "Hi", "max_tokens": 4})
        assert after.status_code == 200
        assert after.json()["choices"][0]["text"] == expected_text(oracle, "Hi", 4)
        metrics = client.get("/metrics").text
    assert 'minserve:request_refused_total{reason="tpot"} 1.0' in metrics
    assert "minserve:step_cost_per_token_seconds 0.06" in metrics


def test_the_bench_client_counts_a_503_as_a_request_that_met_no_slo() -> None:
    refusal = {"error": {"message": "server is overloaded", "type": "overloaded_error",
                         "param": None, "code": "server_overloaded"}}  # fmt: skip
    answer = httpx.Response(503, json=refusal, headers={"Retry-After": "2"})
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda _: answer))
    record, text = asyncio.run(send(client, Endpoint("http://t", "m"), {"prompt": [1, 2]}))
    assert (record.success, record.status, text) == (False, 503, "")
    assert record.error.startswith("HTTP 503") and "overloaded" in record.error
    summary = summarize([record], duration_s=1.0, slos=parse_goodput(["ttft:1000"]))
    assert (summary["completed"], summary["failed"], summary["refused"]) == (0, 1, 1)
    assert summary["request_goodput"] == 0.0


def test_concurrent_admissions_never_hold_more_than_the_targets_allow() -> None:
    """Handlers admit from many threads at once: the check and the hold happen together."""
    admission = Admission(AdmissionConfig(target_tpot_s=0.1))
    stats = cost_metrics(StepCost(fixed_s=0.0, per_token_s=0.011))  # 9 decodes: 99 ms
    admitted: list[str] = []

    def arrive(i: int) -> None:
        try:
            admission.admit({f"r{i}": Work(1, 100)}, stats)
            admitted.append(f"r{i}")
        except RequestRefusedError:
            pass

    threads = [threading.Thread(target=arrive, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 9
