"""Run a function on N real ranks: N local processes joined by a gloo group on 127.0.0.1.

`run_on_ranks(fn, 2, ...)` is what a notebook cell or a benchmark uses to see tensor
parallelism with real processes and real collectives: each process joins the group,
calls `fn(comm, *args)` with its `ProcessGroupComm`, and sends back the result. `fn`
must be importable (defined in a module, not in the notebook): spawned processes find it
by name.

Results cross as plain pickled bytes. Through the queue's own pickler a tensor would
cross as a file descriptor that the receiver fetches from the sender later, and a rank
that has already exited by then leaves nothing to fetch (FileNotFoundError).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from minserve.distributed.comm import ProcessGroupComm
from minserve.distributed.group import free_port


def _rank_main(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, results: Any
) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=60),
        )  # fmt: skip
        results.put((rank, True, pickle.dumps(fn(ProcessGroupComm(), *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0
) -> list[Any]:
    """`fn(comm, *args)` on `world_size` gloo processes; their results in rank order.

    Raises RuntimeError with the rank's traceback if one fails, or after `timeout`
    seconds (the processes are then terminated): nothing is left hanging.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_rank_main, args=(r, world_size, port, fn, args, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        collected = dict(_collect(results, world_size, timeout))
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
    return [collected[r] for r in range(world_size)]


def _collect(results: Any, world_size: int, timeout: float) -> list[tuple[int, Any]]:
    out = []
    for _ in range(world_size):
        try:
            rank, ok, value = results.get(timeout=timeout)
        except queue.Empty as e:
            raise RuntimeError(f"ranks did not finish within {timeout:.0f} s") from e
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        out.append((rank, pickle.loads(value)))
    return out
