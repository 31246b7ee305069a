"""Rank 0 of a tensor-parallel engine: start the workers, build the engine, stop them.

`build_engine` (for `LLM(tensor_parallel_size=N)` and `minserve serve
--tensor-parallel-size N`) calls `start_tensor_parallel`: it spawns N-1 worker processes
(on one machine: multiprocessing spawn, a free port on 127.0.0.1), joins the group as rank 0,
loads its own shard, agrees on the KV pool size, and builds the ordinary `LLMEngine` whose
worker hands every step to the other ranks (`BroadcastPeers`). Under torchrun (RANK and
WORLD_SIZE set), the workers are already running `worker.torchrun_worker` and nothing is
spawned.

Failures stay bounded and say what happened: a worker that dies while starting is reported
with its traceback; one that dies mid-step turns the step's collective error into a
`WorkerFailedError` naming it; `shutdown` stops the workers whatever state they are in.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch.distributed as dist

from minserve.config import CacheConfig
from minserve.distributed.checkpoint import CheckpointTensors
from minserve.distributed.driver import BroadcastPeers
from minserve.distributed.group import free_port, leave_group
from minserve.distributed.layout import check_divisible
from minserve.distributed.step_message import send
from minserve.distributed.worker import (
    READY,
    STARTED,
    TPSpec,
    spawned_worker,
    start_rank,
)
from minserve.engine_args import EngineArgs
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.loader import LoadedModel
from minserve.model.tokenizer import Tokenizer


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died or failed; the group cannot run more steps."""


class TensorParallelDriver:
    """Rank 0: the workers it started, its shard as a `LoadedModel`, and the group."""

    def __init__(self, spec: TPSpec, startup_timeout: float = 300.0) -> None:
        self.spec = spec
        self.procs: list[BaseProcess] = []
        self.status: list[Connection] = []
        self.closed = False
        self._startup_timeout = startup_timeout
        torchrun = spec.init_method is None
        if dist.is_initialized() and not torchrun:
            raise RuntimeError(
                "torch.distributed is already initialized in this process (is another "
                "LLM with tensor_parallel_size > 1 still running? call its shutdown() first)"
            )
        source = CheckpointTensors(spec.model)
        check_divisible(source.config, spec.world_size)  # before starting any process
        try:
            if not torchrun:
                self._spawn(startup_timeout)
            self.group, model, execution, platform = start_rank(0, spec, source)
        except BaseException as e:
            self.shutdown()
            raise self.failure(e) from e
        tokenizer = _tokenizer(source.path)
        self.loaded = LoadedModel(source.path, model.config, model, tokenizer, execution, platform)

    def _spawn(self, timeout: float) -> None:
        context = mp.get_context("spawn")
        for rank in range(1, self.spec.world_size):
            receiver, sender = context.Pipe(duplex=False)
            proc = context.Process(
                target=spawned_worker, args=(rank, self.spec, sender), daemon=True
            )
            proc.start()
            sender.close()
            self.procs.append(proc)
            self.status.append(receiver)
        self._wait_for(STARTED, timeout)

    def _wait_for(self, message: str, timeout: float) -> None:
        """Every spawned worker reports `message`, or we raise with what went wrong."""
        deadline = time.monotonic() + timeout
        for rank, (proc, conn) in enumerate(zip(self.procs, self.status), start=1):
            while not conn.poll(0.1):
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise WorkerFailedError(
                        f"rank {rank} did not report {message!r} within {timeout:.0f} s "
                        f"(exit code {proc.exitcode})"
                    )
            got = conn.recv()
            if got != message:
                raise WorkerFailedError(got)

    def peers(self, cache_config: CacheConfig) -> BroadcastPeers:
        """Wait for the workers' shards; rank 0's step peers. The pool size
        is agreed as the engine starts (every rank measures: `pool_size.py`); a byte
        budget that holds no block is refused here, before anything waits on it."""
        model = self.loaded.model
        PagedKVPool.num_blocks_for(cache_config, model.config, next(model.parameters()).dtype)
        try:
            self._wait_for(READY, self._startup_timeout)
        except BaseException as e:
            self.shutdown()
            raise self.failure(e) from e

        return BroadcastPeers(self.group.control, self.failure)

    def failure(self, error: BaseException) -> Exception:
        """A clear error from a collective's failure: which ranks died, and their reports."""
        if isinstance(error, WorkerFailedError | ValueError):
            return error
        deadline = time.monotonic() + 2.0  # a dead worker's exit may lag its closed socket
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        reports = [
            f"rank {r}: exit code {p.exitcode}" for r, p in enumerate(self.procs, 1) if p.exitcode
        ]
        reports += [r for r in map(_report, self.status) if r]
        self.shutdown()
        detail = "; ".join(reports) or "no worker reported an error"
        return WorkerFailedError(f"tensor-parallel step failed ({error}); {detail}")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the workers to stop, wait for them, then leave the group (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if hasattr(self, "group") and all(p.is_alive() for p in self.procs):
            try:
                send(None, self.group.control)
            except (RuntimeError, dist.DistError):
                pass  # a worker is gone already; it is terminated below
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout)
        leave_group()


def _tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_pretrained_dir(path) if path.is_dir() else Tokenizer.from_gguf(path)


def _report(conn: Connection) -> str | None:
    """What a worker sent before it died (its traceback), if anything."""
    try:
        return conn.recv() if not conn.closed and conn.poll() else None
    except (EOFError, OSError):
        return None


def tp_spec(model: str | os.PathLike | None, world_size: int, **options: object) -> TPSpec:
    """A spec for `world_size` ranks: spawned on 127.0.0.1, or torchrun's when it runs us."""
    spec = TPSpec(None if model is None else str(model), world_size, **options)
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", 1)) == world_size:
        if int(os.environ["RANK"]) != 0:
            raise RuntimeError(
                "under torchrun, only rank 0 builds the LLM; other ranks run "
                "minserve.distributed.worker.torchrun_worker (see docs/distributed.md)"
            )
        return spec
    return replace(spec, init_method=f"tcp://127.0.0.1:{free_port()}")


def start_tensor_parallel(
    args: EngineArgs, parallel_layers: str | None = None
) -> TensorParallelDriver:
    """Start the group for `args` (rank 0 here): every rank loads its shard of args.model."""
    if isinstance(args.model, LoadedModel):
        raise ValueError(
            "tensor_parallel_size > 1 loads each rank's shard from the checkpoint; "
            "pass a model path (or None), not an already loaded model"
        )
    spec = tp_spec(
        args.model, args.tensor_parallel_size, block_size=args.block_size, dtype=args.dtype,
        device=args.device, attention_backend=args.attention_backend,
        parallel_layers=parallel_layers,
    )  # fmt: skip
    return TensorParallelDriver(spec)
