"""Host memory holding KV blocks: the worker's side of swapping and of the host tier.

The scheduler decides (`swap.py`, `host_tier.py`) and sends block operations; the worker
carries them out on its own pool and its own host stores (`block_ops.py`). With tensor
parallelism every rank keeps its heads' share of the same blocks under the same keys.
On a GPU the host copies are pinned, so the copies back can run without blocking.
"""

from __future__ import annotations

import torch

from minserve.kvcache.paged_pool import PagedKVPool


class HostBlockStore:
    """Copies of pool blocks in host memory, each under an integer key."""

    def __init__(self) -> None:
        self._stored: dict[int, torch.Tensor] = {}  # key -> [layers, 2, blocks, bs, Hkv, D]

    def save(self, key: int, pool: PagedKVPool, blocks: tuple[int, ...]) -> None:
        """Copy these blocks of `pool` to the host under `key` (replacing what was there)."""
        self._stored[key] = pool.read_blocks(list(blocks))

    def restore(self, key: int, pool: PagedKVPool, blocks: tuple[int, ...]) -> None:
        """Copy `key`'s blocks into these blocks of `pool`, then release the host copy."""
        if key not in self._stored:
            raise KeyError(f"host copy {key!r} does not exist")
        pool.write_blocks(list(blocks), self._stored.pop(key))

    def get(self, key: int) -> torch.Tensor:
        """The host copy under `key`, [layers, 2, blocks, bs, Hkv, D] (to read, not change)."""
        return self._stored[key]

    def drop(self, key: int) -> None:
        self._stored.pop(key, None)

    def __contains__(self, key: int) -> bool:
        return key in self._stored

    def __len__(self) -> int:
        return len(self._stored)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._stored.values())
