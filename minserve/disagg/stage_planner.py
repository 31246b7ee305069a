"""The stage planner of live migration's multi-stage pre-copy (Llumnix).

A request moves from a source decode instance to a destination while it decodes. Its full
KV blocks never change again, so they can be copied while the source keeps decoding: each
stage sends as many of the blocks not sent yet as one decode step hides (the stream never
waits on the copy), more only when that cannot keep up with the source. Only the final stage
pauses the request: it sends what is left (the full blocks not sent yet and the partly
filled last block) with the request's state, and the destination decodes from there. The
planner decides, before each stage, whether to pre-copy once more or to stop and go final.
"""

from __future__ import annotations

from typing import Final

FINAL: Final = "final"


# >>> exercise 11.5: the pre-copy stage planner
def next_stage(
    filled_blocks: int,
    sent_blocks: int,
    block_bytes: int,
    bandwidth_bytes_s: float,
    latency_s: float,
    step_s: float,
    tokens_per_block: int,
    stages_done: int,
    max_stages: int,
) -> range | str:
    """The next stage of a pre-copy: the block indices to copy now, or FINAL.

    filled_blocks: the request's full blocks on the source now (its computed tokens //
    tokens_per_block); sent_blocks: the first blocks the earlier stages copied; block_bytes:
    one block's KV, every layer; bandwidth_bytes_s and latency_s: the link to the
    destination; step_s: the source's measured decode step; stages_done: pre-copy stages so
    far; max_stages: how many the migration may take (0: stop-and-copy).

    Left to send are `dirty = filled_blocks - sent_blocks` full blocks; the final stage also
    carries the partly filled last block. Decide in this order:

    1. The pause going final now would cost is `latency_s + (dirty + 1) * block_bytes /
       bandwidth_bytes_s`. If it is at most one decode step (`step_s`), return FINAL.
    2. If `stages_done >= max_stages`, return FINAL (stop chasing the source).
    3. A pre-copy stage runs beside one of the source's decode steps and lasts
       `stage_s(n) = max(step_s, latency_s + n * block_bytes / bandwidth_bytes_s)` for n
       blocks; meanwhile the source fills `new(n) = stage_s(n) / step_s / tokens_per_block`
       blocks. Send as many as one step hides, `n = min(dirty, max(1, fits))` with `fits`
       the whole blocks that `step_s - latency_s` carries, so the stream never waits on the
       copy; if that makes no progress (`new(n) >= n`), send all `dirty` at once instead;
       if even that makes none (`new(dirty) >= dirty`), another stage would not shrink what
       is left: return FINAL.
    4. Otherwise copy those n blocks: return `range(sent_blocks, sent_blocks + n)`.
    """
    if step_s <= 0 or bandwidth_bytes_s <= 0 or tokens_per_block < 1:
        raise ValueError(
            f"step_s and bandwidth_bytes_s must be positive and tokens_per_block at least 1; "
            f"got {step_s}, {bandwidth_bytes_s}, {tokens_per_block}"
        )
    if sent_blocks > filled_blocks:
        raise ValueError(f"{sent_blocks} blocks sent but only {filled_blocks} filled")
    # >>> solution
    per_block = block_bytes / bandwidth_bytes_s
    dirty = filled_blocks - sent_blocks
    if latency_s + (dirty + 1) * per_block <= step_s or stages_done >= max_stages:
        return FINAL

    def new_blocks(n: int) -> float:  # what the source fills while n blocks travel
        return max(step_s, latency_s + n * per_block) / step_s / tokens_per_block

    fits = int((step_s - latency_s) // per_block)
    n = min(dirty, max(1, fits))
    if new_blocks(n) >= n:
        n = dirty
        if new_blocks(n) >= n:
            return FINAL
    return range(sent_blocks, sent_blocks + n)
    # <<< solution


# <<< exercise
