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

`HostPrefixTier` is chapter 05's exercise 5.3, the marked region below; the prefix cache
(`prefix_caching.py`) calls it when it caches, evicts and matches blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minserve.config import CacheConfig
from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.block_key import UNSHARED_ROOT, BlockKey, block_keys
from minserve.kvcache.paged_pool import PagedKVPool
from minserve.kvcache.radix_cache import PrefixMatch, RadixCache
from minserve.kvcache.swap import GIB
from minserve.messages import BlockOp, Demote, Promote


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


# >>> exercise 5.3: the host tier (demote on eviction, promote on a match)
class HostPrefixTier:
    """The prefix cache's second tier (SGLang's HiCache, vLLM's CPU offloading): cached
    blocks evicted from the device pool wait in a bounded pool of host memory, keyed by
    content, and come back when a later prompt continues into them.

    `remember(tokens, blocks)` keys each block the radix tree caches; after an eviction,
    `demote_evicted(allocator)` sends the keyed blocks nobody holds any more to the host
    (`demote`: when the host is full, its least recently demoted copy is dropped); on a
    match, `extend(...)` brings back the blocks that continue it from the host
    (`promote`), while copying beats recomputing. Each move is a block operation
    (`Demote`, `Promote`) for the worker, which holds the copies; this class keeps the
    account: which key has a host copy, in which host slot. Plug yours into the engine
    with `LLM(enable_prefix_caching=True, kv_offloading_size=...,
    plugins=CoursePlugins(host_tier_cls=HostPrefixTier))`.
    """

    def __init__(
        self,
        capacity_blocks: int,
        block_size: int,
        block_nbytes: int,
        costs: TierCosts,
        root: BlockKey = UNSHARED_ROOT,  # the KV fingerprint's root: keys chain from it
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"a host tier needs room for at least 1 block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.block_nbytes = block_nbytes
        self.costs = costs
        self.root = root
        self.bytes_demoted = 0  # device -> host
        self.bytes_promoted = 0  # host -> device
        self.num_dropped = 0  # blocks that fell off the end of the host tier
        self._key_of: dict[int, BlockKey] = {}  # cached device block -> its key
        self._slots: OrderedDict[BlockKey, int] = OrderedDict()  # host copies, LRU first
        self._free_slots = list(range(capacity_blocks - 1, -1, -1))  # pop() gives slot 0 first

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._slots

    def worth_promoting(self) -> bool:
        """The rule: bring a block back only if copying its `block_nbytes` bytes beats
        recomputing its `block_size` tokens (`self.costs`, measured at start)."""
        # >>> solution
        return self.costs.copy_back_wins(self.block_nbytes, self.block_size)
        # <<< solution

    def remember(self, tokens: list[int], blocks: list[int]) -> None:
        """The radix tree caches `blocks`, the KV of `tokens` (whole blocks from the start of
        a prompt): note each block's key in `self._key_of`, to demote it under that key.

        Keys chain (`block_keys(parent, tokens, block_size)`, the first block's parent being
        `self.root`): a block's KV depends on every token before it. The blocks already
        keyed lead the list (a block loses its key when it is evicted, and is keyed again
        once it caches something else); key only the rest, chaining on from the last key
        known, so that caching a long prompt block by block hashes each block once.
        """
        # >>> solution
        first = next((i for i, b in enumerate(blocks) if b not in self._key_of), len(blocks))
        if first == len(blocks):  # every block keyed already
            return
        parent = self._key_of[blocks[first - 1]] if first else self.root
        size = self.block_size
        keys = block_keys(parent, tokens[first * size : len(blocks) * size], size)
        self._key_of.update(zip(blocks[first:], keys, strict=True))
        # <<< solution

    def demote_evicted(self, allocator: BlockAllocator) -> list[Demote]:
        """The tree just evicted blocks: those keyed here that nobody holds any more
        (`allocator.refcount(block) == 0`) are free, but still hold their KV until the
        step's block operations run. Demote each (in the order they were keyed) and forget
        its device key; return the operations."""
        # >>> solution
        evicted = [b for b in self._key_of if allocator.refcount(b) == 0]
        return [self.demote(self._key_of.pop(block), block) for block in evicted]
        # <<< solution

    def demote(self, key: BlockKey, block: int) -> Demote:
        """Device block `block` (keyed `key`) gets a host slot: its own older copy's, else a
        free one, else the least recently demoted copy's, which is dropped (`num_dropped`).
        The newest copy goes to the end of `self._slots`; count the bytes."""
        # >>> solution
        if key in self._slots:  # an older copy of the same block: replace it
            self._free_slots.append(self._slots.pop(key))
        if not self._free_slots:  # full: the least recent copy falls off
            _, slot = self._slots.popitem(last=False)
            self._free_slots.append(slot)
            self.num_dropped += 1
        slot = self._free_slots.pop()
        self._slots[key] = slot
        self.bytes_demoted += self.block_nbytes
        return Demote(block, slot)
        # <<< solution

    def promote(self, key: BlockKey, block: int) -> Promote:
        """The copy keyed `key` comes back into device block `block`: its host slot is
        free again (the device holds the block now); count the bytes. A key with no host
        copy is a `KeyError` that says so."""
        # >>> solution
        if key not in self._slots:
            raise KeyError(
                f"no host copy of the block keyed {key.hex()}: promote only a key the tier "
                "holds (`key in tier`)"
            )
        slot = self._slots.pop(key)
        self._free_slots.append(slot)
        self.bytes_promoted += self.block_nbytes
        return Promote(slot, block)
        # <<< solution

    def extend(
        self,
        match: PrefixMatch,
        token_ids: list[int],
        cache: RadixCache,
        allocator: BlockAllocator,
        make_room: Callable[[int], None],
        ops: list[BlockOp],
    ) -> PrefixMatch:
        """Extend the tree's `match` of `token_ids` (whole blocks) with the blocks that
        follow it on the host, in order, while copying beats recomputing.

        Keep `match.node` locked meanwhile (`cache.lock` / `cache.unlock`): making room
        must not evict the match itself. For each next block's key, stop at the first that
        is not worth promoting or not on the host; else `make_room(1)` (which may evict
        and demote, appending to `ops`, and even push that very key off the host: look
        again), take a fresh device block from `allocator` (stop if none), and append
        `self.promote(key, block)` to `ops` after those demotions. Then insert the
        extended prefix into `cache`, remember its blocks' keys, and let go of the
        promoted blocks (the tree holds them). Returns the extended match (`match` itself
        when nothing came back).
        """
        # >>> solution
        cache.lock(match.node)  # making room must not evict the match
        promoted: list[int] = []
        # the keys of the blocks after the match: each chains over every token before it
        keys = block_keys(self.root, token_ids, self.block_size)[match.num_blocks :]
        for key in keys:
            if not self.worth_promoting() or key not in self:
                break
            make_room(1)  # may demote others, and push this one off the host tier
            if key not in self or not allocator.can_allocate(1):
                break
            promoted.append(allocator.allocate())
            ops.append(self.promote(key, promoted[-1]))
        cache.unlock(match.node)
        if not promoted:
            return match
        tokens = token_ids[: (match.num_blocks + len(promoted)) * self.block_size]
        extended = cache.insert(tokens, match.blocks + promoted)
        self.remember(tokens, extended.blocks)
        for block in promoted:  # the tree holds them now
            allocator.free(block)
        return extended
        # <<< solution


# <<< exercise


def _seconds(action: Callable[[], object], device: torch.device) -> float:
    """Wall time of `action`, waiting for a GPU to finish it (its launches are async)."""
    start = time.perf_counter()
    action()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def host_tier_for(
    cache_config: CacheConfig,
    block_size: int,
    block_nbytes: int,
    costs: TierCosts,
    root: BlockKey = UNSHARED_ROOT,
    tier_cls: type = HostPrefixTier,  # a class shaped like HostPrefixTier (chapter 05)
) -> HostPrefixTier | None:
    """The prefix cache's host tier, sized by `kv_offloading_size` (GiB), its keys chained
    from `root` (the engine's KV fingerprint)."""
    if cache_config.kv_offloading_size <= 0:
        return None
    capacity = max(1, int(cache_config.kv_offloading_size * GIB) // block_nbytes)
    return tier_cls(capacity, block_size, block_nbytes, costs, root)
