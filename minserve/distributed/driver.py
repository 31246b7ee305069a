"""Rank 0's side of a tensor-parallel step: its pool and its model runner, with a broadcast.

The engine on rank 0 is the ordinary `LLMEngine` (scheduler, block tables, sampler) given
two parts that talk to the other ranks:

- `MirroredKVPool`: a copy-on-write block copy the scheduler makes in rank 0's pool is
  queued, so every rank makes it in its own pool (their K/V are other heads, same blocks).
- `DriverRunner`: before running the forward, it broadcasts the prepared batch and the
  queued copies; the workers run the same forward on their heads (`worker.serve_steps`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from minserve.distributed import step_message
from minserve.distributed.step_message import StepMessage
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.model.runner import ModelInputs, ModelRunner

SWAP_UNSUPPORTED = (
    "swap_space > 0 is not supported with tensor_parallel_size > 1 (each rank would need "
    "its own host copy of its heads); use swap_space=0: preempted sequences are recomputed"
)


class MirroredKVPool(PagedKVPool):
    """Rank 0's paged KV pool: block copies are made here and queued for the other ranks."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.pending_copies: list[tuple[int, int]] = []

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        super().copy_blocks(copies)
        self.pending_copies += copies

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        raise NotImplementedError(SWAP_UNSUPPORTED)

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        raise NotImplementedError(SWAP_UNSUPPORTED)


class DriverRunner(ModelRunner):
    """`ModelRunner` for rank 0: each forward is broadcast to the workers first."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv: MirroredKVPool,
        backend: type,
        control: dist.ProcessGroup,
        on_failure: Callable[[Exception], Exception],
    ) -> None:
        super().__init__(model, kv, backend)
        self.control = control
        self.on_failure = on_failure  # turns a collective's error into a clear one

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        return self._with_workers(super().forward, inputs)

    def forward_greedy(self, inputs: ModelInputs) -> torch.Tensor:
        return self._with_workers(super().forward_greedy, inputs)

    def _with_workers(
        self, run: Callable[[ModelInputs], torch.Tensor], inputs: ModelInputs
    ) -> torch.Tensor:
        """Send the workers the step, then run our share of it (they run `forward`)."""
        try:
            step_message.send(StepMessage(inputs, self.kv.take_copies()), self.control)
            return run(inputs)
        except (RuntimeError, dist.DistError) as e:
            raise self.on_failure(e) from e
