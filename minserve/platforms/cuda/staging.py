"""A step's host values copied to the GPU from page-locked memory, without blocking.

`torch.tensor(values, device="cuda")` copies from pageable memory: the driver first copies
into a page-locked buffer of its own and the host waits for the transfer. A decode step
builds about seven such small tensors (ids, positions, slots, block tables, ...), so the
host would stall seven times a step. Here the runner keeps one page-locked arena; each
tensor of a step takes the next aligned region of it and is copied with `non_blocking=True`,
queued on the stream ahead of the kernels that read it. The arena is reused from the start
at the next step: by then the step's sampled tokens have been read back, so its copies are
done (a region is never rewritten while its copy may be pending).
"""

from __future__ import annotations

import torch

ALIGN = 64  # bytes: each region starts on a cache line


class PinnedStaging:
    """One page-locked byte arena, handed out region by region within a step."""

    def __init__(self, device: torch.device, pinned: bool = True, size: int = 1 << 16) -> None:
        self.device = device
        self.pinned = pinned  # False only where no CUDA driver can pin (tests on a CPU)
        self.arena = self._allocate(size)
        self.retired: list[torch.Tensor] = []  # arenas outgrown this step, kept until reset
        self.used = 0

    def _allocate(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)

    def reset(self) -> None:
        """A new step: every earlier copy has completed, so the arena is free again."""
        self.used = 0
        self.retired.clear()

    def region(self, nbytes: int) -> torch.Tensor:
        """The next `nbytes` of the arena (grown, never moved under a pending copy)."""
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > self.arena.numel():
            self.retired.append(self.arena)  # its regions may still be copying
            self.arena = self._allocate(max(2 * self.arena.numel(), nbytes))
            start = 0
        self.used = start + nbytes
        return self.arena[start : start + nbytes]

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """host (a CPU tensor) -> the same values on the device, copied asynchronously."""
        nbytes = host.numel() * host.element_size()
        staged = self.region(nbytes).view(host.dtype).view(host.shape)
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)
