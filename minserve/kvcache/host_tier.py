"""The host tier of the prefix cache: evicted blocks wait in host memory for a later hit.

A tiered KV cache (SGLang's HiCache, vLLM's CPU offloading, LMCache): when the device pool
must evict a cached block, copy it to a bounded pool in host memory instead of dropping
it. A later prompt whose cached prefix continues into blocks that live only on the host
gets them *promoted*: fresh device blocks, filled by a copy back, put into the radix tree
again. Whether that beats recomputing is a question of two measured speeds: a block
costs `block_nbytes / copy bandwidth` to copy back and `block_size / prefill speed` to
recompute (`TierCosts.copy_back_wins`). On a CPU-only machine both pools live in RAM,
so copying always wins; on a GPU, PCIe against the GPU's prefill speed decides.

Blocks are keyed by their content address (`block_key.py`): a chained digest of every
token up to the block's end and of the model's fingerprint, because a block's keys and
values depend on all the tokens before it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minserve.config import CacheConfig
from minserve.kvcache.block_key import BlockKey
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.kvcache.swap import GIB
from minserve.messages import Demote, Promote


@dataclass(frozen=True)
class TierCosts:
    """The two speeds the copy-back-or-recompute rule compares."""

    copy_bytes_per_s: float  # host -> device copy bandwidth
    prefill_tokens_per_s: float  # how fast the engine computes prompt tokens

    def copy_back_wins(self, num_bytes: int, num_tokens: int) -> bool:
        """Copying `num_bytes` back is faster than recomputing `num_tokens` tokens."""
        return num_bytes / self.copy_bytes_per_s < num_tokens / self.prefill_tokens_per_s

    @classmethod
    def measure(cls, pool: PagedKVPool, num_params: int, dtype: torch.dtype) -> TierCosts:
        """Copy bandwidth from timing a host -> pool copy; prefill speed from measured
        matmul FLOP/s over the model's 2 x params FLOPs per token (the prefill roofline),
        both on the pool's device, the matmul in the model's `dtype` (where the prefill
        would run)."""
        device = pool.device
        block = pool.read_blocks([0])  # [layers, 2, 1, bs, Hkv, D] on the host
        copy_s = min(_seconds(lambda: pool.write_blocks([0], block), device) for _ in range(3))
        a = torch.randn(512, 512, device=device, dtype=dtype)
        flops_s = 2 * 512**3 / min(_seconds(lambda: a @ a, device) for _ in range(3))
        return cls(pool.block_nbytes / copy_s, flops_s / (2 * num_params))


class HostPrefixTier:
    """A bounded LRU account of evicted prefix blocks kept in host memory, with byte counters.

    The scheduler's side: which blocks (by key) have a host copy and in which host slot. Each
    demotion or promotion is a block operation for the worker, which holds the copies.
    """

    def __init__(
        self, capacity_blocks: int, block_size: int, block_nbytes: int, costs: TierCosts
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"a host tier needs room for at least 1 block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.block_nbytes = block_nbytes
        self.costs = costs
        self.bytes_demoted = 0  # device -> host
        self.bytes_promoted = 0  # host -> device
        self.num_dropped = 0  # blocks that fell off the end of the host tier
        self._slots: OrderedDict[BlockKey, int] = OrderedDict()  # LRU first
        self._free_slots = list(range(capacity_blocks - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._slots

    def demote(self, key: BlockKey, block: int) -> Demote:
        """Device block `block` (the block keyed `key`) goes to the host."""
        if key in self._slots:  # an older copy of the same block: replace it
            self._free_slots.append(self._slots.pop(key))
        if not self._free_slots:
            _, slot = self._slots.popitem(last=False)
            self._free_slots.append(slot)
            self.num_dropped += 1
        slot = self._free_slots.pop()
        self._slots[key] = slot
        self.bytes_demoted += self.block_nbytes
        return Demote(block, slot)

    def worth_promoting(self) -> bool:
        """The rule: bring a block back only if copying it beats recomputing it."""
        return self.costs.copy_back_wins(self.block_nbytes, self.block_size)

    def promote(self, key: BlockKey, block: int) -> Promote:
        """The block keyed `key` comes back into device block `block`; the host copy is
        dropped."""
        slot = self._slots.pop(key)
        self._free_slots.append(slot)
        self.bytes_promoted += self.block_nbytes
        return Promote(slot, block)


def _seconds(action: Callable[[], object], device: torch.device) -> float:
    """Wall time of `action`, waiting for a GPU to finish it (its launches are async)."""
    start = time.perf_counter()
    action()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def host_tier_for(
    cache_config: CacheConfig, block_size: int, block_nbytes: int, costs: TierCosts
) -> HostPrefixTier | None:
    """The prefix cache's host tier, sized by `kv_offloading_size` (GiB)."""
    if cache_config.kv_offloading_size <= 0:
        return None
    capacity = max(1, int(cache_config.kv_offloading_size * GIB) // block_nbytes)
    return HostPrefixTier(capacity, block_size, block_nbytes, costs)
