"""Transfer or recompute? Move a prompt's KV, or let the decode instance prefill it again.

Moving costs `latency + bytes / bandwidth`; recomputing costs `prompt_len x seconds per
prefill token`. Both are measured: the link by a ping-pong of two sizes at start-up,
prefill speed from the prefill instance's own steps. On GPUs joined by NVLink or RDMA
transfer wins by far; over a slow link with a small model, recompute can.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minserve.disagg.kv_wire import HOST

log = logging.getLogger("minserve.disagg")
POLICIES = ("auto", "transfer", "recompute")


@dataclass(frozen=True)
class TransferDecision:
    """One request's choice and the two estimates behind it."""

    request_id: str
    kv_bytes: int
    transfer_s: float
    recompute_s: float
    transfer: bool


# >>> exercise 8.1: transfer or recompute
@dataclass
class TransferRule:
    """Measured link and prefill speed; `decide` picks the cheaper way per request."""

    latency_s: float
    bandwidth_bytes_s: float
    policy: str = "auto"
    recompute_s_per_token: float | None = None  # None until a prefill step was seen

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"transfer policy must be one of {POLICIES}, got {self.policy!r}")

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Update the prefill speed from a step (a running mean, weight 1/4 on the new one)."""
        if num_tokens > 0:
            rate = seconds / num_tokens
            old = self.recompute_s_per_token
            self.recompute_s_per_token = rate if old is None else 0.75 * old + 0.25 * rate

    def decide(self, request_id: str, num_tokens: int, kv_bytes: int) -> TransferDecision:
        """Estimate both ways for one request and pick the cheaper (ties: transfer).

        transfer_s = latency_s + kv_bytes / bandwidth_bytes_s; recompute_s = num_tokens x
        recompute_s_per_token (infinite while no prefill was observed). Policy "transfer" or
        "recompute" forces the choice but still reports both estimates. Log the decision.
        """
        # >>> solution
        transfer_s = self.latency_s + kv_bytes / self.bandwidth_bytes_s
        recompute_s = num_tokens * (self.recompute_s_per_token or float("inf"))
        transfer = self.policy == "transfer" or (
            self.policy == "auto" and transfer_s <= recompute_s
        )
        decision = TransferDecision(request_id, kv_bytes, transfer_s, recompute_s, transfer)
        log.info(
            "%s: %d tokens, %d KV bytes: transfer %.2e s vs recompute %.2e s -> %s",
            request_id, num_tokens, kv_bytes, transfer_s, recompute_s,
            "transfer" if transfer else "recompute",
        )  # fmt: skip
        return decision
        # <<< solution


# <<< exercise


def measure_link(
    peer: int,
    sender: bool,
    sizes: tuple[int, int] = (1 << 10, 1 << 25),
    repeats: int = 5,
    device: torch.device = HOST,
) -> tuple:
    """Ping-pong `sizes` bytes with `peer` (both sides call it); (latency_s, bandwidth B/s).

    The time of a round trip of n bytes and a 1-byte reply is latency + n / bandwidth;
    two sizes give both unknowns. One unmeasured round trip first (the first message pays
    for setting the connection up), then the fastest of `repeats` per size. The large size
    (32 MiB) keeps bytes / bandwidth well above the milliseconds a busy machine adds to a
    wake-up; should noise still win, the large round trip alone gives the bandwidth.
    The probes live on `device`, where the KV will travel from (a GPU measures NCCL).
    """
    reply = torch.zeros(1, dtype=torch.uint8, device=device)

    def round_trip(n: int) -> float:
        payload = torch.zeros(n, dtype=torch.uint8, device=device)  # [n bytes]
        start = time.perf_counter()
        if sender:
            dist.send(payload, peer)
            dist.recv(reply, peer)
        else:
            dist.recv(payload, peer)
            dist.send(reply, peer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NCCL calls return once queued
        return time.perf_counter() - start

    round_trip(sizes[0])
    times = [min(round_trip(n) for _ in range(repeats)) for n in sizes]
    (small, large), (t_small, t_large) = sizes, times
    if t_large > t_small:
        bandwidth = (large - small) / (t_large - t_small)
    else:
        bandwidth = large / t_large
    return max(t_small - small / bandwidth, 0.0), bandwidth
