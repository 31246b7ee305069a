"""A decode instance: a process that takes prefilled requests in and streams their tokens out.

One round, as the proxy (rank 0) commands it:

    abort what the proxy says (frees those blocks here)
    for each prefill rank the proxy names, in rank order:
        receive its offers, allocate blocks (or refuse: recompute), ack, receive the KV
    one decode step over everything it holds
    report to the proxy: each request's new tokens this step (not only finished ones),
    what it admitted, hand-offs lost to a dead prefill rank, and its stats

Its engine is the ordinary `LLMEngine`; `engine_hooks.add_prefilled` continues a request.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from minserve.disagg.hand_off import HandOffLostError, receive_prefilled
from minserve.disagg.kv_transfer import TorchKVTransfer
from minserve.disagg.kv_wire import HOST
from minserve.disagg.token_deltas import delta_json
from minserve.disagg.topology import PROXY_RANK
from minserve.disagg.wire import recv_command, send_json
from minserve.engine import LLMEngine


def serve_decode_rounds(
    engine: LLMEngine, control: dist.ProcessGroup, kv_device: torch.device
) -> None:
    """Rounds until the proxy says stop or is gone (commands on the control group)."""
    instance = DecodeInstance(engine, kv_device)
    while (command := recv_command(PROXY_RANK, control)) is not None:
        send_json(instance.round(command), PROXY_RANK)


class DecodeInstance:
    """One decode engine and a KV link to each prefill rank that has sent it requests."""

    def __init__(self, engine: LLMEngine, kv_device: torch.device = HOST) -> None:
        self.engine = engine
        self.kv_device = kv_device  # where KV arrives: this rank's GPU with NCCL, else the host
        self.transfers: dict[int, TorchKVTransfer] = {}

    def round(self, command: dict[str, Any]) -> dict[str, Any]:
        for request_id in command["abort"]:
            self.engine.abort_request(request_id)
        admitted, lost = [], []
        for rank in command["receive_from"]:
            try:
                admitted += self.receive_from(rank)
            except HandOffLostError as error:
                lost += error.request_ids
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        stats = self.engine.get_metrics()
        reported = [delta_json(o) for o in outputs]
        return {"outputs": reported, "admitted": admitted, "lost": lost, "stats": stats}

    def receive_from(self, rank: int) -> list[list]:
        """One prefill rank's hand-off: [[request id, received its KV], ...]."""
        transfer = self.transfers.setdefault(rank, TorchKVTransfer(rank, device=self.kv_device))
        admitted = receive_prefilled(self.engine, transfer)
        return [[ack.request_id, ack.accepted] for _, ack in admitted]
