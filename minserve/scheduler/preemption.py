"""Recompute or swap: what happens to a preempted sequence's KV blocks (vLLM).

When the KV pool runs out of blocks, the scheduler takes a running sequence off the
batch. Its blocks are either freed and its tokens computed again later, as one prefill
(recompute: costs compute), or copied to the host swap space and copied back into fresh
blocks when it is rescheduled (swap: costs memory traffic and host memory). minserve
swaps whenever the swap space (`swap_space`, GiB) has room for all of the victim's
blocks, and recomputes otherwise.
"""

from __future__ import annotations

from typing import Literal

PreemptionMode = Literal["swap", "recompute"]


# >>> exercise 4.2: recompute or swap a preempted sequence
def preemption_mode(num_blocks: int, block_nbytes: int, swap_free_bytes: int) -> PreemptionMode:
    """Swap a victim when the host swap space can hold all of its blocks, else recompute.

    The victim holds `num_blocks` blocks of `block_nbytes` bytes each; `swap_free_bytes`
    of the swap space are free (without swap space, both sizes are 0). Returns "swap" or
    "recompute". A sequence that holds no block has nothing to swap: it is recomputed.
    The blocks go whole or not at all: a sequence half on the host would need its other
    half recomputed anyway.
    """
    # >>> solution
    if num_blocks == 0 or swap_free_bytes == 0:
        return "recompute"
    return "swap" if num_blocks * block_nbytes <= swap_free_bytes else "recompute"
    # <<< solution


# <<< exercise
