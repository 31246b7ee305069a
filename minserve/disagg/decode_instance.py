"""A decode instance: a process that takes prefilled requests in and streams their tokens out.

One round, as the proxy (rank 0) commands it:

    abort what the proxy says (frees those blocks here)
    resume the requests the proxy moves here from a dead instance: from the prompt and the
        tokens they generated so far (recomputed here; the prefix cache may hold some)
    for each prefill rank the proxy names, in rank order:
        receive its offers, allocate blocks (or refuse: recompute), ack, receive the KV
    one stage of each live migration it sends or receives (`migration.py`)
    one decode step over everything it holds (pre-copy blocks travel meanwhile)
    report to the proxy: each request's new tokens this step (not only finished ones),
    what it admitted, hand-offs lost to a dead prefill rank, migrations' outcomes, stats

Its engine is the ordinary `LLMEngine`; `engine_hooks.add_prefilled` continues a request.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from minserve.disagg.engine_hooks import resume_from_json
from minserve.disagg.hand_off import HandOffLostError, receive_prefilled
from minserve.disagg.kv_transfer import TorchKVTransfer
from minserve.disagg.kv_wire import HOST
from minserve.disagg.migration import MigrationOrder, Migrations
from minserve.disagg.token_deltas import delta_json
from minserve.disagg.topology import PROXY_RANK
from minserve.disagg.wire import recv_command, send_json
from minserve.engine import LLMEngine
from minserve.outputs import RequestOutput


def serve_decode_rounds(
    engine: LLMEngine,
    control: dist.ProcessGroup,
    kv_device: torch.device,
    rank: int,
    links: dict[int, tuple[float, float]],
) -> None:
    """Rounds until the proxy says stop or is gone (commands on the control group)."""
    instance = DecodeInstance(engine, kv_device, rank, links)
    while (command := recv_command(PROXY_RANK, control)) is not None:
        send_json(instance.round(command), PROXY_RANK)


class DecodeInstance:
    """One decode engine, a KV link to each rank it exchanges blocks with, its migrations.

    links: {decode rank: (latency_s, bandwidth B/s)}, measured at start-up, for the stage
    planner of migrations out of here."""

    def __init__(
        self,
        engine: LLMEngine,
        kv_device: torch.device = HOST,
        rank: int = 0,
        links: dict[int, tuple[float, float]] | None = None,
    ) -> None:
        self.engine = engine
        self.kv_device = kv_device  # where KV arrives: this rank's GPU with NCCL, else the host
        self.transfers: dict[int, TorchKVTransfer] = {}
        self.migrations = Migrations(engine, rank, links or {}, self.transfers, kv_device)

    def round(self, command: dict[str, Any]) -> dict[str, Any]:
        for request_id in command["abort"]:
            self.engine.abort_request(request_id)
        failed = resume_from_json(self.engine, command["resume"])  # their instance died
        admitted, lost = [], []
        for rank in command["receive_from"]:
            try:
                admitted += self.receive_from(rank)
            except HandOffLostError as error:
                lost += error.request_ids
        self.migrations.run_stages([MigrationOrder.from_json(m) for m in command["migrate"]])
        outputs = self.step()
        migrations = self.migrations.finish()
        stats = self.engine.get_metrics()
        reported = [delta_json(o) for o in outputs]
        return {"outputs": reported, "admitted": admitted, "lost": lost, "failed": failed,
                "stats": stats, "migrations": migrations}  # fmt: skip

    def step(self) -> list[RequestOutput]:
        """One decode step, timed (a running mean, weight 1/4 on the new one): the stage
        planner weighs a migration's pause against it."""
        if not self.engine.has_unfinished_requests():
            return []
        start = time.perf_counter()
        outputs = self.engine.step()
        seconds, old = time.perf_counter() - start, self.migrations.step_s
        self.migrations.step_s = seconds if old is None else 0.75 * old + 0.25 * seconds
        return outputs

    def receive_from(self, rank: int) -> list[list]:
        """One prefill rank's hand-off: [[request id, received its KV], ...]."""
        transfer = self.transfers.setdefault(rank, TorchKVTransfer(rank, device=self.kv_device))
        admitted = receive_prefilled(self.engine, transfer)
        return [[ack.request_id, ack.accepted] for _, ack in admitted]
