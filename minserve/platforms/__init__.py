"""Platforms: where speed lives, one boundary per kind of device (`base.py` says what a
platform decides). `set_up_platform` is called once per model, by the loader."""

from __future__ import annotations

from dataclasses import replace

from minserve.execution import ExecutionConfig
from minserve.model.llama import CausalLM
from minserve.platforms.base import PLAIN, Platform
from minserve.platforms.cpu.platform import set_up_cpu
from minserve.platforms.cuda.platform import set_up_cuda


def set_up_platform(net: CausalLM, execution: ExecutionConfig) -> tuple[ExecutionConfig, Platform]:
    """Let the device's platform give `net` its paths; the config records what it chose."""
    if execution.device.type == "cpu":
        execution, platform = set_up_cpu(net, execution)
    elif execution.device.type == "cuda":
        execution, platform = set_up_cuda(net, execution)
    else:
        net.use_ops(PLAIN.ops)
        platform = PLAIN
    return replace(execution, platform=platform.name), platform


__all__ = ["Platform", "set_up_platform"]
