"""A platform: what was decided at load for one model on one kind of device.

A platform (`cpu/`, `cuda/`) looks at the model once, when it is loaded, and settles how it
runs: which ops the layers compute with, which kernel each linear layer runs (its plan),
which attention backend serves the KV format (`attention/backends.py`) and which model
runner runs the step. It writes what it chose into the execution config, which the start-up
line prints. Nothing on the hot path asks again; the model file never asks at all.

vLLM's `vllm/platforms/` has the same idea: a platform object per device kind, consulted
once to pick the attention backend, the communicator and the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

from minserve.attention.metadata import PagedKVCache
from minserve.model.llama import CausalLM
from minserve.model.ops import MODEL_OPS, ModelOps
from minserve.model.runner import ModelRunner


@dataclass(frozen=True)
class Platform:
    """A model's platform decisions: the ops its layers compute with, and its runner.

    The plain platform, this class itself, runs minserve's torch ops through the plain
    model runner: the path a reader follows in the chapters."""

    name: str = "torch"
    ops: ModelOps = MODEL_OPS

    def runner(self, model: CausalLM, kv: PagedKVCache, backend: type) -> ModelRunner:
        """The model runner for one engine's pool and attention backend."""
        return ModelRunner(model, kv, backend)

    def plan_new_layers(self, model: CausalLM) -> int:
        """Give the platform's kernels to quantized layers made after the model was loaded
        (a model quantized in place, chapter 10); how many. The plain platform has none."""
        return 0


PLAIN = Platform()
