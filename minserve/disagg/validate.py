"""Check the simulator against the real engine: calibrate, replay a workload, simulate it.

    python -m minserve.disagg.validate        # SmolLM2, one thread, about 30 s on a CPU

Prints mean TTFT, mean TPOT and duration, measured and simulated, and the relative error
(issue 7 asks for agreement within 20%). Not a timed test: timings depend on the machine.
"""

from __future__ import annotations

import argparse

import torch

from minserve.disagg.calibrate import calibrate
from minserve.disagg.replay import replay
from minserve.disagg.simulator import ClusterShape, SimConfig, SimResult, simulate
from minserve.disagg.workload import poisson_workload
from minserve.engine import LLMEngine

METRICS = ("mean_ttft_s", "mean_tpot_s", "duration_s")


def validate(engine: LLMEngine, rate: float, num_requests: int, seed: int) -> dict[str, tuple]:
    """(measured, simulated) per metric for one colocated instance."""
    costs = calibrate(engine, prompt_lens=(32, 128, 256), batch_sizes=(1, 2, 3, 4, 6, 8))
    work = poisson_workload(rate, num_requests, (32, 200), (8, 24), seed=seed)
    measured = replay(engine, work)
    config = SimConfig(max_num_batched_tokens=engine.scheduler_config.max_num_batched_tokens)
    simulated: SimResult = simulate(work, ClusterShape(num_colocated=1), costs, config)
    return {m: (getattr(measured, m), getattr(simulated, m)) for m in METRICS}


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
    for name, (real, sim) in validate(llm.engine, args.rate, args.num_requests, args.seed).items():
        print(f"{name}: measured {real:.4f} simulated {sim:.4f} error {(sim - real) / real:+.1%}")


if __name__ == "__main__":
    main()
