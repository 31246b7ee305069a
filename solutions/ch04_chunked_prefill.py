# Generated from minserve/scheduler/budget.py, minserve/scheduler/preemption.py by `python -m minserve.course.generate`;
# edit the marked regions there, not here.
"""Chapter 04, Chunked prefill and preemption: the scheduler's two decisions
when time or memory runs short.

`prefill_chunk`: how many tokens a sequence computes out of what is left of the
step's token budget (Sarathi-Serve's chunked prefill). `preemption_mode`:
whether a preempted sequence's blocks go to the host swap space or are freed and
recomputed (vLLM). Plug yours into the engine with
`LLM(chunk_rule=prefill_chunk, preemption_rule=preemption_mode)`.
"""

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
