"""The CUDA model runner: the plain runner, its step inputs staged in page-locked memory."""

from __future__ import annotations

import torch

from minserve.attention.metadata import PagedKVCache
from minserve.model.llama import CausalLM
from minserve.model.runner import ModelRunner
from minserve.platforms.cuda.staging import PinnedStaging


class CudaModelRunner(ModelRunner):
    """`ModelRunner` whose host-to-device copies go through a `PinnedStaging` arena."""

    def __init__(
        self, model: CausalLM, kv: PagedKVCache, backend: type, pinned: bool = True
    ) -> None:
        super().__init__(model, kv, backend)
        self.staging = PinnedStaging(self.device, pinned)

    def begin_step(self) -> None:
        self.staging.reset()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return self.staging.to_device(host)
