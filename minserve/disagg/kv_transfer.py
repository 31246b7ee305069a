"""`KVTransfer`: how a prefilled request's KV blocks reach a decode instance.

The hand-off (DistServe, Mooncake), for each batch of requests a prefill step finished:

    prefill instance                          decode instance
    offer(offers)        ── JSON offers ──►   receive_offers()
                                              allocate blocks (or refuse: recompute)
                         ◄── JSON acks ────   acknowledge(acks): accepted, or why not
    send_blocks(kv)      ── KV tensors ───►   receive_blocks(shape) -> write into blocks
    free its own blocks (only now: the decode side holds a copy)

The decode side allocates before any byte moves, so a transfer never lands nowhere. The
blocks travel by torch.distributed send/recv: gloo between CPU processes here; with NCCL
on GPUs the same calls move GPU memory directly (`kv_wire.py` picks the backend).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from minserve.disagg.kv_wire import HOST
from minserve.disagg.wire import recv_json, send_json
from minserve.sampling_params import SamplingParams
from minserve.scheduler.sequence import Sequence


@dataclass(frozen=True)
class KVOffer:
    """A request leaving a prefill instance: prompt, first token, sampling, KV or recompute."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_token: int
    params: SamplingParams
    with_kv: bool  # False: the transfer-versus-recompute rule chose recompute

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "params": asdict(self.params)}

    @classmethod
    def of(cls, seq: Sequence, with_kv: bool) -> KVOffer:
        """The offer for a sequence `detach_prefilled` just took out of a prefill engine."""
        request = seq.request
        return cls(
            request.request_id, tuple(request.prompt_token_ids), seq.sample.token_ids[0],
            request.params, with_kv,
        )  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KVOffer:
        fields = {**d, "prompt_token_ids": tuple(d["prompt_token_ids"])}
        return cls(**{**fields, "params": SamplingParams(**d["params"])})


@dataclass(frozen=True)
class KVAck:
    """The decode side's answer to one offer: the KV accepted, or why it was refused."""

    request_id: str
    accepted: bool
    reason: str = ""  # why not: "the transfer rule chose recompute", "no room for ..."


class KVTransfer(Protocol):
    """The interface both sides program against; `TorchKVTransfer` is the implementation."""

    def offer(self, offers: list[KVOffer]) -> list[KVAck]: ...

    def send_blocks(self, kv: torch.Tensor) -> None: ...

    def receive_offers(self) -> list[KVOffer]: ...

    def acknowledge(self, acks: list[KVAck]) -> None: ...

    def receive_blocks(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


@dataclass
class TransferStats:
    """Bytes of KV moved and the seconds the sending side spent moving them."""

    num_transfers: int = 0
    kv_bytes: int = 0
    seconds: float = 0.0


class TorchKVTransfer:
    """KV hand-off over torch.distributed point-to-point calls with rank `peer`."""

    def __init__(
        self,
        peer: int,
        group: dist.ProcessGroup | None = None,
        device: torch.device = HOST,
    ) -> None:
        self.peer = peer
        self.group = group
        self.device = device  # where KV travels: the GPU with NCCL, the host with gloo
        self.stats = TransferStats()

    def offer(self, offers: list[KVOffer]) -> list[KVAck]:
        """Prefill side: announce the requests; the decode side's answer to each, in order."""
        send_json([o.to_json() for o in offers], self.peer, self.group)
        acks = [KVAck(**a) for a in recv_json(self.peer, self.group)]
        if [a.request_id for a in acks] != [o.request_id for o in offers]:
            raise RuntimeError(
                f"offers {[o.request_id for o in offers]} were answered by acks "
                f"{[a.request_id for a in acks]}"
            )
        return acks

    def send_blocks(self, kv: torch.Tensor) -> None:
        """Prefill side: one accepted request's blocks, [layers, 2, blocks, block_size, Hkv, D]."""
        start = time.perf_counter()
        dist.send(as_wire(kv.to(self.device).contiguous()), self.peer, group=self.group)
        self.stats.num_transfers += 1
        self.stats.kv_bytes += kv.numel() * kv.element_size()
        self.stats.seconds += time.perf_counter() - start

    def receive_offers(self) -> list[KVOffer]:
        return [KVOffer.from_json(d) for d in recv_json(self.peer, self.group)]

    def acknowledge(self, acks: list[KVAck]) -> None:
        send_json([asdict(a) for a in acks], self.peer, self.group)

    def receive_blocks(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        kv = torch.empty(shape, dtype=dtype, device=self.device)  # [layers, 2, blocks, bs, Hkv, D]
        dist.recv(as_wire(kv), self.peer, group=self.group)
        self.stats.num_transfers += 1
        self.stats.kv_bytes += kv.numel() * kv.element_size()
        return kv

    # --- live migration: JSON both ways, and blocks that travel while a step runs ---

    def send_message(self, message: Any) -> None:
        send_json(message, self.peer, self.group)

    def receive_message(self) -> Any:
        return recv_json(self.peer, self.group)

    def start_send_blocks(self, kv: torch.Tensor) -> tuple[torch.Tensor, dist.Work]:
        """Send blocks without waiting: a pre-copy stage's blocks travel while the source runs
        its decode step. Keep the tensor returned until the work's `.wait()` returns."""
        wire = as_wire(kv.to(self.device).contiguous())
        work = dist.isend(wire, self.peer, group=self.group)
        self.stats.num_transfers += 1
        self.stats.kv_bytes += kv.numel() * kv.element_size()
        return wire, work

    def start_receive_blocks(
        self, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, dist.Work]:
        """Post the receive of blocks; they are in the tensor once the work's `.wait()` returns."""
        kv = torch.empty(shape, dtype=dtype, device=self.device)  # [layers, 2, blocks, bs, Hkv, D]
        work = dist.irecv(as_wire(kv), self.peer, group=self.group)
        self.stats.num_transfers += 1
        self.stats.kv_bytes += kv.numel() * kv.element_size()
        return kv, work


def as_wire(kv: torch.Tensor) -> torch.Tensor:
    """An fp8 KV cache's blocks travel as their bytes (a view): gloo has no fp8 type."""
    if kv.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return kv.view(torch.uint8)
    return kv
