"""Warm-up: run every kernel variant a server will meet once, before the first request.

Triton compiles a kernel the first time it runs with a new specialization (data types,
constexprs, and which integer arguments are 1 or multiples of 16), and a serving GPU would
pay that inside the first requests' TTFT. The integers that change from step to step
(block-table strides, split counts) are marked `do_not_specialize` in the kernels, so what
is left to compile is one variant per kernel path and split count. At start the worker
runs made-up steps through its real path (`Worker.execute`):

    a prefill chunk         store + prefill kernel, no earlier context
    an extend chunk         store + prefill kernel over cached context
    a mixed step            a decode and a chunk in one step, decode rows first
    one decode per variant  every split count's kernels (`decode_variants`): one pass
                            (output in the model's dtype), and each BLOCK_SPLITS of
                            flash-decoding (fp32 parts, then the combine kernel)

The steps write into pool blocks the allocator still counts as free; every block is
written before it is read, so what they leave behind is never seen. With tensor
parallelism the other ranks run the same steps (the worker hands each step to them).
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

import torch

from minserve.attention.triton_decode import (
    MIN_TOKENS_PER_SPLIT,
    decode_variant,
    split_plan,
)
from minserve.messages import ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from minserve.worker.worker import Worker

WARMUP_ID = "warm-up"
MAX_SPLITS = 64  # choose_num_splits' cap


def decode_variants(num_kv_heads: int, max_context: int, device: torch.device) -> dict[int, int]:
    """Every decode variant (`decode_variant`) the split chooser can pick for contexts up
    to `max_context`, each with the shortest context of one sequence that picks it.

    One sequence reaches them all: the chooser wants the most splits for the fewest
    sequences, and k splits need a context of k x MIN_TOKENS_PER_SPLIT tokens."""
    found: dict[int, int] = {}
    for k in range(1, MAX_SPLITS + 1):
        context = k * MIN_TOKENS_PER_SPLIT if k > 1 else 2
        if context > max_context:
            break
        num_splits, _ = split_plan(1, num_kv_heads, context, device)
        found.setdefault(decode_variant(num_splits), context)
    return found


def warm_up_steps(
    block_size: int, num_blocks: int, max_num_batched_tokens: int, variants: dict[int, int]
) -> list[list[ScheduledChunk]]:
    """The warm-up's steps (see the module's docstring), in blocks 0, 1, ..."""
    prefill = max(2, min(max_num_batched_tokens, 256, (num_blocks * block_size) // 4))
    seq_ids = itertools.count(-1, -1)  # negative: never a scheduler's sequence id
    steps = [
        [_chunk(next(seq_ids), 0, prefill, block_size)],
        [_chunk(next(seq_ids), prefill, prefill // 2, block_size)],
        [_chunk(next(seq_ids), 1, 1, block_size), _chunk(next(seq_ids), 0, prefill, block_size)],
    ]
    for context in sorted(variants.values()):
        steps.append([_chunk(next(seq_ids), context - 1, 1, block_size)])
    return steps


def warm_up(worker: Worker, max_num_batched_tokens: int) -> float:
    """Run the warm-up steps; the seconds they took (mostly compiling)."""
    pool = worker.pool
    if pool.num_blocks < 4:
        return 0.0  # a pool this small serves no real traffic
    kv_heads = pool.k_cache(0).shape[2]
    variants = decode_variants(kv_heads, pool.num_blocks * pool.block_size, pool.device)
    steps = warm_up_steps(pool.block_size, pool.num_blocks, max_num_batched_tokens, variants)
    start = time.perf_counter()
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
