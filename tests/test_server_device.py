"""The server's engine thread runs on the engine's GPU: CUDA's current device is per
thread (a new thread starts on GPU 0), so the loop must make the engine's device current
in its own thread before it steps. Checked with the stand-in that answers as CUDA does."""

from __future__ import annotations

import threading

import torch

from minserve.config import SchedulerConfig
from minserve.server.async_engine import AsyncEngine
from minserve.server.metrics import ServerMetrics


class DeviceRecordingEngine:
    """An `EngineClient` with nothing to run: it notes the current GPU of each thread
    that asks it for metrics (the loop does, first thing)."""

    scheduler_config = SchedulerConfig()

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.loop_ran = threading.Event()

    def get_metrics(self) -> dict[str, float]:
        self.seen[threading.current_thread().name] = torch.cuda.current_device()
        if threading.current_thread() is not threading.main_thread():
            self.loop_ran.set()
        return {}

    def has_unfinished_requests(self) -> bool:
        return False


def run_loop_once(device: torch.device | None) -> dict[str, int]:
    engine = DeviceRecordingEngine()
    loop = AsyncEngine(engine, ServerMetrics(), device=device).start()  # type: ignore[arg-type]
    try:
        assert engine.loop_ran.wait(10), "the engine loop never started"
    finally:
        loop.shutdown()
    return engine.seen


def test_the_engine_thread_makes_the_engines_gpu_current(gpus) -> None:
    gpus(2)
    seen = run_loop_once(torch.device("cuda", 1))
    assert seen == {"MainThread": 0, "minserve-engine": 1}  # the caller's thread untouched


def test_without_the_device_a_new_thread_is_on_gpu_0(gpus) -> None:
    """The stand-in's per-thread rule, which the test above relies on."""
    gpus(2)
    torch.cuda.set_device(1)
    assert run_loop_once(None) == {"MainThread": 1, "minserve-engine": 0}


def test_a_cpu_engine_sets_no_gpu(gpus) -> None:
    cuda = gpus(0)
    run_loop_once(torch.device("cpu"))
    assert cuda.calls == []
