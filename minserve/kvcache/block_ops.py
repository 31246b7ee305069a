"""Carrying out a step's block operations on the worker's KV memory, in order.

The scheduler decided them in this order while it allocated and freed blocks, so running
them in the same order is always right: a block a swap-out or demotion reads may be given
to another sequence later in the same step, and be written there by a copy or the forward.
"""

from __future__ import annotations

from collections.abc import Iterable

from minserve.kvcache.disk_store import DiskBlockStore
from minserve.kvcache.host_store import HostBlockStore
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.messages import (
    BlockOp,
    CopyBlocks,
    Demote,
    DiskLoad,
    DiskWrite,
    DropSwapped,
    Promote,
    SwapIn,
    SwapOut,
)


def apply_block_ops(
    ops: Iterable[BlockOp],
    pool: PagedKVPool,
    swap: HostBlockStore,
    tier: HostBlockStore,
    disk: DiskBlockStore | None = None,
) -> None:
    """Copy-on-write copies, swaps out and in, host-tier demotions and promotions, disk-tier
    writes (queued for the store's writer thread) and loads."""
    copies: list[tuple[int, int]] = []  # consecutive copies go together, in one gather
    for op in ops:
        if isinstance(op, CopyBlocks):
            copies.append((op.src, op.dst))
            continue
        pool.copy_blocks(copies)
        copies = []
        if isinstance(op, SwapOut):
            swap.save(op.key, pool, op.blocks)
        elif isinstance(op, SwapIn):
            swap.restore(op.key, pool, op.blocks)
        elif isinstance(op, DropSwapped):
            swap.drop(op.key)
        elif isinstance(op, Demote):
            tier.save(op.slot, pool, (op.block,))
        elif isinstance(op, Promote):
            tier.restore(op.slot, pool, (op.block,))
        elif isinstance(op, DiskWrite):
            if disk is None:
                raise ValueError("a disk write with no disk tier (kv_disk_path unset)")
            disk.put(op.key, pool.read_blocks([op.block]))
        elif isinstance(op, DiskLoad):
            pool.write_blocks([op.block], op.data)
        else:
            raise TypeError(f"unknown block operation {op!r}")
    pool.copy_blocks(copies)
