"""Capacity planning: which cluster shape serves a workload with the most goodput under SLOs.

For a number of GPUs and each tensor-parallel degree that divides it, try every split
into P prefill + D decode instances and the all-colocated shape, simulate the workload on
each, and rank them by goodput (DistServe's search, by brute force: each simulation of a
few hundred requests takes milliseconds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from minserve.disagg.costs import StepCosts
from minserve.disagg.simulator import SLO, ClusterShape, SimConfig, SimResult, simulate
from minserve.disagg.workload import SimRequest

Simulator = Callable[[list[SimRequest], ClusterShape, StepCosts, SimConfig], SimResult]


@dataclass(frozen=True)
class PlanPoint:
    """One candidate shape and what the simulator predicts for it."""

    shape: ClusterShape
    result: SimResult
    goodput: float  # requests/s meeting every SLO
    attainment: float  # fraction of requests meeting every SLO

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.shape.num_gpus


def candidate_shapes(
    num_gpus: int, tp_degrees: list[int], max_splits: int | None = None
) -> list[ClusterShape]:
    """Every colocated and P:D shape using all `num_gpus`, for each TP degree that divides it;
    with `max_splits`, at most that many P:D splits per TP degree, evenly spaced in P."""
    shapes = []
    for tp in tp_degrees:
        if tp < 1 or num_gpus % tp:
            continue
        n = num_gpus // tp
        shapes.append(ClusterShape(num_colocated=n, tp=tp))
        shapes += [ClusterShape(num_prefill=p, num_decode=n - p, tp=tp)
                   for p in _prefill_counts(n, max_splits)]  # fmt: skip
    if not shapes:
        raise ValueError(f"no TP degree in {tp_degrees} divides {num_gpus} GPUs")
    return shapes


def _prefill_counts(num_instances: int, max_splits: int | None) -> list[int]:
    """P = 1 .. num_instances - 1, or `max_splits` of them evenly spaced (ends included)."""
    if max_splits is not None and max_splits < 2:
        raise ValueError(f"max_splits must be at least 2 (or None for all), got {max_splits}")
    every = list(range(1, num_instances))
    if max_splits is None or len(every) <= max_splits:
        return every
    step = (len(every) - 1) / (max_splits - 1)
    return sorted({every[round(i * step)] for i in range(max_splits)})


def search_shapes(
    num_gpus: int,
    workload: list[SimRequest],
    costs_by_tp: dict[int, StepCosts],
    slo: SLO,
    config: SimConfig,
    max_splits: int | None = None,
    simulator: Simulator = simulate,
) -> list[PlanPoint]:
    """Simulate every candidate shape; best goodput first (ties: higher attainment).
    `simulator` runs each shape (chapter 08 plugs the student's `simulate` in)."""
    points = []
    for shape in candidate_shapes(num_gpus, sorted(costs_by_tp), max_splits):
        result = simulator(workload, shape, costs_by_tp[shape.tp], config)
        points.append(PlanPoint(shape, result, result.goodput(slo), result.attainment(slo)))
    return sorted(points, key=lambda p: (p.goodput, p.attainment), reverse=True)


def best_split(points: list[PlanPoint], tp: int = 1) -> PlanPoint:
    """The best disaggregated (P:D) shape at one TP degree among `search_shapes`' points."""
    split = [p for p in points if p.shape.num_prefill and p.shape.tp == tp]
    if not split:
        raise ValueError(f"no P:D shape at TP{tp} among the points")
    return max(split, key=lambda p: (p.goodput, p.attainment))
