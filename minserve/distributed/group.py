"""Joining a tensor-parallel group: ports, devices, and the two process groups every rank uses.

- The *compute* group (torch.distributed's default group: gloo on CPUs, NCCL on GPUs) runs
  the model's all-reduces and the logits gather, with a step timeout so a stuck rank
  becomes an error instead of a hang.
- The *control* group (always gloo, on CPU tensors) carries rank 0's step broadcasts. A
  worker waits on it between requests for as long as the server is idle, so its timeout
  is long; a dead rank 0 still ends the wait, because gloo notices the closed socket.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from minserve.device import rank_device, use_device
from minserve.distributed.comm import ProcessGroupComm

IDLE_TIMEOUT = timedelta(days=30)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody is listening on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def this_rank_device(device: str, rank: int) -> torch.device:
    """This rank's device (`minserve.device.rank_device`; torchrun's LOCAL_RANK when set),
    made the process's current device."""
    local_rank = os.environ.get("LOCAL_RANK")
    target = rank_device(device, rank, None if local_rank is None else int(local_rank))
    use_device(target)
    return target


@dataclass(frozen=True)
class RankGroup:
    """One rank's membership: the compute communicator and the control group."""

    comm: ProcessGroupComm
    control: dist.ProcessGroup

    @property
    def rank(self) -> int:
        return self.comm.rank


def join_group(
    rank: int, world_size: int, init_method: str | None, device: torch.device, step_timeout: float
) -> RankGroup:
    """Join (or, under torchrun, reuse) the default group, then create the control group.

    init_method None means the group exists already (torchrun launched this process and
    called init_process_group, or will via the environment: MASTER_ADDR, MASTER_PORT...).
    """
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method or "env://",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=step_timeout),
            device_id=device if device.type == "cuda" else None,
        )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return RankGroup(ProcessGroupComm(), control)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
