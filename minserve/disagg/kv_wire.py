"""Which torch.distributed backend carries the KV: NCCL between GPUs, gloo otherwise.

Control messages (JSON: offers, acks, reports, commands) always go through gloo on CPU
tensors, so a dead peer ends a wait with an error. The KV blocks take the fastest road
torch.distributed has between the two pools:

- every instance on its own GPU (and NCCL built in): the group is created with the
  backend string "cpu:gloo,cuda:nccl", and torch routes each `send`/`recv` by the
  tensor's device: JSON on the host over gloo, KV blocks straight from GPU memory over
  NCCL (NVLink, PCIe or RDMA; no host copy). NCCL creates each pair's communicator on the
  pair's first transfer, so the proxy, which never sends a GPU tensor, needs no GPU;
- otherwise (CPUs, or instances sharing one GPU, which NCCL refuses): gloo, and the blocks
  are copied to the host to travel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

MIXED_BACKEND = "cpu:gloo,cuda:nccl"
HOST = torch.device("cpu")  # where KV travels over gloo


@dataclass(frozen=True)
class KVWire:
    """The group's backend string and the device KV tensors travel from ("cpu" or "cuda")."""

    backend: str
    device_type: str

    def device(self, gpu_index: int) -> torch.device:
        """Where this rank's KV tensors live while they travel."""
        if self.device_type == "cuda":
            return torch.device("cuda", gpu_index)
        return HOST


def choose_kv_wire(
    device: str,
    num_instances: int,
    num_gpus: int | None = None,
    nccl_available: bool | None = None,
) -> KVWire:
    """NCCL when the instances' pools are on CUDA, one GPU each; gloo through the host otherwise.

    device: the engines' device option ("auto", "cpu", "cuda"). num_gpus and
    nccl_available default to what this machine has (tests pass them to check the rule).
    """
    if num_gpus is None:
        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nccl_available is None:
        nccl_available = dist.is_nccl_available()
    on_gpu = device.startswith("cuda") or (device == "auto" and num_gpus > 0)
    if on_gpu and nccl_available and num_gpus >= num_instances:
        return KVWire(MIXED_BACKEND, "cuda")
    return KVWire("gloo", "cpu")


def instance_gpu(instance_index: int, num_gpus: int) -> int:
    """The GPU of the instance_index-th instance on this node (0-based; round robin)."""
    return instance_index % max(num_gpus, 1)
