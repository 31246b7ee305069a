"""Host swap space: where a preempted sequence's KV blocks wait in CPU memory.

When the pool runs out, vLLM preempts a sequence either by recomputing (drop its blocks,
prefill again later) or by swapping (copy its blocks to host memory, bring them back into
fresh blocks when it is rescheduled). Swapping trades PCIe bandwidth for recompute FLOPs.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from minserve.config import CacheConfig
from minserve.kvcache.paged_pool import PagedKVPool

GIB = 1 << 30


class SwapSpaceFullError(RuntimeError):
    """The host swap space cannot hold a sequence's blocks; recompute it instead."""


class HostSwapSpace:
    """A byte-budgeted store of swapped-out sequences' KV blocks, keyed by sequence."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.bytes_out = 0  # total copied pool -> host
        self.bytes_in = 0  # total copied host -> pool
        self._stored: dict[Hashable, torch.Tensor] = {}  # [layers, 2, blocks, bs, Hkv, D]

    @classmethod
    def from_config(cls, cache_config: CacheConfig) -> HostSwapSpace:
        """A swap space of `cache_config.swap_space` GiB (vLLM's option)."""
        return cls(int(cache_config.swap_space * GIB))

    def can_swap_out(self, num_blocks: int, bytes_per_block: int) -> bool:
        """Whether `num_blocks` more blocks of `bytes_per_block` bytes fit."""
        return self.used_bytes + num_blocks * bytes_per_block <= self.capacity_bytes

    def swap_out(self, seq_key: Hashable, pool: PagedKVPool, blocks: list[int]) -> None:
        """Copy these blocks of `pool` to host memory under `seq_key`; the caller frees them."""
        if seq_key in self._stored:
            raise ValueError(f"sequence {seq_key!r} is already swapped out")
        if not self.can_swap_out(len(blocks), pool.block_nbytes):
            raise SwapSpaceFullError(
                f"swapping out {len(blocks)} blocks needs {len(blocks) * pool.block_nbytes} "
                f"bytes, but only {self.capacity_bytes - self.used_bytes} of "
                f"{self.capacity_bytes} bytes are free; raise swap_space or recompute instead"
            )
        data = pool.read_blocks(blocks)
        self._stored[seq_key] = data
        self.used_bytes += _nbytes(data)
        self.bytes_out += _nbytes(data)

    def swap_in(self, seq_key: Hashable, pool: PagedKVPool, new_blocks: list[int]) -> None:
        """Copy `seq_key`'s blocks back into `new_blocks` of `pool` and release the host copy."""
        data = self._get(seq_key)
        if data.shape[2] != len(new_blocks):
            raise ValueError(
                f"sequence {seq_key!r} was swapped out with {data.shape[2]} blocks, "
                f"but {len(new_blocks)} blocks were given to swap it in"
            )
        pool.write_blocks(new_blocks, data)
        self.bytes_in += _nbytes(data)
        self.discard(seq_key)

    def discard(self, seq_key: Hashable) -> None:
        """Drop `seq_key`'s host copy without copying it back (the request was aborted)."""
        self.used_bytes -= _nbytes(self._get(seq_key))
        del self._stored[seq_key]

    def __contains__(self, seq_key: Hashable) -> bool:
        return seq_key in self._stored

    def num_blocks(self, seq_key: Hashable) -> int:
        """How many blocks `seq_key` has swapped out (what swapping it in needs)."""
        return self._get(seq_key).shape[2]

    def _get(self, seq_key: Hashable) -> torch.Tensor:
        if seq_key not in self._stored:
            raise KeyError(f"sequence {seq_key!r} is not swapped out")
        return self._stored[seq_key]


def _nbytes(data: torch.Tensor) -> int:
    return data.numel() * data.element_size()
