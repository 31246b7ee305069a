"""A stand-in for torch.cuda's device calls that answers as real CUDA does (DESIGN.md 3).

`set_device` reads its argument with torch's own rule (`torch.cuda._utils._get_device_index`,
the first line of the real `torch.cuda.set_device`): a device without an index, or not a
CUDA one, is refused with torch's message; an index past the last GPU fails as the driver
does ("invalid device ordinal"); a negative one does nothing. The current device belongs to
the calling thread, and a new thread starts on GPU 0, as in the CUDA runtime.
"""

from __future__ import annotations

import threading

import torch
from torch.cuda._utils import _get_device_index


class SimulatedCuda:
    """`count` simulated GPUs: what `set_device` was asked, and each thread's current GPU."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.calls: list[torch.device] = []  # every device made current, in order
        self._current: dict[int, int] = {}  # thread id -> its current GPU

    def set_device(self, device: torch.device | str | int) -> None:
        index = _get_device_index(device)  # torch's ValueError for "cuda" or "cpu"
        if index < 0:
            return  # real torch: a no-op
        if index >= self.count:
            raise torch.AcceleratorError("CUDA error: invalid device ordinal")
        self._current[threading.get_ident()] = index
        self.calls.append(torch.device("cuda", index))

    def current_device(self) -> int:
        """The calling thread's current GPU (0 until it sets one)."""
        return self._current.get(threading.get_ident(), 0)
