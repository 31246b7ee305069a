"""Host swap space: where a preempted sequence's KV blocks wait in CPU memory.

When the pool runs out, vLLM preempts a sequence either by recomputing (drop its blocks,
prefill again later) or by swapping (copy its blocks to host memory, bring them back into
fresh blocks when it is rescheduled). Swapping trades PCIe bandwidth for recompute FLOPs.

This is the scheduler's side: a byte budget and which sequence holds how many blocks
there. Each decision is returned as a block operation (`SwapOut`, `SwapIn`,
`DropSwapped`); the worker, which owns the memory, carries it out (`host_store.py`).
"""

from __future__ import annotations

from minserve.config import CacheConfig
from minserve.messages import DropSwapped, SwapIn, SwapOut

GIB = 1 << 30


class SwapSpaceFullError(RuntimeError):
    """The host swap space cannot hold a sequence's blocks; recompute it instead."""


# >>> exercise 4.3: the host swap space's accounting
class HostSwapSpace:
    """A byte-budgeted account of swapped-out sequences' KV blocks, keyed by sequence id.

    Each sequence swapped out (`swap_out`) holds `len(blocks) * block_nbytes` bytes of the
    host swap space until it is swapped back in (`swap_in`) or dropped (`discard`); the
    byte counters `bytes_out` and `bytes_in` only grow. Every method returns the block
    operation the worker carries out, and refuses what it cannot account for: a full
    swap space (`SwapSpaceFullError`), a sequence swapped out twice or swapped in with the
    wrong number of blocks (`ValueError`), an unknown sequence (`KeyError`).
    """

    def __init__(self, capacity_bytes: int, block_nbytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.block_nbytes = block_nbytes
        self.used_bytes = 0
        self.bytes_out = 0  # total copied pool -> host
        self.bytes_in = 0  # total copied host -> pool
        self._blocks: dict[int, int] = {}  # sequence id -> blocks it has on the host

    @classmethod
    def from_config(cls, cache_config: CacheConfig, block_nbytes: int) -> HostSwapSpace:
        """A swap space of `cache_config.swap_space` GiB (vLLM's option)."""
        return cls(int(cache_config.swap_space * GIB), block_nbytes)

    def can_swap_out(self, num_blocks: int) -> bool:
        """Whether `num_blocks` more blocks fit (exactly full is fine)."""
        # >>> solution
        return self.used_bytes + num_blocks * self.block_nbytes <= self.capacity_bytes
        # <<< solution

    def swap_out(self, key: int, blocks: list[int]) -> SwapOut:
        """Account for these blocks going to host memory under `key`; the caller frees them.

        All or nothing: when they do not fit, raise SwapSpaceFullError and change nothing.
        Returns SwapOut(key, the blocks as a tuple): the worker copies them out.
        """
        # >>> solution
        if key in self._blocks:
            raise ValueError(f"sequence {key!r} is already swapped out")
        nbytes = len(blocks) * self.block_nbytes
        if not self.can_swap_out(len(blocks)):
            raise SwapSpaceFullError(
                f"swapping out {len(blocks)} blocks needs {nbytes} bytes, but only "
                f"{self.capacity_bytes - self.used_bytes} of {self.capacity_bytes} bytes are "
                "free; raise swap_space or recompute instead"
            )
        self._blocks[key] = len(blocks)
        self.used_bytes += nbytes
        self.bytes_out += nbytes
        return SwapOut(key, tuple(blocks))
        # <<< solution

    def swap_in(self, key: int, new_blocks: list[int]) -> SwapIn:
        """`key`'s blocks come back into `new_blocks` (fresh blocks, as many as went out);
        the host copy is released. Returns SwapIn(key, the new blocks as a tuple)."""
        # >>> solution
        if self.num_blocks(key) != len(new_blocks):
            raise ValueError(
                f"sequence {key!r} was swapped out with {self.num_blocks(key)} blocks, "
                f"but {len(new_blocks)} blocks were given to swap it in"
            )
        self.bytes_in += len(new_blocks) * self.block_nbytes
        self._release(key)
        return SwapIn(key, tuple(new_blocks))
        # <<< solution

    def discard(self, key: int) -> DropSwapped:
        """Drop `key`'s host copy without copying it back (the request was aborted)."""
        # >>> solution
        self._release(key)
        return DropSwapped(key)
        # <<< solution

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def num_blocks(self, key: int) -> int:
        """How many blocks `key` has swapped out (what swapping it in needs); KeyError when
        it has none there."""
        # >>> solution
        if key not in self._blocks:
            raise KeyError(f"sequence {key!r} is not swapped out")
        return self._blocks[key]
        # <<< solution

    def _release(self, key: int) -> None:
        """Give `key`'s bytes back to the swap space and forget it."""
        # >>> solution
        self.used_bytes -= self.num_blocks(key) * self.block_nbytes
        del self._blocks[key]
        # <<< solution


# <<< exercise
