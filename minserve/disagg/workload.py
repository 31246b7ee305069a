"""Workloads for the simulator: when requests arrive, how long their prompts and outputs are.

Arrivals follow a Poisson process (exponential gaps at `rate` requests/s) as in vLLM's
`bench serve`; lengths are uniform in a range, with a fixed seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class SimRequest:
    """One request of a workload: arrival time (s), prompt tokens, output tokens."""

    arrival_s: float
    prompt_len: int
    output_len: int

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError(
                f"a request needs at least 1 prompt and 1 output token, got {self.prompt_len}"
                f" and {self.output_len}"
            )
        if self.arrival_s < 0:
            raise ValueError(f"arrival time must be >= 0, got {self.arrival_s}")


def poisson_workload(
    rate: float,
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
) -> list[SimRequest]:
    """`num_requests` arrivals at `rate` req/s; lengths uniform in the inclusive ranges."""
    if rate <= 0 or num_requests < 1:
        raise ValueError(f"need rate > 0 and num_requests >= 1, got {rate} and {num_requests}")
    rng = random.Random(seed)
    t, requests = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        requests.append(SimRequest(t, rng.randint(*prompt_len), rng.randint(*output_len)))
    return requests


def fixed_workload(
    interval_s: float, num_requests: int, prompt_len: int, output_len: int
) -> list[SimRequest]:
    """Evenly spaced identical requests (the first at t=0): for hand-checkable cases."""
    return [SimRequest(i * interval_s, prompt_len, output_len) for i in range(num_requests)]
