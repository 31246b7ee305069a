"""The radix prefix cache: KV blocks of past prompts, kept in a tree keyed by token ids.

SGLang's RadixAttention (Zheng et al., 2024): when requests share a prefix (a system
prompt, the earlier turns of a chat, few-shot examples), the keys and values of that
prefix are the same, so compute them once and keep them. The tree's edges are runs of
token ids; a path from the root spells a cached prefix, and each node holds the KV
blocks of its edge. Matching a new prompt walks down the tree; inserting a computed
prompt adds the part the tree lacks, splitting an edge where the prompts part ways.

Everything here is at block granularity: an edge holds a whole number of blocks
(`block_size` tokens each), because a block is the smallest unit of the paged pool that
can be shared. A prompt's last, partly filled block is never cached; it is recomputed.

The tree holds one allocator reference on each cached block. Running requests *lock*
the path they use (a count on every node from theirs to the root); when the pool runs
short, `evict` frees blocks from the tails of unlocked leaves, least recently used
first. The class is chapter 05's exercise (`match_prefix`, `insert`, `evict`); plug
yours into the engine with `LLM(enable_prefix_caching=True, prefix_cache_cls=...)`.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from minserve.kvcache.block_allocator import BlockAllocator


@dataclass(eq=False)
class RadixNode:
    """One edge of the tree and the KV blocks of its tokens."""

    key: tuple[int, ...] = ()  # tokens on the edge from the parent; len = len(blocks) * bs
    blocks: list[int] = field(default_factory=list)  # one pool block per block_size tokens
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)  # by first block
    lock_ref: int = 0  # running requests whose prefix passes through this node
    last_access: int = 0  # logical clock of the latest match or insert through it

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class PrefixMatch:
    """The cached blocks of a prompt's longest cached prefix, and the node it ends at."""

    blocks: list[int]
    node: RadixNode

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


# >>> exercise 5.2: the radix tree (match_prefix, insert, evict)
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
        # >>> solution
        node, blocks, pos = self.root, [], 0
        self._touch(node)
        while pos + self.block_size <= len(token_ids):
            child = node.children.get(self._child_key(token_ids, pos))
            if child is None:
                break
            shared = self._shared_blocks(child.key, token_ids, pos)
            partial = shared < len(child.blocks)  # the prompt leaves the edge midway
            node = self._split(child, shared) if partial else child
            self._touch(node)
            blocks += node.blocks
            pos += len(node.key)
            if partial:
                break
        return PrefixMatch(blocks, node)
        # <<< solution

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
        # >>> solution
        match = self.match_prefix(token_ids)
        new_blocks = blocks[match.num_blocks :]
        if not new_blocks:
            return match
        key = tuple(token_ids[match.num_blocks * self.block_size :])
        leaf = RadixNode(key=key, blocks=list(new_blocks), parent=match.node)
        match.node.children[self._child_key(key, 0)] = leaf
        self._touch(leaf)
        for block in new_blocks:
            self.allocator.share(block)
        self.num_cached_blocks += len(new_blocks)
        self.num_evictable_blocks += len(new_blocks)
        return PrefixMatch(match.blocks + list(new_blocks), leaf)
        # <<< solution

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks from unlocked leaves, least recently used first.

        Take the unlocked leaf with the smallest `last_access` (`self._evictable_leaves()`
        lists them; a heap keeps the order), free blocks from the tail of its edge (the
        tree's reference: `self.allocator.free`), and drop the leaf when its edge is
        empty (`self._remove`); a parent that becomes an unlocked leaf joins the heap.
        Keep the two counters exact. Returns the number of blocks freed.
        """
        # >>> solution
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            take = min(num_blocks - freed, len(leaf.blocks))
            for block in reversed(leaf.blocks[len(leaf.blocks) - take :]):
                self.allocator.free(block)
            del leaf.blocks[len(leaf.blocks) - take :]
            leaf.key = leaf.key[: len(leaf.blocks) * self.block_size]
            freed += take
            if not leaf.blocks:
                parent = self._remove(leaf)
                if parent.is_leaf and parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.num_cached_blocks -= freed
        self.num_evictable_blocks -= freed
        return freed
        # <<< solution

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


# <<< exercise
