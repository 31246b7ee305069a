"""A tensor-parallel worker: rank 1..N-1. It holds its shard and its own KV pool, and runs
every forward that rank 0 broadcasts, until rank 0 says stop.

The same loop serves processes spawned by `LLM(tensor_parallel_size=N)` on one machine
(`spawned_worker`) and processes started by torchrun across machines (`torchrun_worker`).
"""

from __future__ import annotations

import importlib
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection

import torch

from minserve.attention.backends import get_attention_backend
from minserve.distributed import step_message
from minserve.distributed.checkpoint import CheckpointTensors
from minserve.distributed.group import RankGroup, join_group, leave_group, this_rank_device
from minserve.distributed.shard_model import build_shard
from minserve.execution import ExecutionConfig, resolve_execution
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.platforms import Platform, set_up_platform
from minserve.worker.memory import measure_kv_cache_budget
from minserve.worker.pool_size import MeasureBudget, agree_pool_blocks
from minserve.worker.worker import Worker

STARTED, READY = "started", "ready"


@dataclass(frozen=True)
class TPSpec:
    """What every rank needs to build the same engine slice (plain values: it is pickled
    only from rank 0 to the workers it spawns)."""

    model: str | None  # a .gguf file or HF folder; None: the bundled SmolLM2
    world_size: int
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    attention_backend: str = "auto"
    init_method: str | None = None  # "tcp://127.0.0.1:PORT"; None: torchrun's env://
    num_threads: int | None = None  # CPU threads per worker (None: cores / world_size)
    step_timeout: float = 600.0  # seconds a collective may wait before it is an error
    # the module, by name, whose parallel layers (and parallelize_attention, if it has one)
    # every rank builds its shard with; None: minserve's own (chapter 07 plugs the student's)
    parallel_layers: str | None = None


@dataclass
class RankState:
    """One rank's slice of the engine: its group and its worker (shard, KV pool, host copies)."""

    group: RankGroup
    worker: Worker


def start_rank(
    rank: int, spec: TPSpec, source: CheckpointTensors | None = None
) -> tuple[RankGroup, torch.nn.Module, ExecutionConfig, Platform]:
    """Join the group and load this rank's shard (rank 0 included); how it runs (shards
    are not prepacked) and its platform."""
    device = this_rank_device(spec.device, rank)
    execution = resolve_execution(device, spec.dtype, spec.attention_backend, prepack=False)
    group = join_group(rank, spec.world_size, spec.init_method, device, spec.step_timeout)
    source = source or CheckpointTensors(spec.model)
    linear = importlib.import_module(spec.parallel_layers or "minserve.distributed.layers")
    model = build_shard(source, group.comm, execution.dtype, device, linear)
    execution, platform = set_up_platform(model, execution)
    return group, model, execution, platform


def build_worker(
    rank: int,
    spec: TPSpec,
    on_loaded: Callable[[], object] = lambda: None,
    measure: MeasureBudget = measure_kv_cache_budget,
) -> RankState:
    """A rank's shard and its worker; `on_loaded` runs once the shard is loaded, then the
    KV pool takes the size every rank agrees on (each measures its own: `pool_size.py`)."""
    group, model, execution, platform = start_rank(rank, spec)
    on_loaded()  # rank 0 may start its engine, which sizes the pools with us
    num_blocks = agree_pool_blocks(group.control, None, model, measure)
    param = next(model.parameters())
    pool = PagedKVPool(model.config, num_blocks, spec.block_size, param.dtype, param.device)
    backend = get_attention_backend(execution.attention)
    return RankState(group, Worker(platform.runner(model, pool, backend)))


def serve_steps(state: RankState) -> None:
    """Run rank 0's steps on this rank's heads until it broadcasts stop."""
    device = state.worker.runner.device
    while (msg := step_message.receive(state.group.control, device)) is not None:
        state.worker.follow(msg.inputs, msg.block_ops)


def spawned_worker(rank: int, spec: TPSpec, status: Connection) -> None:
    """Entry point of a worker process spawned by rank 0; reports to it through `status`."""
    torch.set_num_threads(spec.num_threads or max(1, (os.cpu_count() or 1) // spec.world_size))
    try:
        status.send(STARTED)
        serve_steps(build_worker(rank, spec, on_loaded=partial(status.send, READY)))
    except BaseException:
        status.send(f"rank {rank} failed:\n{traceback.format_exc()}")
        raise SystemExit(1) from None
    finally:
        leave_group()


def torchrun_worker(spec: TPSpec) -> None:
    """Entry point of ranks 1..N-1 under torchrun (RANK, WORLD_SIZE from the environment)."""
    state = build_worker(int(os.environ["RANK"]), spec)
    try:
        serve_steps(state)
    finally:
        leave_group()
