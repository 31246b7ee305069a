"""The state plane: the block allocator, block tables, the paged KV pool and swap space."""

from minserve.kvcache.block_allocator import BlockAllocator, NoFreeBlocksError
from minserve.kvcache.block_table import BlockTable
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.kvcache.swap import HostSwapSpace, SwapSpaceFullError

__all__ = [
    "BlockAllocator",
    "BlockTable",
    "HostSwapSpace",
    "NoFreeBlocksError",
    "PagedKVPool",
    "SwapSpaceFullError",
]
