"""The token budget of a step, shared out chunk by chunk (Sarathi-Serve's chunked prefill).

A step may compute at most `max_num_batched_tokens` tokens. The scheduler visits the
running sequences, decodes first, then the waiting ones, and asks each how many tokens
it computes out of what is left of the budget. A decode needs one token; a prefill
needs the rest of its prompt. With chunked prefill, a prompt that does not fit takes
what is left (a chunk) and finishes in later steps; without it, a prompt runs whole or
not at all.
"""

from __future__ import annotations


# >>> exercise 4.1: a sequence's share of the token budget
def prefill_chunk(num_needed: int, budget_left: int, enable_chunked_prefill: bool) -> int:
    """How many tokens a sequence computes this step, out of `budget_left`.

    `num_needed` is what it still has to compute (1 for a decode, the uncomputed rest
    of the prompt for a prefill). All of it when it fits; otherwise, with chunked
    prefill, a chunk of whatever budget is left; without chunked prefill, nothing (0:
    it waits for a step with room for the whole prompt). Never more than `budget_left`.
    """
    # >>> solution
    if num_needed <= budget_left:
        return num_needed
    return budget_left if enable_chunked_prefill else 0
    # <<< solution


# <<< exercise
