"""How long one engine step takes: a line fitted to measured step times.

A step that prefills T prompt tokens and decodes B sequences costs

    step_time(T, B) = base_s + per_prefill_token_s * T + per_decode_seq_s * B

`base_s` is what every step pays (reading the weights once, launching work), the prefill
term is compute-bound work per token, the decode term the per-sequence cost of a decode
(its KV reads, its logits). The simulator needs nothing else. `fit_step_costs` finds the
three numbers from measurements by least squares; `calibrate.py` measures them.
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class StepMeasurement:
    """One measured step: prompt tokens prefilled, sequences decoded, seconds it took."""

    prefill_tokens: int
    decode_seqs: int
    seconds: float


@dataclass(frozen=True)
class StepCosts:
    """The linear step-time model, plus the KV bytes one token occupies (for transfers)."""

    base_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        terms = (self.base_s, self.per_prefill_token_s, self.per_decode_seq_s)
        if min(terms) < 0 or self.kv_bytes_per_token < 0:
            raise ValueError(f"step costs must be non-negative, got {self}")
        if self.base_s + self.per_prefill_token_s + self.per_decode_seq_s == 0:
            raise ValueError("step costs are all zero: a simulated step would take no time")

    def step_time(self, prefill_tokens: int, decode_seqs: int) -> float:
        return (
            self.base_s
            + self.per_prefill_token_s * prefill_tokens
            + self.per_decode_seq_s * decode_seqs
        )

    def prefill_time(self, num_tokens: int) -> float:
        """One step that only prefills `num_tokens` tokens (the recompute cost of a prompt)."""
        return self.step_time(num_tokens, 0)

    def tensor_parallel(self, tp: int, comm_s_per_step: float = 0.0) -> StepCosts:
        """Ideal TP scaling (every term divided by `tp`) plus a communication cost per step.

        A model, not a measurement: use measured TP step times instead where you have them.
        """
        if tp < 1:
            raise ValueError(f"tensor-parallel degree must be at least 1, got {tp}")
        return StepCosts(
            self.base_s / tp + (comm_s_per_step if tp > 1 else 0.0),
            self.per_prefill_token_s / tp,
            self.per_decode_seq_s / tp,
            self.kv_bytes_per_token // tp,  # each rank holds and sends its share of KV heads
        )

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> StepCosts:
        return cls(**json.loads(Path(path).read_text()))


def fit_step_costs(measurements: list[StepMeasurement], kv_bytes_per_token: int = 0) -> StepCosts:
    """Least-squares fit of the three terms to each shape's median time, minimising relative
    errors, every term non-negative."""
    if len({(m.prefill_tokens, m.decode_seqs) for m in measurements}) < 3:
        raise ValueError(
            "fitting base, per-token and per-sequence costs needs measurements of at least 3 "
            f"different (prefill_tokens, decode_seqs) shapes, got {len(measurements)} steps"
        )
    by_shape: dict[tuple[int, int], list[float]] = {}
    for m in measurements:
        by_shape.setdefault((m.prefill_tokens, m.decode_seqs), []).append(m.seconds)
    # the median of each shape's repeats: a step slowed by other work on the machine is noise
    a = np.array([[1.0, tokens, seqs] for tokens, seqs in by_shape])  # [num_shapes, 3]
    y = np.array([statistics.median(times) for times in by_shape.values()])  # [num_shapes]
    # relative errors: a 80 ms decode step counts as much as a 7 s prefill, so the base
    # (which decode steps are made of) is not sacrificed to fit the longest prefills
    base, per_token, per_seq = _nonnegative_lstsq(a / y[:, None], np.ones_like(y))
    return StepCosts(base, per_token, per_seq, kv_bytes_per_token)


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> list[float]:
    """min |a x - y| with x >= 0, by trying every subset of free terms (three terms: 7 tries).

    Clipping an unconstrained solution at zero would leave the other terms fitted for the
    negative one; refitting without it keeps them right."""
    best: tuple[float, np.ndarray] | None = None
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            coef, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (coef < 0).any():
                continue
            x = np.zeros(a.shape[1])
            x[list(cols)] = coef
            residual = float(np.sum((a @ x - y) ** 2))
            if best is None or residual < best[0]:
                best = (residual, x)
    assert best is not None, "one free term with positive times always fits non-negatively"
    return [float(c) for c in best[1]]
