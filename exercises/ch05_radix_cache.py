# Your workspace for chapter 05 (Sharing prefixes): this file is yours
# to edit. Replace each `raise NotImplementedError(...)` with your code, then run
# `minserve check 05` from the repository root.
# Generated from minserve/scheduler/cache_aware.py, minserve/kvcache/radix_cache.py, minserve/kvcache/host_tier.py by `python -m minserve.course.generate`.
# stub fingerprint: 6a2b3f83c7a3 (lets the generator tell your edits from a stale stub)
"""Chapter 05, Sharing prefixes: the scheduling policy that serves cache hits
first, the radix tree of the prefix cache, and its host tier.

First `LongestPrefixMatch`, SGLang's longest-prefix-match policy: plug it in with
`LLM(enable_prefix_caching=True, scheduling_policy=LongestPrefixMatch)`. Then a
radix tree over token ids at block granularity (SGLang's RadixAttention): you
write `match_prefix`, `insert` and `evict`. Plug your class into the engine with
`LLM(enable_prefix_caching=True,
plugins=CoursePlugins(prefix_cache_cls=RadixCache))`. Last, `HostPrefixTier`:
evicted blocks demoted to host memory under their content keys, promoted back
when a match continues into them; plug it in with
`LLM(enable_prefix_caching=True, kv_offloading_size=0.01,
plugins=CoursePlugins(host_tier_cls=HostPrefixTier))`.
"""

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable

from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.block_key import UNSHARED_ROOT, BlockKey, block_keys
from minserve.kvcache.host_tier import TierCosts
from minserve.kvcache.manager import KVCacheManager
from minserve.kvcache.radix_cache import PrefixMatch, RadixNode
from minserve.messages import BlockOp, Demote, Promote
from minserve.scheduler.cache_aware import DEFAULT_MAX_WAIT_S
from minserve.scheduler.sequence import SeqStatus, Sequence


# Exercise 5.1: longest-prefix-match scheduling
class LongestPrefixMatch:
    """A policy key (lower is served first): starved requests, then longest cached prefix,
    then first come, first served. Running and swapped sequences are ranked FCFS.

    Built from the KV cache manager: `LLM(enable_prefix_caching=True,
    scheduling_policy=LongestPrefixMatch)`. The scheduler sorts by `policy(seq)`.
    """

    def __init__(self, kv: KVCacheManager, max_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
        if kv.prefix_cache is None:
            raise ValueError(
                "scheduling_policy='lpm' ranks requests by their cached prefix; "
                "it needs enable_prefix_caching=True"
            )
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.kv = kv
        self.max_wait_s = max_wait_s

    def __call__(self, seq: Sequence) -> tuple:
        """The sort key of `seq`: (group, -cached tokens, seq.arrival_time, seq.order).

        Group 0 holds sequences that are not waiting (running, swapped: ranked FCFS, so
        put 0 for their cached tokens) and waiting ones that starved; group 1 the other
        waiting ones, the longest cached prefix first. Tuples compare left to right.
        """
        raise NotImplementedError("Exercise 5.1: longest-prefix-match scheduling")

    def cached_tokens(self, seq: Sequence) -> int:
        """How many of the sequence's tokens the prefix cache holds now (whole blocks).

        A sequence that already holds blocks (a preempted one coming back) has picked up
        its prefix: count its computed tokens. Otherwise ask `self.kv.cached_tokens`.
        """
        raise NotImplementedError("Exercise 5.1: longest-prefix-match scheduling")

    def _starved(self, seq: Sequence) -> bool:
        """Waited longer than `max_wait_s` since it arrived (`time.monotonic()` seconds)."""
        raise NotImplementedError("Exercise 5.1: longest-prefix-match scheduling")


# Exercise 5.2: the radix tree (match_prefix, insert, evict)
class RadixCache:
    """SGLang's radix tree over token ids, at block granularity, with LRU eviction.

    `match_prefix(tokens)` finds the cached blocks of the longest cached prefix (whole
    blocks only); `insert(tokens, blocks)` caches a computed prefix; `lock(node)` /
    `unlock(node)` protect a running request's path; `evict(n)` frees up to n blocks
    from unlocked leaves, least recently used first. Counters `num_cached_blocks` and
    `num_evictable_blocks` stay exact after every call.
    """

    def __init__(self, block_size: int, allocator: BlockAllocator) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.allocator = allocator
        self.root = RadixNode()
        self.root.lock_ref = 1  # the root is never evicted
        self.num_cached_blocks = 0  # blocks the tree holds a reference on
        self.num_evictable_blocks = 0  # ... of which on unlocked nodes
        self._clock = itertools.count(1)

    def match_prefix(self, token_ids: list[int]) -> PrefixMatch:
        """The blocks of the longest cached prefix of `token_ids`, in whole blocks.

        Walk down from the root: at each node, the child is found by the next block's
        tokens (`self._child_key`); count how many whole blocks of its edge agree with
        the tokens (`self._shared_blocks`). If the match ends inside an edge, split the
        edge there (`self._split`) so that the returned node ends exactly at the match.
        Stamp every node on the path with `self._touch`. Changes no reference count.
        """
        raise NotImplementedError("Exercise 5.2: the radix tree (match_prefix, insert, evict)")

    def insert(self, token_ids: list[int], blocks: list[int]) -> PrefixMatch:
        """Cache `blocks`, which hold the KV of `token_ids` (one block per block_size tokens).

        Match what the tree has already (`match_prefix`); the tree keeps its own blocks
        for that part. The rest becomes one new leaf under the matched node, whose
        blocks the tree takes a reference on (`self.allocator.share`); count them in
        `num_cached_blocks` and `num_evictable_blocks`. Returns the tree's blocks for
        the whole of `token_ids` and the node where they end.
        """
        if len(token_ids) != len(blocks) * self.block_size:
            raise ValueError(
                f"insert needs {len(blocks) * self.block_size} token ids for {len(blocks)} "
                f"blocks of {self.block_size}, got {len(token_ids)}"
            )
        raise NotImplementedError("Exercise 5.2: the radix tree (match_prefix, insert, evict)")

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks from unlocked leaves, least recently used first.

        Take the unlocked leaf with the smallest `last_access` (`self._evictable_leaves()`
        lists them; a heap keeps the order), free blocks from the tail of its edge (the
        tree's reference: `self.allocator.free`), and drop the leaf when its edge is
        empty (`self._remove`); a parent that becomes an unlocked leaf joins the heap.
        Keep the two counters exact. Returns the number of blocks freed.
        """
        raise NotImplementedError("Exercise 5.2: the radix tree (match_prefix, insert, evict)")

    def lock(self, node: RadixNode) -> None:
        """A running request uses the prefix ending at `node`: protect the path from eviction."""
        while node is not None:
            if node.lock_ref == 0:
                self.num_evictable_blocks -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """The request is done with the prefix ending at `node`."""
        while node is not None:
            if node.lock_ref == 0:
                raise ValueError("unlock of a node that is not locked (unbalanced lock/unlock)")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_evictable_blocks += len(node.blocks)
            node = node.parent

    def _child_key(self, token_ids: list[int] | tuple[int, ...], pos: int) -> tuple[int, ...]:
        """Children are found by the tokens of the first block of their edge."""
        return tuple(token_ids[pos : pos + self.block_size])

    def _shared_blocks(self, key: tuple[int, ...], token_ids: list[int], pos: int) -> int:
        """How many whole blocks of edge `key` agree with `token_ids[pos:]`."""
        bs, shared = self.block_size, 0
        while (shared + 1) * bs <= len(key) and pos + (shared + 1) * bs <= len(token_ids):
            start = shared * bs
            if key[start : start + bs] != tuple(token_ids[pos + start : pos + start + bs]):
                break
            shared += 1
        return shared

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut `node`'s edge after `num_blocks` blocks; return the new upper node."""
        cut = num_blocks * self.block_size
        upper = RadixNode(
            key=node.key[:cut],
            blocks=node.blocks[:num_blocks],
            parent=node.parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        assert node.parent is not None  # the root has no edge to split
        node.parent.children[self._child_key(upper.key, 0)] = upper
        node.key, node.blocks, node.parent = node.key[cut:], node.blocks[num_blocks:], upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    def _remove(self, leaf: RadixNode) -> RadixNode:
        """Unlink an empty leaf from its parent; return the parent."""
        parent = leaf.parent
        assert parent is not None
        del parent.children[next(k for k, c in parent.children.items() if c is leaf)]
        return parent

    def _evictable_leaves(self) -> list[RadixNode]:
        """Every leaf no running request holds."""
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.is_leaf and node.lock_ref == 0:
                leaves.append(node)
        return leaves

    def _touch(self, node: RadixNode) -> None:
        node.last_access = next(self._clock)


# Exercise 5.3: the host tier (demote on eviction, promote on a match)
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
        raise NotImplementedError("Exercise 5.3: the host tier (demote on eviction, promote on a match)")

    def remember(self, tokens: list[int], blocks: list[int]) -> None:
        """The radix tree caches `blocks`, the KV of `tokens` (whole blocks from the start of
        a prompt): note each block's key in `self._key_of`, to demote it under that key.

        Keys chain (`block_keys(parent, tokens, block_size)`, the first block's parent being
        `self.root`): a block's KV depends on every token before it. The blocks already
        keyed lead the list (a block loses its key when it is evicted, and is keyed again
        once it caches something else); key only the rest, chaining on from the last key
        known, so that caching a long prompt block by block hashes each block once.
        """
        raise NotImplementedError("Exercise 5.3: the host tier (demote on eviction, promote on a match)")

    def demote_evicted(self, allocator: BlockAllocator) -> list[Demote]:
        """The tree just evicted blocks: those keyed here that nobody holds any more
        (`allocator.refcount(block) == 0`) are free, but still hold their KV until the
        step's block operations run. Demote each (in the order they were keyed) and forget
        its device key; return the operations."""
        raise NotImplementedError("Exercise 5.3: the host tier (demote on eviction, promote on a match)")

    def demote(self, key: BlockKey, block: int) -> Demote:
        """Device block `block` (keyed `key`) gets a host slot: its own older copy's, else a
        free one, else the least recently demoted copy's, which is dropped (`num_dropped`).
        The newest copy goes to the end of `self._slots`; count the bytes."""
        raise NotImplementedError("Exercise 5.3: the host tier (demote on eviction, promote on a match)")

    def promote(self, key: BlockKey, block: int) -> Promote:
        """The copy keyed `key` comes back into device block `block`: its host slot is
        free again (the device holds the block now); count the bytes. A key with no host
        copy is a `KeyError` that says so."""
        raise NotImplementedError("Exercise 5.3: the host tier (demote on eviction, promote on a match)")

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
        raise NotImplementedError("Exercise 5.3: the host tier (demote on eviction, promote on a match)")
