# Generated from minserve/scheduler/budget.py, minserve/scheduler/preemption.py, minserve/kvcache/swap.py by `python -m minserve.course.generate`;
# edit the marked regions there, not here.
"""Chapter 04, Chunked prefill and preemption: the scheduler's two decisions
when time or memory runs short, and the swap space a preempted sequence goes to.

`prefill_chunk`: how many tokens a sequence computes out of what is left of the
step's token budget (Sarathi-Serve's chunked prefill). `preemption_mode`:
whether a preempted sequence's blocks go to the host swap space or are freed and
recomputed (vLLM). `HostSwapSpace`: the account of the host memory swapped-out
blocks wait in. Plug yours into the engine with
`LLM(swap_space=0.05, plugins=CoursePlugins(chunk_rule=prefill_chunk,
preemption_rule=preemption_mode, swap_space_cls=HostSwapSpace))`.
"""

from __future__ import annotations

from minserve.config import CacheConfig
from minserve.kvcache.swap import GIB
from minserve.kvcache.swap import SwapSpaceFullError  # noqa: F401
from minserve.messages import DropSwapped, SwapIn, SwapOut
from minserve.scheduler.preemption import PreemptionMode


# Exercise 4.1: a sequence's share of the token budget
def prefill_chunk(num_needed: int, budget_left: int, enable_chunked_prefill: bool) -> int:
    """How many tokens a sequence computes this step, out of `budget_left`.

    `num_needed` is what it still has to compute (1 for a decode, the uncomputed rest
    of the prompt for a prefill). All of it when it fits; otherwise, with chunked
    prefill, a chunk of whatever budget is left; without chunked prefill, nothing (0:
    it waits for a step with room for the whole prompt). Never more than `budget_left`.
    """
    if num_needed <= budget_left:
        return num_needed
    return budget_left if enable_chunked_prefill else 0


# Exercise 4.2: recompute or swap a preempted sequence
def preemption_mode(num_blocks: int, block_nbytes: int, swap_free_bytes: int) -> PreemptionMode:
    """Swap a victim when the host swap space can hold all of its blocks, else recompute.

    The victim holds `num_blocks` blocks of `block_nbytes` bytes each; `swap_free_bytes`
    of the swap space are free (without swap space, both sizes are 0). Returns "swap" or
    "recompute". A sequence that holds no block has nothing to swap: it is recomputed.
    The blocks go whole or not at all: a sequence half on the host would need its other
    half recomputed anyway.
    """
    if num_blocks == 0 or swap_free_bytes == 0:
        return "recompute"
    return "swap" if num_blocks * block_nbytes <= swap_free_bytes else "recompute"


# Exercise 4.3: the host swap space's accounting
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
        return self.used_bytes + num_blocks * self.block_nbytes <= self.capacity_bytes

    def swap_out(self, key: int, blocks: list[int]) -> SwapOut:
        """Account for these blocks going to host memory under `key`; the caller frees them.

        All or nothing: when they do not fit, raise SwapSpaceFullError and change nothing.
        Returns SwapOut(key, the blocks as a tuple): the worker copies them out.
        """
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

    def swap_in(self, key: int, new_blocks: list[int]) -> SwapIn:
        """`key`'s blocks come back into `new_blocks` (fresh blocks, as many as went out);
        the host copy is released. Returns SwapIn(key, the new blocks as a tuple)."""
        if self.num_blocks(key) != len(new_blocks):
            raise ValueError(
                f"sequence {key!r} was swapped out with {self.num_blocks(key)} blocks, "
                f"but {len(new_blocks)} blocks were given to swap it in"
            )
        self.bytes_in += len(new_blocks) * self.block_nbytes
        self._release(key)
        return SwapIn(key, tuple(new_blocks))

    def discard(self, key: int) -> DropSwapped:
        """Drop `key`'s host copy without copying it back (the request was aborted)."""
        self._release(key)
        return DropSwapped(key)

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def num_blocks(self, key: int) -> int:
        """How many blocks `key` has swapped out (what swapping it in needs); KeyError when
        it has none there."""
        if key not in self._blocks:
            raise KeyError(f"sequence {key!r} is not swapped out")
        return self._blocks[key]

    def _release(self, key: int) -> None:
        """Give `key`'s bytes back to the swap space and forget it."""
        self.used_bytes -= self.num_blocks(key) * self.block_nbytes
        del self._blocks[key]
