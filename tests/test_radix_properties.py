"""Property tests of the prefix cache inside the KV cache manager (Hypothesis state machine).

Random requests start (reusing cached prefixes), grow, fork, finish, and the cache is
evicted at random, over a pool of 12 blocks of 2 tokens and prompts over a 2-token
alphabet, so that sharing, splits and shortages are frequent. "Computing" a token writes
into the real pool a value that stands for its KV: a function of the token and all the
tokens before it. After every step:

- the tree's counters equal what its nodes hold, and lock counts equal the tables using them;
- every block's reference count is the tree's reference plus one per table holding it;
- every cached path and every table's tokens hold exactly their own KV values in the pool;
- no block leaks: free + in use = the pool, and a drained engine frees everything.

The same machine runs again with a host tier: evicted blocks go to host memory and come
back on a later hit, and the host copies must hold their prefix's KV values too.
"""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minserve.kvcache import BlockAllocator, BlockTable, PagedKVPool
from minserve.kvcache.block_key import UNSHARED_ROOT, block_keys
from minserve.kvcache.block_ops import apply_block_ops
from minserve.kvcache.host_store import HostBlockStore
from minserve.kvcache.host_tier import HostPrefixTier, TierCosts
from minserve.kvcache.manager import KVCacheManager
from minserve.kvcache.radix_cache import RadixCache, RadixNode
from minserve.model_config import ModelConfig

BS, NUM_BLOCKS = 2, 12
TINY = ModelConfig(
    architecture="llama",
    vocab_size=8,
    hidden_size=4,
    intermediate_size=8,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    head_dim=4,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)
tokens = st.lists(st.integers(1, 2), min_size=1, max_size=9)


def _nodes(root: RadixNode) -> list[RadixNode]:
    nodes, stack = [], [root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def _path_tokens(node: RadixNode) -> tuple[int, ...]:
    edges = []
    while node.parent is not None:
        edges.append(node.key)
        node = node.parent
    return tuple(t for key in reversed(edges) for t in key)


def kv_value(prefix: list[int] | tuple[int, ...]) -> float:
    """What stands for the KV of the last token of `prefix` (it depends on all of them)."""
    return float(hash(tuple(prefix)) % 100_003)


class PrefixCacheMachine(RuleBasedStateMachine):
    host_blocks = 0  # capacity of the host tier (0: none)

    def __init__(self) -> None:
        super().__init__()
        allocator = BlockAllocator(NUM_BLOCKS)
        self.pool = PagedKVPool(TINY, NUM_BLOCKS, BS, torch.float32, "cpu")
        self.cache = RadixCache(BS, allocator)
        copy_always = TierCosts(copy_bytes_per_s=1e18, prefill_tokens_per_s=1.0)
        nbytes = self.pool.block_nbytes
        host = (
            HostPrefixTier(self.host_blocks, BS, nbytes, copy_always) if self.host_blocks else None
        )
        self.kv = KVCacheManager(allocator, BS, prefix_cache=self.cache, host_tier=host)
        self.swap_store, self.tier_store = HostBlockStore(), HostBlockStore()
        self.tables: list[tuple[BlockTable, list[int]]] = []  # running requests, their tokens
        self.prefix_of: dict[bytes, tuple[int, ...]] = {}  # a block's key -> the prefix it ends

    def _copy(self) -> None:
        """Carry out the block copies the manager decided (as the worker does)."""
        apply_block_ops(self.kv.take_block_ops(), self.pool, self.swap_store, self.tier_store)

    def _stored(self, block: int, offset: int) -> float:
        return float(self.pool.kv[0, 0, block, offset, 0, 0])

    def _assert_holds(self, blocks: list[int], ids: list[int] | tuple[int, ...], end: int) -> None:
        """`blocks` (a table's, from position 0) hold the KV values of ids[:end]."""
        for p in range(end):
            block, offset = blocks[p // BS], p % BS
            assert self._stored(block, offset) == kv_value(ids[: p + 1]), f"block {block}"

    def _compute(self, table: BlockTable, ids: list[int], count: int) -> bool:
        """Grow `table` by `count` tokens of `ids` (writing their KV), then cache full blocks."""
        if not self.kv.can_append(table, count):
            return False
        first = table.num_tokens
        self.kv.append(table, count)
        self._copy()
        cached = {b for n in _nodes(self.cache.root) for b in n.blocks}  # cached as scheduled
        for p in range(first, table.num_tokens):
            block, offset = divmod(table.slot(p), BS)
            others = self.kv.allocator.refcount(block) - 1 - (block in cached)
            assert others == 0, "wrote into a block another table holds"
            self.pool.kv[0, 0, block, offset, 0, 0] = kv_value(ids[: p + 1])
        self.kv.cache_computed(table, ids, table.num_tokens)
        for i, key in enumerate(block_keys(UNSHARED_ROOT, ids[: table.num_tokens], BS)):
            self.prefix_of[key] = tuple(ids[: (i + 1) * BS])
        return True

    @rule(prompt=tokens)
    def start_request(self, prompt: list[int]) -> None:
        table = self.kv.new_table()
        cached = self.kv.reuse_prefix(table, prompt)
        self._copy()
        assert cached % BS == 0 and cached < len(prompt)
        self._assert_holds(table.blocks, prompt, cached)  # a hit must be the prompt's own KV
        if self._compute(table, prompt, len(prompt) - cached):
            self.tables.append((table, list(prompt)))
        else:
            self.kv.free(table)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), extra=tokens)
    def grow_request(self, data: st.DataObject, extra: list[int]) -> None:
        table, ids = data.draw(st.sampled_from(self.tables))
        ids += extra  # the list is shared with self.tables
        if not self._compute(table, ids, len(extra)):
            del ids[len(ids) - len(extra) :]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork_request(self, data: st.DataObject) -> None:
        table, ids = data.draw(st.sampled_from(self.tables))
        self.tables.append((self.kv.fork(table), list(ids)))

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self.tables))
        self.tables.remove(entry)
        self.kv.free(entry[0])

    @rule(count=st.integers(0, NUM_BLOCKS))
    def evict(self, count: int) -> None:
        """Ask for `count` more free blocks, as the engine does when the pool runs short."""
        free, evictable = self.kv.allocator.num_free, self.cache.num_evictable_blocks
        self.kv.prefix.make_room(free + count)
        self._copy()
        assert self.kv.allocator.num_free == free + min(count, evictable)

    @rule()
    def drain(self) -> None:
        """Every request ends and the cache is emptied: the whole pool is free again."""
        for table, _ in self.tables:
            self.kv.free(table)
        self.tables = []
        self.kv.prefix.make_room(NUM_BLOCKS)  # nothing is locked any more
        self._copy()
        assert self.cache.num_cached_blocks == 0
        assert self.kv.allocator.num_free == NUM_BLOCKS

    @invariant()
    def counters_match_the_tree(self) -> None:
        nodes = _nodes(self.cache.root)
        assert self.cache.num_cached_blocks == sum(len(n.blocks) for n in nodes)
        unlocked = sum(len(n.blocks) for n in nodes if n.lock_ref == 0)
        assert self.cache.num_evictable_blocks == unlocked

    @invariant()
    def lock_counts_match_the_tables_using_them(self) -> None:
        held = Counter()
        for table, _ in self.tables:
            node = self.kv.prefix.held_node(table)
            while node is not None:
                held[node] += 1
                node = node.parent
        for node in _nodes(self.cache.root):
            assert node.lock_ref == held[node] + (node is self.cache.root)

    @invariant()
    def reference_counts_match_the_allocator(self) -> None:
        users = Counter(b for n in _nodes(self.cache.root) for b in n.blocks)
        users.update(b for table, _ in self.tables for b in table.blocks)
        allocator = self.kv.allocator
        assert all(allocator.refcount(b) == users[b] for b in range(NUM_BLOCKS))
        assert allocator.num_free + len(users) == NUM_BLOCKS  # nothing leaks

    @invariant()
    def cached_and_held_blocks_hold_their_tokens(self) -> None:
        for node in _nodes(self.cache.root):
            path = _path_tokens(node)
            start = len(path) - len(node.key)
            for i, block in enumerate(node.blocks):
                for offset in range(BS):
                    end = start + i * BS + offset + 1
                    assert self._stored(block, offset) == kv_value(path[:end])
        for table, ids in self.tables:
            self._assert_holds(table.blocks, ids, table.num_tokens)

    @invariant()
    def host_copies_hold_their_prefix(self) -> None:
        host = self.kv.prefix.host
        for key, slot in host._slots.items() if host else ():
            prefix = self.prefix_of[key]
            data = self.tier_store.get(slot)  # [1, 2, 1, BS, 1, D]
            for offset in range(BS):
                end = len(prefix) - BS + offset + 1
                assert float(data[0, 0, 0, offset, 0, 0]) == kv_value(prefix[:end])


class HostTierMachine(PrefixCacheMachine):
    host_blocks = 6


SETTINGS = settings(max_examples=120, stateful_step_count=30, deadline=None)
PrefixCacheMachine.TestCase.settings = SETTINGS
HostTierMachine.TestCase.settings = SETTINGS
test_prefix_cache_state_machine = PrefixCacheMachine.TestCase
test_prefix_cache_with_a_host_tier_state_machine = HostTierMachine.TestCase
