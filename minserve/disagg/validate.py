"""Check the simulator against the real engine: calibrate, replay a workload, simulate it.

    python -m minserve.disagg.validate        # SmolLM2, one thread, about 30 s on a CPU

Prints mean TTFT, mean TPOT and duration, measured and simulated, and the relative error
(we aim for agreement within 20%). Not a timed test: timings depend on the machine.
`validate_pair` does the same for one prefill + one decode instance (`minserve bench disagg`).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import torch

from minserve.disagg.calibrate import calibrate
from minserve.disagg.costs import StepCosts
from minserve.disagg.replay import replay, replay_pair
from minserve.disagg.simulator import ClusterShape, SimConfig, SimResult, simulate
from minserve.disagg.workload import SimRequest, poisson_workload
from minserve.engine import LLMEngine

if TYPE_CHECKING:
    from minserve.disagg.pd_pair import PrefillDecodePair

METRICS = ("mean_ttft_s", "mean_tpot_s", "duration_s")


def compare(measured: SimResult, simulated: SimResult) -> dict[str, tuple[float, float]]:
    """(measured, simulated) for each of METRICS."""
    return {m: (getattr(measured, m), getattr(simulated, m)) for m in METRICS}


def relative_errors(pairs: dict[str, tuple[float, float]]) -> dict[str, float]:
    """(simulated - measured) / measured per metric."""
    return {m: (sim - real) / real for m, (real, sim) in pairs.items()}


def validate(engine: LLMEngine, rate: float, num_requests: int, seed: int) -> dict[str, tuple]:
    """(measured, simulated) per metric for one colocated instance."""
    costs = calibrate(engine, prompt_lens=(32, 128, 256), batch_sizes=(1, 2, 3, 4, 6, 8))
    work = poisson_workload(rate, num_requests, (32, 200), (8, 24), seed=seed)
    measured = replay(engine, work)
    config = SimConfig(max_num_batched_tokens=engine.scheduler_config.max_num_batched_tokens)
    simulated: SimResult = simulate(work, ClusterShape(num_colocated=1), costs, config)
    return compare(measured, simulated)


def validate_pair(
    pair: PrefillDecodePair,
    workload: list[SimRequest],
    costs: StepCosts,
    link: tuple[float, float] | None = None,
) -> dict[str, dict[str, tuple]]:
    """1P1D: the pair replays `workload` in real time; the simulator runs it on one prefill +
    one decode instance with `costs` and `link` (latency s, bandwidth B/s; default: the
    pair's start-up ping-pong), stepping in lockstep rounds as the pair does, and free-running.
    (measured, simulated) per metric, for each of the two models."""
    latency, bandwidth = link or (pair.rule.latency_s, pair.rule.bandwidth_bytes_s)
    measured = replay_pair(pair, workload)
    shape = ClusterShape(num_prefill=1, num_decode=1)
    budget = pair.llm.engine.scheduler_config.max_num_batched_tokens
    out = {}
    for name, lockstep in (("lockstep", True), ("free-running", False)):
        config = SimConfig(budget, transfer_bandwidth_bytes_s=bandwidth,
                           transfer_latency_s=latency, lockstep=lockstep)  # fmt: skip
        out[name] = compare(measured, simulate(workload, shape, costs, config))
    return out


def main() -> None:
    from minserve.llm import LLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: bundled SmolLM2)")
    parser.add_argument("--rate", type=float, default=1.5, help="requests per second")
    parser.add_argument("--num-requests", type=int, default=14)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model, max_num_batched_tokens=512)
    assert llm.engine is not None
    pairs = validate(llm.engine, args.rate, args.num_requests, args.seed)
    for name, error in relative_errors(pairs).items():
        real, sim = pairs[name]
        print(f"{name}: measured {real:.4f} simulated {sim:.4f} error {error:+.1%}")


if __name__ == "__main__":
    main()
