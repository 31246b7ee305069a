"""Rank 0's side of a tensor-parallel step: hand it to the other ranks, then run our share.

The engine on rank 0 is the ordinary `LLMEngine` (scheduler, block tables, sampler) whose
worker holds rank 0's shard and its own KV pool. `BroadcastPeers` is that worker's
`peers`: before each forward it broadcasts the prepared batch and the step's block
operations; every other rank carries out the same block operations on its own pool and
host memory (their K/V are other heads of the same blocks) and runs the same forward on
its heads (`worker.serve_steps`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from minserve.distributed import step_message
from minserve.distributed.step_message import StepMessage
from minserve.messages import BlockOp
from minserve.model.runner import ModelInputs
from minserve.worker.memory import measure_kv_cache_budget
from minserve.worker.pool_size import MeasureBudget, PoolRequest, agree_pool_blocks


class BroadcastPeers:
    """Sends each step to ranks 1..N-1 (`StepPeers` for rank 0's worker); sizes the KV
    pools with them (`PoolPeers`)."""

    def __init__(
        self,
        control: dist.ProcessGroup,
        on_failure: Callable[[Exception], Exception],
        measure: MeasureBudget = measure_kv_cache_budget,
    ) -> None:
        self.control = control
        self.on_failure = on_failure  # turns a collective's error into a clear one
        self.measure = measure

    def agree_pool_blocks(self, request: PoolRequest, model: torch.nn.Module) -> int:
        """The pool's block count, the smallest any rank affords (every rank measures)."""
        try:
            return agree_pool_blocks(self.control, request, model, self.measure)
        except (RuntimeError, dist.DistError) as e:
            raise self.on_failure(e) from e

    def send(self, inputs: ModelInputs | None, block_ops: tuple[BlockOp, ...]) -> None:
        try:
            step_message.send(StepMessage(inputs, block_ops), self.control)
        except (RuntimeError, dist.DistError) as e:
            raise self.on_failure(e) from e

    def failure(self, error: Exception) -> Exception:
        """A forward's collective failed: which ranks died, and what they reported."""
        return self.on_failure(error)
