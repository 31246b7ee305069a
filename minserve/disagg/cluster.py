"""Starting a disaggregated cluster: spawn the instances, join one torch.distributed group.

Every rank joins two groups:

- the *default* group, with the step timeout: reports, offers, acks and KV blocks, so a
  stuck or dead peer becomes an error instead of a hang. Its backend is gloo, or
  "cpu:gloo,cuda:nccl" when every instance has its own GPU: then the KV blocks go from
  GPU to GPU over NCCL and the JSON stays on gloo (`kv_wire.py`);
- the *control* group, with a long timeout: the proxy's per-round commands, which an idle
  instance waits for as long as the server is idle (a dead proxy still ends the wait).

Then each prefill/decode pair measures its link (`measure_link`) and every instance
sends the proxy a hello (JSON) with its limits. Only JSON and plain tensors cross.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from dataclasses import dataclass, fields
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from minserve.config import SchedulerConfig
from minserve.disagg.kv_wire import KVWire, instance_gpu
from minserve.disagg.topology import PROXY_RANK, PDTopology
from minserve.disagg.transfer_rule import measure_link
from minserve.disagg.wire import recv_json, send_json
from minserve.distributed.group import IDLE_TIMEOUT

if TYPE_CHECKING:
    from minserve.engine import LLMEngine

READY = "ready"


@dataclass(frozen=True)
class ClusterSpec:
    """What every instance needs to start: strings and numbers only, no live objects."""

    model: str | None
    engine_options: tuple[tuple[str, Any], ...]  # EngineArgs by name, the same on every instance
    topology: PDTopology
    port: int
    step_timeout_s: float = 600.0
    transfer_policy: str = "auto"
    kv_wire: KVWire = KVWire("gloo", "cpu")

    def kv_device(self, rank: int) -> torch.device:
        """Where rank's KV travels from: its GPU with NCCL, else the host (rank 0: unused)."""
        return self.kv_wire.device(instance_gpu(rank - 1, torch.cuda.device_count()))


class InstanceFailedError(RuntimeError):
    """A prefill or decode instance failed to start, or died; the message says which."""


def join_cluster(rank: int, spec: ClusterSpec) -> dist.ProcessGroup:
    """Join the default group (step timeout) and create the control group (idle timeout)."""
    dist.init_process_group(
        spec.kv_wire.backend, init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank,
        world_size=spec.topology.world_size, timeout=timedelta(seconds=spec.step_timeout_s),
    )  # fmt: skip
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def measure_links(
    rank: int, topology: PDTopology, device: torch.device
) -> dict[int, tuple[float, float]]:
    """Every prefill/decode pair ping-pongs, then every pair of decode ranks (live
    migration), in one global order (no rank waits in a cycle).

    Returns {peer: (latency_s, bandwidth B/s)}: on a prefill rank its decode ranks, on a
    decode rank the other decode ranks (both ends keep a decode pair's numbers).
    """
    links: dict[int, tuple[float, float]] = {}
    pairs = [(p, d) for p in topology.prefill_ranks for d in topology.decode_ranks]
    decode = topology.decode_ranks
    pairs += [(a, b) for i, a in enumerate(decode) for b in decode[i + 1 :]]
    for sender, receiver in pairs:
        if rank == sender:
            links[receiver] = measure_link(receiver, sender=True, device=device)
        elif rank == receiver:
            link = measure_link(sender, sender=False, device=device)
            if not topology.is_prefill(sender):
                links[sender] = link
    return links


def instance_main(rank: int, spec: ClusterSpec, status: Any) -> None:
    """Entry point of a spawned instance: load, say ready, join, then serve rounds."""
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the proxy; it stops us
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined
    kv_device = spec.kv_device(rank)
    if kv_device.type == "cuda":
        torch.cuda.set_device(kv_device)  # the engine's "cuda" is this rank's own GPU
    from minserve.disagg.decode_instance import serve_decode_rounds
    from minserve.disagg.prefill_instance import serve_prefill_rounds
    from minserve.engine_args import EngineArgs
    from minserve.engine_builder import build_engine

    try:
        args = EngineArgs.from_options(model=spec.model, **dict(spec.engine_options))
        engine = build_engine(args)
    except BaseException:
        status.put(traceback.format_exc())
        return
    status.put(READY)
    control = join_cluster(rank, spec)
    try:
        links = measure_links(rank, spec.topology, kv_device)
        send_json(hello(engine), PROXY_RANK)
        if spec.topology.is_prefill(rank):
            serve_prefill_rounds(engine, control, links, spec.transfer_policy, kv_device)
        else:
            serve_decode_rounds(engine, control, kv_device, rank, links)
    finally:
        dist.destroy_process_group()
    # Told to stop: leave now. The interpreter's own exit spends seconds in native
    # teardown after the group is gone; the proxy waits for us, so skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def hello(engine: LLMEngine) -> dict[str, int]:
    """An instance's limits, for the proxy to validate prompts before routing them."""
    return {"max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size}


def spawn_instances(spec: ClusterSpec, startup_timeout_s: float) -> dict[int, BaseProcess]:
    """Start one process per instance and wait until each has loaded the model."""
    context = mp.get_context("spawn")
    procs, statuses = {}, {}
    for rank in spec.topology.worker_ranks:
        statuses[rank] = context.Queue()
        procs[rank] = context.Process(
            target=instance_main, args=(rank, spec, statuses[rank]), daemon=True
        )
        procs[rank].start()
    deadline = time.monotonic() + startup_timeout_s
    for rank, status in statuses.items():
        try:
            message = status.get(timeout=max(deadline - time.monotonic(), 0.1))
        except queue.Empty:
            message = f"no word within {startup_timeout_s:.0f} s"
        if message != READY:
            stop_processes(procs)
            raise InstanceFailedError(f"instance rank {rank} failed to start:\n{message}")
    return procs


def stop_processes(procs: dict[int, BaseProcess], timeout_s: float = 10.0) -> None:
    """Wait for each process to exit; terminate the ones that do not."""
    deadline = time.monotonic() + timeout_s
    for proc in procs.values():
        proc.join(max(deadline - time.monotonic(), 0.0))
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)


def start_cluster(
    spec: ClusterSpec, startup_timeout_s: float
) -> tuple[dict[int, BaseProcess], dist.ProcessGroup, dict[int, dict]]:
    """Rank 0's side of start-up: the processes, the control group, each instance's hello."""
    procs = spawn_instances(spec, startup_timeout_s)
    try:
        control = join_cluster(PROXY_RANK, spec)
        hellos = {rank: recv_json(rank) for rank in spec.topology.worker_ranks}
    except BaseException as error:
        stop_processes(procs, timeout_s=0.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise InstanceFailedError(f"the instances did not join: {error}") from error
    return procs, control, hellos


def stop_cluster(
    procs: dict[int, BaseProcess], control: dist.ProcessGroup, alive: set[int]
) -> None:
    """Rank 0: tell the live instances to stop, wait for them, leave the group. A process
    that has exited is not sent to (a send to a peer that died while idle, unnoticed, can
    wait out the group's timeout)."""
    for rank in sorted(alive):
        if not procs[rank].is_alive():
            continue
        try:
            send_json({"stop": True}, rank, control)
        except (RuntimeError, dist.DistError):
            pass  # gone already; terminated below
    stop_processes(procs)
    dist.destroy_process_group()


def proxy_scheduler_config(engine_options: dict[str, Any], num_decode: int) -> SchedulerConfig:
    """The instances' scheduler options; the server admits max_num_seqs per decode instance."""
    names = {f.name for f in fields(SchedulerConfig)}
    config = SchedulerConfig(**{k: v for k, v in engine_options.items() if k in names})
    return SchedulerConfig(
        config.max_num_seqs * num_decode, config.max_num_batched_tokens,
        config.enable_chunked_prefill, config.scheduling_policy,
    )  # fmt: skip
