"""The mixed workload of `minserve bench disagg`: one list of requests for every consumer.

The same `SimRequest`s (arrival time, prompt and output length) feed the simulator, the
real-time replay of the prefill/decode pair and, as `bench serve` sessions of random token
ids, the HTTP load generator. Arrivals are `bench serve`'s own (`serve_load.arrival_times`:
Poisson at burstiness 1, the first at t=0), so every path sees the same seconds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from minserve.bench.serve_load import LoadSpec, arrival_times
from minserve.bench.serve_workloads import FIRST_TOKEN_ID, Session
from minserve.disagg.simulator import SLO
from minserve.disagg.workload import SimRequest


@dataclass(frozen=True)
class MixSpec:
    """Lengths uniform in inclusive ranges, a rate per serving instance, and the SLOs."""

    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    rate_per_instance: float
    slo: SLO


# SmolLM2 on one CPU core each: a 256-token prompt alone prefills in about 1.1 s and a decode
# step of 1-4 sequences takes 80-125 ms, so TTFT <= 2.5 s and TPOT <= 150 ms sit at about
# twice the unloaded latencies: queueing and prefill/decode interference decide who meets them.
# The rate per instance is what the CPU plan offers: the goodput runs' higher rate (1.2 req/s
# over 2 instances), where the simulator sees the shapes differ.
CPU_MIX = MixSpec((32, 256), (16, 64), rate_per_instance=0.6, slo=SLO(ttft_s=2.5, tpot_s=0.15))


def mixed_workload(
    rate: float, num_requests: int, spec: MixSpec = CPU_MIX, seed: int = 0
) -> list[SimRequest]:
    """`num_requests` at `rate` req/s (bench serve's arrivals for `seed`), lengths from `spec`."""
    times = arrival_times(num_requests, LoadSpec(rate, seed=seed))
    rng = random.Random(seed)
    return [
        SimRequest(t, rng.randint(*spec.prompt_len), rng.randint(*spec.output_len)) for t in times
    ]


def to_sessions(workload: list[SimRequest], vocab_size: int, seed: int = 0) -> list[Session]:
    """One single-turn completions session per request: random token ids, fixed output."""
    rng = random.Random(seed)
    return [
        Session(
            prompts=[[rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(r.prompt_len)]],
            output_len=r.output_len,
        )  # fmt: skip
        for r in workload
    ]
