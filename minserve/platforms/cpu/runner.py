"""The CPU model runner: the plain runner, with a decode step's layers in one C call and
greedy rows read through a bfloat16 screen of the head.

Both are the same computation as the plain runner's, bit for bit (`fused_decode.py`) or
token for token (`greedy_head.py`); they only take the interpreter, or half the head's
bytes, out of the step. Each applies where its conditions hold and otherwise hands the
step to the plain path.
"""

from __future__ import annotations

import torch

from minserve.attention.metadata import PagedKVCache
from minserve.model.llama import AttentionFn, CausalLM
from minserve.model.runner import ModelInputs, ModelRunner
from minserve.platforms.cpu.fused_decode import FusedDecode
from minserve.platforms.cpu.greedy_head import GreedyScreen, screens
from minserve.platforms.cpu.ops import C_KERNEL_OPS


class CpuModelRunner(ModelRunner):
    """`ModelRunner` with the CPU's C decode loop and greedy head screen."""

    def __init__(
        self,
        model: CausalLM,
        kv: PagedKVCache,
        backend: type,
        fused: bool = False,
        screen: GreedyScreen | None = None,
    ) -> None:
        super().__init__(model, kv, backend)
        self.fused_decode = FusedDecode(model) if fused else None
        self.screen = screen

    def decoder(
        self, inputs: ModelInputs, attention: AttentionFn, num_layers: int | None
    ) -> torch.Tensor:
        """A decode step whose every layer runs C kernels: the layers from one C call."""
        model = self.model
        if self.fused_decode is not None and num_layers is None and model.ops is C_KERNEL_OPS:
            x = model.model.embed_tokens(inputs.input_ids)  # [T, hidden]
            rotation = model.rope(inputs.positions, x.dtype, model.ops)
            hidden = self.fused_decode(x, rotation.cos, rotation.sin, attention)
            if hidden is not None:
                return model.final_norm(hidden)
        return super().decoder(inputs, attention, num_layers)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The fp32 argmax, found through the bfloat16 screen for a few rows."""
        if self.screen is not None and screens(hidden):
            return self.screen.tokens(hidden)
        return super().greedy_tokens(hidden)
