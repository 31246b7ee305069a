"""Warm-up: run the step shapes a server will meet once, before the first request.

Triton compiles a kernel the first time it runs with a new specialization (data type, head
size, and which integer arguments are 1 or multiples of 16), and a serving GPU would pay
that inside the first requests' TTFT. So at start the worker runs three made-up steps
through its real path (`Worker.execute`):

    a prefill chunk         store + prefill kernel, no earlier context
    an extend chunk         store + prefill kernel over cached context
    decodes                 store + decode kernel, one short context and one long enough
                            to split (flash-decoding's second pass)

The steps write into pool blocks the allocator still counts as free; every block is
written before it is read, so what they leave behind is never seen. With tensor
parallelism the other ranks run the same steps (the worker hands each step to them).
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

from minserve.attention.triton_decode import MIN_TOKENS_PER_SPLIT
from minserve.messages import ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from minserve.worker.worker import Worker

WARMUP_ID = "warm-up"


def warm_up(worker: Worker, max_num_batched_tokens: int) -> float:
    """Run the warm-up steps; the seconds they took (mostly compiling)."""
    block_size, num_blocks = worker.pool.block_size, worker.pool.num_blocks
    if num_blocks < 4:
        return 0.0  # a pool this small serves no real traffic
    prefill = max(2, min(max_num_batched_tokens, 256, (num_blocks * block_size) // 4))
    long_context = min(2 * MIN_TOKENS_PER_SPLIT, (num_blocks // 2) * block_size)
    seq_ids = itertools.count(-1, -1)  # negative: never a scheduler's sequence id
    start = time.perf_counter()
    steps = [  # the two decodes write different slots of the same blocks
        [_chunk(next(seq_ids), 0, prefill, block_size)],
        [_chunk(next(seq_ids), prefill, prefill // 2, block_size)],
        [
            _chunk(next(seq_ids), 1, 1, block_size),
            _chunk(next(seq_ids), long_context - 1, 1, block_size),
        ],
    ]
    for chunks in steps:
        worker.execute(SchedulerOutput(chunks=tuple(chunks)))
    worker.release([c.seq_id for chunks in steps for c in chunks])
    return time.perf_counter() - start


def _chunk(seq_id: int, start: int, count: int, block_size: int) -> ScheduledChunk:
    """Tokens [start, start + count) of a made-up sequence in blocks 0, 1, ... (none
    sampled)."""
    needed = -(-(start + count) // block_size)
    return ScheduledChunk(
        seq_id=seq_id,
        request_id=WARMUP_ID,
        token_ids=(0,) * count,
        start=start,
        block_table=tuple(range(needed)),
        num_prompt_tokens=start + count,
    )
