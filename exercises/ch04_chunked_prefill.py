# Your workspace for chapter 04 (Chunked prefill and preemption): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 04` from the repository root.
# Generated from minserve/scheduler/budget.py, minserve/scheduler/preemption.py, minserve/kvcache/swap.py, minserve/scheduler/step_cost.py by `python -m minserve.course.generate`.
# stub fingerprint: e64ac1eea67e (lets the generator tell your edits from a stale stub)
"""Chapter 04, Chunked prefill and preemption: the scheduler's two decisions
when time or memory runs short, the swap space a preempted sequence goes to,
and the model of step time that sizes prompt chunks for a latency target.

`prefill_chunk`: how many tokens a sequence computes out of what is left of the
step's token budget (Sarathi-Serve's chunked prefill). `preemption_mode`:
whether a preempted sequence's blocks go to the host swap space or are freed and
recomputed (vLLM). `HostSwapSpace`: the account of the host memory swapped-out
blocks wait in. Plug yours into the engine with
`LLM(swap_space=0.05, plugins=CoursePlugins(chunk_rule=prefill_chunk,
preemption_rule=preemption_mode, swap_space_cls=HostSwapSpace))`.
`StepCost` and `StepCostModel`: a step's time predicted, inverted into the largest
prompt chunk a time budget holds, and fitted online to the steps measured; plug
them in with `LLM(target_tpot_ms=..., plugins=CoursePlugins(
step_cost_model_cls=StepCostModel))`.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import astuple, dataclass

import numpy as np

from minserve.config import CacheConfig
from minserve.kvcache.swap import GIB
from minserve.kvcache.swap import SwapSpaceFullError  # noqa: F401
from minserve.messages import DropSwapped, SwapIn, SwapOut
from minserve.scheduler.preemption import PreemptionMode
from minserve.scheduler.step_cost import COEFFICIENT_NAMES, NUM_FEATURES, StepShape


# Exercise 4.1: a sequence's share of the token budget
def prefill_chunk(num_needed: int, budget_left: int, enable_chunked_prefill: bool) -> int:
    """How many tokens a sequence computes this step, out of `budget_left`.

    `num_needed` is what it still has to compute (1 for a decode, the uncomputed rest
    of the prompt for a prefill). All of it when it fits; otherwise, with chunked
    prefill, a chunk of whatever budget is left; without chunked prefill, nothing (0:
    it waits for a step with room for the whole prompt). Never more than `budget_left`.
    """
    raise NotImplementedError("Exercise 4.1: a sequence's share of the token budget")


# Exercise 4.2: recompute or swap a preempted sequence
def preemption_mode(num_blocks: int, block_nbytes: int, swap_free_bytes: int) -> PreemptionMode:
    """Swap a victim when the host swap space can hold all of its blocks, else recompute.

    The victim holds `num_blocks` blocks of `block_nbytes` bytes each; `swap_free_bytes`
    of the swap space are free (without swap space, both sizes are 0). Returns "swap" or
    "recompute". A sequence that holds no block has nothing to swap: it is recomputed.
    The blocks go whole or not at all: a sequence half on the host would need its other
    half recomputed anyway.
    """
    raise NotImplementedError("Exercise 4.2: recompute or swap a preempted sequence")


# Exercise 4.3: the host swap space's accounting
class HostSwapSpace:
    """A byte-budgeted account of swapped-out sequences' KV blocks, keyed by sequence id.

    Each sequence swapped out (`swap_out`) holds `len(blocks) * block_nbytes` bytes of the
    host swap space until it is swapped back in (`swap_in`) or dropped (`discard`); the
    byte counters `bytes_out` and `bytes_in` only grow. Every method returns the block
    operation the worker carries out, and refuses what it cannot account for: a full
    swap space (`SwapSpaceFullError`), a sequence swapped out twice or swapped in with the
    wrong number of blocks (`ValueError`), an unknown sequence (`KeyError`).
    """

    def __init__(self, capacity_bytes: int, block_nbytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.block_nbytes = block_nbytes
        self.used_bytes = 0
        self.bytes_out = 0  # total copied pool -> host
        self.bytes_in = 0  # total copied host -> pool
        self._blocks: dict[int, int] = {}  # sequence id -> blocks it has on the host

    @classmethod
    def from_config(cls, cache_config: CacheConfig, block_nbytes: int) -> HostSwapSpace:
        """A swap space of `cache_config.swap_space` GiB (vLLM's option)."""
        return cls(int(cache_config.swap_space * GIB), block_nbytes)

    def can_swap_out(self, num_blocks: int) -> bool:
        """Whether `num_blocks` more blocks fit (exactly full is fine)."""
        raise NotImplementedError("Exercise 4.3: the host swap space's accounting")

    def swap_out(self, key: int, blocks: list[int]) -> SwapOut:
        """Account for these blocks going to host memory under `key`; the caller frees them.

        All or nothing: when they do not fit, raise SwapSpaceFullError and change nothing.
        Returns SwapOut(key, the blocks as a tuple): the worker copies them out.
        """
        raise NotImplementedError("Exercise 4.3: the host swap space's accounting")

    def swap_in(self, key: int, new_blocks: list[int]) -> SwapIn:
        """`key`'s blocks come back into `new_blocks` (fresh blocks, as many as went out);
        the host copy is released. Returns SwapIn(key, the new blocks as a tuple)."""
        raise NotImplementedError("Exercise 4.3: the host swap space's accounting")

    def discard(self, key: int) -> DropSwapped:
        """Drop `key`'s host copy without copying it back (the request was aborted)."""
        raise NotImplementedError("Exercise 4.3: the host swap space's accounting")

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def num_blocks(self, key: int) -> int:
        """How many blocks `key` has swapped out (what swapping it in needs); KeyError when
        it has none there."""
        raise NotImplementedError("Exercise 4.3: the host swap space's accounting")

    def _release(self, key: int) -> None:
        """Give `key`'s bytes back to the swap space and forget it."""
        raise NotImplementedError("Exercise 4.3: the host swap space's accounting")


# Exercise 4.4: the step-time model (predict a step, invert it, fit it online)
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
        raise NotImplementedError("Exercise 4.4: the step-time model (predict a step, invert it, fit it online)")

    def max_prefill_tokens(self, decodes: StepShape, seconds: float, start: int = 0) -> int:
        """The most prompt tokens a step of `decodes` may add (a chunk after `start` computed
        tokens) and still take at most `seconds`; 0 when not even one fits.

        The step with the chunk is `decodes.plus_prefill(n, start)`: each prompt token costs
        per_token_s and, as context, per_context_token_s; the chunk's context includes the
        `start` tokens before it; the prefill jump is paid unless `decodes` already runs a
        prompt chunk. Without a per-token cost any chunk fits: `sys.maxsize`. Rounded down,
        forgiving float dust of 1e-9 token (a budget that holds exactly n tokens gives n).
        """
        raise NotImplementedError("Exercise 4.4: the step-time model (predict a step, invert it, fit it online)")

    @classmethod
    def from_metrics(cls, stats: dict[str, float]) -> StepCost | None:
        """The cost an engine reported in `get_metrics()` (`cost_metrics`); None if unfitted."""
        if not stats.get("step_cost_fitted"):
            return None
        return cls(*(stats[f"step_cost_{name}"] for name in COEFFICIENT_NAMES))

    def break_even_chunk(self) -> float:
        """Prompt tokens that cost what the prefill jump costs: a smaller chunk spends more on
        the jump than on the prompt (0.0 without a per-token cost)."""
        raise NotImplementedError("Exercise 4.4: the step-time model (predict a step, invert it, fit it online)")


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
        raise NotImplementedError("Exercise 4.4: the step-time model (predict a step, invert it, fit it online)")


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
    raise NotImplementedError("Exercise 4.4: the step-time model (predict a step, invert it, fit it online)")
