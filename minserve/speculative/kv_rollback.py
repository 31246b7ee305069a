"""Rolling back the KV slots of rejected drafts: shrink a block table, freeing whole blocks.

The rejected drafts' K/V stay in the kept tail block, where the next step overwrites them;
blocks holding only rejected positions go back to the allocator at once, so none leak.
"""

from __future__ import annotations

from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.block_table import BlockTable


def truncate(table: BlockTable, allocator: BlockAllocator, num_tokens: int) -> None:
    """Keep the slots of the first `num_tokens` tokens; free the blocks past them."""
    if not 0 <= num_tokens <= table.num_tokens:
        raise ValueError(f"cannot truncate a table of {table.num_tokens} tokens to {num_tokens}")
    keep = -(-num_tokens // table.block_size)  # ceil division
    for block in reversed(table.blocks[keep:]):  # allocated this step: never shared
        allocator.free(block)
    del table.blocks[keep:]
    table.num_tokens = num_tokens
