# Your workspace for chapter 04 (Chunked prefill and preemption): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 04` from the repository root.
# Generated from minserve/scheduler/budget.py, minserve/scheduler/preemption.py, minserve/kvcache/swap.py by `python -m minserve.course.generate`.
# stub fingerprint: ee45f6282591 (lets the generator tell your edits from a stale stub)
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
    raise NotImplementedError("Exercise 4.1: a sequence's share of the token budget")


# Exercise 4.2: recompute or swap a preempted sequence
def preemption_mode(num_blocks: int, block_nbytes: int, swap_free_bytes: int) -> PreemptionMode:
    """Swap a victim when the host swap space can hold all of its blocks, else recompute.

    The victim holds `num_blocks` blocks of `block_nbytes` bytes each; `swap_free_bytes`
    of the swap space are free (without swap space, both sizes are 0). Returns "swap" or
    "recompute". A sequence that holds no block has nothing to swap: it is recomputed.
    The blocks go whole or not at all: a sequence half on the host would need its other
    half recomputed anyway.
    """
    raise NotImplementedError("Exercise 4.2: recompute or swap a preempted sequence")


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
        raise NotImplementedError("Exercise 4.3: the host swap space's accounting")

    def swap_out(self, key: int, blocks: list[int]) -> SwapOut:
        """Account for these blocks going to host memory under `key`; the caller frees them.

        All or nothing: when they do not fit, raise SwapSpaceFullError and change nothing.
        Returns SwapOut(key, the blocks as a tuple): the worker copies them out.
        """
        raise NotImplementedError("Exercise 4.3: the host swap space's accounting")

    def swap_in(self, key: int, new_blocks: list[int]) -> SwapIn:
        """`key`'s blocks come back into `new_blocks` (fresh blocks, as many as went out);
        the host copy is released. Returns SwapIn(key, the new blocks as a tuple)."""
        raise NotImplementedError("Exercise 4.3: the host swap space's accounting")

    def discard(self, key: int) -> DropSwapped:
        """Drop `key`'s host copy without copying it back (the request was aborted)."""
        raise NotImplementedError("Exercise 4.3: the host swap space's accounting")

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def num_blocks(self, key: int) -> int:
        """How many blocks `key` has swapped out (what swapping it in needs); KeyError when
        it has none there."""
        raise NotImplementedError("Exercise 4.3: the host swap space's accounting")

    def _release(self, key: int) -> None:
        """Give `key`'s bytes back to the swap space and forget it."""
        raise NotImplementedError("Exercise 4.3: the host swap space's accounting")
