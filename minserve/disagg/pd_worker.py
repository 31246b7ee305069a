"""The decode instance: a process that receives prefilled requests and decodes them.

Rank 1 of a two-rank group (rank 0 is the prefill instance, `pd_pair.py`; gloo, or
gloo + NCCL for the KV when each rank has its own GPU, `kv_wire.py`). Each round it
takes the offers of requests rank 0 just prefilled, allocates blocks and acknowledges,
receives their KV into those blocks (`hand_off.py`), runs one decode step, and sends
back the requests that finished (JSON). Its engine is the ordinary `LLMEngine`.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from minserve.disagg.hand_off import Admit, Receive, admit, receive_prefilled
from minserve.disagg.kv_transfer import TorchKVTransfer
from minserve.disagg.kv_wire import KVWire, instance_gpu
from minserve.disagg.token_deltas import delta_json
from minserve.disagg.transfer_rule import measure_link
from minserve.disagg.wire import recv_json, send_json
from minserve.engine import LLMEngine
from minserve.outputs import OutputAccumulator

PREFILL_RANK, DECODE_RANK = 0, 1


@dataclass(frozen=True)
class PairSpec:
    """What the decode process needs to start: plain strings and numbers, no objects."""

    model: str
    engine_options: tuple[tuple[str, Any], ...]  # LLM keyword arguments
    port: int
    step_timeout_s: float
    kv_wire: KVWire = KVWire("gloo", "cpu")

    def kv_device(self, rank: int) -> torch.device:
        """Where rank's KV travels from: its own GPU with NCCL, else the host."""
        return self.kv_wire.device(instance_gpu(rank, torch.cuda.device_count()))


def join_pair(rank: int, spec: PairSpec) -> None:
    dist.init_process_group(
        spec.kv_wire.backend, init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank,
        world_size=2, timeout=timedelta(seconds=spec.step_timeout_s),
    )  # fmt: skip


def decode_main(
    spec: PairSpec, status: Any, admit: Admit = admit, receive: Receive = receive_prefilled
) -> None:
    """Entry point of the spawned decode process; start-up errors go back through `status`.

    `receive` takes each round's hand-off in, `admit` each offered request (module-level
    functions: they cross to this process by name)."""
    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from minserve.llm import LLM  # after the environment is set

    kv_device = spec.kv_device(DECODE_RANK)
    if kv_device.type == "cuda":
        torch.cuda.set_device(kv_device)  # load the model onto this rank's own GPU

    try:
        llm = LLM(spec.model, **dict(spec.engine_options))
    except BaseException:
        status.put(traceback.format_exc())
        return
    status.put("ready")  # before joining: rank 0 joins only once the model loaded here
    join_pair(DECODE_RANK, spec)
    try:
        measure_link(PREFILL_RANK, sender=False, device=kv_device)
        assert llm.engine is not None
        transfer = TorchKVTransfer(PREFILL_RANK, device=kv_device)
        serve_decode(llm.engine, transfer, admit, receive)
    finally:
        dist.destroy_process_group()


def serve_decode(
    engine: LLMEngine,
    transfer: TorchKVTransfer,
    admit: Admit = admit,
    receive: Receive = receive_prefilled,
) -> None:
    """Rounds until rank 0 says stop: hand-offs in, one decode step, finished requests out."""
    whole = OutputAccumulator()
    while not recv_json(PREFILL_RANK)["stop"]:
        receive(engine, transfer, admit)
        outputs = engine.step() if engine.has_unfinished_requests() else []
        finished = [whole.add(o) for o in outputs]  # the tokens after the first one
        send_json([delta_json(o) for o in finished if o.finished], PREFILL_RANK)
        for output in outputs:
            if output.finished:
                del whole.outputs[output.request_id]
