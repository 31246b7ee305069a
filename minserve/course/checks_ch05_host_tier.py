"""Checks for exercise 5.3, the prefix cache's host tier, run against any module that defines
`HostPrefixTier`: minserve's own (`minserve.kvcache.host_tier`), the solutions, or a
student's file.

Blocks of 2 tokens, minserve's real `BlockAllocator` and `RadixCache`. The hand-made
checks work the account out on paper: keys chained from the root (`block_keys` is the
oracle), demotions in the order blocks were keyed, the least recent copy dropped when the
host is full. The last two run your tier where the engine runs it, inside minserve's
`KVCacheManager`, one request after another, with a stand-in worker whose pool blocks
hold the key of the tokens whose KV they hold: every block a prompt picks up from the
cache (from the device or promoted from the host) must hold that prompt's own KV, and
every request must reuse what it reuses with minserve's tier, with the same operations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any
from unittest import mock

from hypothesis import given
from hypothesis import strategies as st

from minserve.course.randomized import randomized
from minserve.kvcache import block_key
from minserve.kvcache.block_allocator import BlockAllocator
from minserve.kvcache.block_key import KVFingerprint, block_keys
from minserve.kvcache.host_tier import HostPrefixTier, TierCosts
from minserve.kvcache.manager import KVCacheManager
from minserve.kvcache.radix_cache import RadixCache
from minserve.messages import BlockOp, CopyBlocks, Demote, Promote

BS = 2
NBYTES = 1000  # a block's bytes
COPY_WINS = TierCosts(copy_bytes_per_s=1e9, prefill_tokens_per_s=1e3)  # 1 us against 2 ms
RECOMPUTE_WINS = TierCosts(copy_bytes_per_s=1e3, prefill_tokens_per_s=1e9)
ROOT = KVFingerprint("weights", "float32", "float32", "none", "cpu:torch", BS, 2, 2, 8).root()


def _tier(impl: ModuleType, capacity: int = 4, costs: TierCosts = COPY_WINS) -> Any:
    return impl.HostPrefixTier(capacity, BS, NBYTES, costs, ROOT)


def _keys(tokens: list[int]) -> list[bytes]:
    """The true keys of `tokens`' whole blocks: chained from the root (`block_keys`)."""
    return block_keys(ROOT, tokens, BS)


def _short(keys: Any) -> Any:
    """Keys shown by their first 4 hex digits, inside whatever holds them."""
    if isinstance(keys, bytes):
        return keys.hex()[:4]
    if isinstance(keys, dict):
        return {k: _short(v) for k, v in keys.items()}
    return [_short(k) for k in keys]


def _finished_request(cache: RadixCache, tokens: list[int]) -> list[int]:
    """Blocks computed for `tokens`, inserted, then released by the request: the tree's."""
    blocks = [cache.allocator.allocate() for _ in range(len(tokens) // BS)]
    kept = cache.insert(tokens, blocks).blocks
    for block in blocks:
        cache.allocator.free(block)
    return kept


def check_remember_chains_keys_from_the_root(impl: ModuleType) -> None:
    """[1..6] cached: each block keyed as block_keys(root, ...); [1, 2, 7, 8] chains on."""
    tier, cache = _tier(impl), RadixCache(BS, BlockAllocator(8))
    first = _finished_request(cache, [1, 2, 3, 4, 5, 6])
    tier.remember([1, 2, 3, 4, 5, 6], first)
    expected = dict(zip(first, _keys([1, 2, 3, 4, 5, 6])))
    assert tier._key_of == expected, (
        f"remember([1..6], blocks {first}): expected _key_of {_short(expected)} (keys by "
        f"their first hex digits; block_keys(root, tokens, {BS})), got {_short(tier._key_of)}"
    )
    second = _finished_request(cache, [1, 2, 7, 8])  # shares block [1, 2] with the first
    tier.remember([1, 2, 7, 8], second)
    expected.update(zip(second, _keys([1, 2, 7, 8])))
    assert tier._key_of == expected, (
        f"then remember([1, 2, 7, 8], blocks {second}), the first block shared: expected "
        f"_key_of {_short(expected)}, got {_short(tier._key_of)}: block {second[1]} holds "
        "[7, 8] after [1, 2], so its key chains from the key of [1, 2]"
    )


def check_remember_hashes_each_block_once(impl: ModuleType) -> None:
    """Caching [1..8] a block at a time (as decodes fill them) hashes each block once."""
    tier, cache = _tier(impl), RadixCache(BS, BlockAllocator(8))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    blocks = _finished_request(cache, tokens)
    digests = []
    real = block_key.next_key

    def counted(parent: bytes, block_tokens: list[int]) -> bytes:
        digests.append(block_tokens)
        return real(parent, block_tokens)

    with mock.patch.object(block_key, "next_key", counted):
        for n in range(1, 5):
            tier.remember(tokens[: n * BS], blocks[:n])
    assert tier._key_of == dict(zip(blocks, _keys(tokens))), (
        f"remember called with the first 1, 2, 3, then 4 blocks of [1..8]: expected _key_of "
        f"{_short(dict(zip(blocks, _keys(tokens))))}, got {_short(tier._key_of)}"
    )
    assert len(digests) == 4, (
        f"remember called with the first 1, 2, 3, then 4 blocks of [1..8]: expected 4 "
        f"digests (one per block), got {len(digests)}: key only the blocks not keyed yet, "
        "chaining on from the last key known (a long prompt would cost its length squared)"
    )


def check_evicted_blocks_are_demoted_in_the_order_they_were_keyed(impl: ModuleType) -> None:
    """[1..6] cached, its last 2 blocks evicted: demoted to slots 0 and 1, keys forgotten."""
    allocator = BlockAllocator(8)
    tier, cache = _tier(impl), RadixCache(BS, allocator)
    blocks = _finished_request(cache, [1, 2, 3, 4, 5, 6])
    tier.remember([1, 2, 3, 4, 5, 6], blocks)
    keys = _keys([1, 2, 3, 4, 5, 6])
    cache.evict(2)  # the tail of the leaf: [3, 4] and [5, 6]
    ops = tier.demote_evicted(allocator)
    expected = [Demote(blocks[1], 0), Demote(blocks[2], 1)]
    assert ops == expected, (
        f"[1..6] cached in blocks {blocks}, then evict(2): expected demote_evicted to return "
        f"{expected} (free blocks in the order they were keyed; host slots from 0), got {ops}"
    )
    got = ([k in tier for k in keys], _short(tier._key_of), tier.bytes_demoted, len(tier))
    want = ([False, True, True], _short({blocks[0]: keys[0]}), 2 * NBYTES, 2)
    assert got == want, (
        "after demoting [3, 4] and [5, 6]: expected (each block's key `in` the tier, "
        f"_key_of, bytes_demoted, len) == {want}, got {got}"
    )
    assert tier.demote_evicted(allocator) == [], (
        "demote_evicted again with nothing evicted since: expected [] (keys of demoted "
        "blocks are forgotten)"
    )


def check_a_full_host_drops_its_least_recent_copy(impl: ModuleType) -> None:
    """A 2-slot host: a third copy drops the oldest; a key demoted again is the newest."""
    tier = _tier(impl, capacity=2)
    k = _keys([1, 2, 3, 4, 5, 6, 7, 8])
    steps = [
        ("demote(k0, 10)", lambda: tier.demote(k[0], 10), Demote(10, 0), 0),
        ("demote(k1, 11)", lambda: tier.demote(k[1], 11), Demote(11, 1), 0),
        ("demote(k2, 12)", lambda: tier.demote(k[2], 12), Demote(12, 0), 1),  # drops k0
        ("demote(k1, 13)", lambda: tier.demote(k[1], 13), Demote(13, 1), 1),  # its own slot
        ("demote(k3, 14)", lambda: tier.demote(k[3], 14), Demote(14, 0), 2),  # drops k2
        ("promote(k1, 20)", lambda: tier.promote(k[1], 20), Promote(1, 20), 2),
    ]
    done = []
    for call, step, op, dropped in steps:
        done.append(call)
        got = (step(), tier.num_dropped)
        assert got == (op, dropped), (
            f"a host of 2 slots, after {', '.join(done)}: expected the operation and "
            f"num_dropped {(op, dropped)}, got {got} (a full host drops its least recently "
            "demoted copy; a key demoted again takes the place of its own older copy)"
        )
    held = [key in tier for key in k]
    assert held == [False, False, False, True] and len(tier) == 1, (
        f"after those steps: expected only k3 on the host (len 1), got {held} and len {len(tier)}"
    )
    counts = (tier.bytes_demoted, tier.bytes_promoted)
    assert counts == (5 * NBYTES, NBYTES), (
        f"expected (bytes_demoted, bytes_promoted) == {(5 * NBYTES, NBYTES)}, got {counts}"
    )
    try:
        tier.promote(k[0], 21)
    except KeyError as error:
        assert "no host copy" in str(error), (
            f"promote of a key with no host copy: expected a KeyError saying 'no host copy', "
            f"got KeyError({error})"
        )
    else:
        raise AssertionError("promote(k0, 21), k0 dropped long ago: expected a KeyError")


def check_promoting_is_worth_it_only_when_copying_beats_recomputing(impl: ModuleType) -> None:
    """1000 bytes, 2 tokens a block: copied back in 1 us against 2 ms, not 1 s against 2 ns."""
    got = (_tier(impl, costs=COPY_WINS).worth_promoting(),
           _tier(impl, costs=RECOMPUTE_WINS).worth_promoting())  # fmt: skip
    assert got == (True, False), (
        f"{NBYTES} bytes and {BS} tokens a block: expected worth_promoting() True when "
        "copying takes 1 us against 2 ms of recompute, False when 1 s against 2 ns; got "
        f"{got}"
    )


# --- your tier inside the engine's KV cache manager --------------------------------------------


class _Engine:
    """Requests one at a time through minserve's `KVCacheManager` with a host tier, and a
    stand-in worker whose blocks and host slots hold the key of the KV they hold."""

    def __init__(self, tier: Any, num_blocks: int) -> None:
        self.allocator = BlockAllocator(num_blocks)
        cache = RadixCache(BS, self.allocator)
        self.kv = KVCacheManager(self.allocator, BS, prefix_cache=cache, host_tier=tier)
        self.device: dict[int, bytes | None] = {}  # block -> key of the KV it holds
        self.host: dict[int, bytes | None] = {}  # slot -> the same

    def apply(self, op: BlockOp) -> None:
        if isinstance(op, Demote):
            self.host[op.slot] = self.device.get(op.block)
        elif isinstance(op, Promote):
            self.device[op.block] = self.host.get(op.slot)
        elif isinstance(op, CopyBlocks):
            self.device[op.dst] = self.device.get(op.src)

    def serve(self, prompt: list[int]) -> tuple[int, list[BlockOp], list[int]]:
        """(tokens reused, the block operations, blocks picked up that hold other KV)."""
        table = self.kv.new_table()
        reused = self.kv.reuse_prefix(table, prompt)
        self.kv.append(table, len(prompt) - reused)
        ops = list(self.kv.take_block_ops())
        for op in ops:  # the worker runs them before the forward
            self.apply(op)
        keys = _keys(prompt)
        picked_up = zip(table.blocks[: reused // BS], keys)
        wrong = [block for block, key in picked_up if self.device.get(block) != key]
        for i in range(reused // BS, len(table.blocks)):  # the forward computes the rest
            self.device[table.blocks[i]] = keys[i] if i < len(keys) else None
        self.kv.cache_computed(table, prompt, len(prompt))
        self.kv.free(table)
        return reused, ops, wrong


def _serve_both(
    impl: ModuleType, prompts: list[list[int]], num_blocks: int, capacity: int, costs: TierCosts
) -> None:
    yours = _Engine(impl.HostPrefixTier(capacity, BS, NBYTES, costs, ROOT), num_blocks)
    ours = _Engine(HostPrefixTier(capacity, BS, NBYTES, costs, ROOT), num_blocks)
    copy = "copying wins" if costs is COPY_WINS else "recomputing wins"
    where = f"a pool of {num_blocks} blocks of {BS}, a host of {capacity}, {copy}"
    for i, prompt in enumerate(prompts):
        what = f"{where}; requests {prompts[: i + 1]}, one at a time, at the last one"
        reused, ops, wrong = yours.serve(prompt)
        assert not wrong, (
            f"{what}: blocks {wrong} were handed out for its prefix but hold other KV (the "
            "stand-in worker ran your operations in order): a promotion before the demotion "
            "that freed its slot or block, a wrong slot, or a key for the wrong tokens"
        )
        expected = ours.serve(prompt)[:2]
        assert (reused, ops) == expected, (
            f"{what}: expected (tokens reused, block operations) {expected}, got "
            f"{(reused, ops)} (a promoted copy's slot is free again; a full host drops its "
            "least recent copy; promotions stop at the first key not on the host)"
        )


def check_an_evicted_prefix_comes_back_from_the_host(impl: ModuleType) -> None:
    """A, then B evicts A's blocks to the host, then A again: its prefix comes back by copy."""
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3, 2, 1]
    engine = _Engine(_tier(impl, capacity=8), num_blocks=6)
    engine.serve(a)
    engine.serve(b)
    reused, ops, wrong = engine.serve(a)
    promoted = [op for op in ops if isinstance(op, Promote)]
    assert (reused, len(promoted), wrong) == (8, 3, []), (
        "a pool of 6 blocks of 2, a host of 8; A = [1..9], then B = [9..1] (its blocks "
        "push 3 of A's 4 to the host), then A again: expected (tokens reused, Promote "
        f"operations, blocks holding other KV) == (8, 3, []), got {(reused, len(promoted), wrong)}"
        f"; the operations were {ops}"
    )
    _serve_both(impl, [a, b, a], num_blocks=6, capacity=8, costs=COPY_WINS)


@dataclass(frozen=True)
class Workload:
    num_blocks: int
    capacity: int
    copy_wins: bool
    prompts: tuple[tuple[int, ...], ...]


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    """Two or three long shared prefixes (system prompts) with short tails, in a pool that
    holds about one prompt, and a host of a few blocks: evictions, demotions, drops and
    promotions at nearly every request."""
    num_blocks = draw(st.integers(3, 6))
    longest = num_blocks * BS
    token = st.integers(1, 3)
    base = st.lists(token, min_size=longest // 2, max_size=longest - 1)
    bases = draw(st.lists(base, min_size=2, max_size=3))
    prompt = st.tuples(st.sampled_from(bases), st.lists(token, min_size=1, max_size=3)).map(
        lambda pair: tuple((pair[0] + pair[1])[:longest])
    )
    return Workload(
        num_blocks,
        capacity=draw(st.sampled_from([1, 2, 4, 8, 8])),
        copy_wins=draw(st.sampled_from([True, True, True, False])),
        prompts=tuple(draw(st.lists(prompt, min_size=3, max_size=10))),
    )


def check_random_requests_reuse_the_right_kv(impl: ModuleType) -> None:
    """Random prompts, pools and hosts: every block picked up holds its prompt's KV"""

    @randomized(100, shrink=False)
    @given(workloads())
    def run(workload: Workload) -> None:
        costs = COPY_WINS if workload.copy_wins else RECOMPUTE_WINS
        prompts = [list(p) for p in workload.prompts]
        _serve_both(impl, prompts, workload.num_blocks, workload.capacity, costs)

    run()


HOST_TIER_CHECKS: list[Callable[[ModuleType], None]] = [
    check_remember_chains_keys_from_the_root,
    check_remember_hashes_each_block_once,
    check_evicted_blocks_are_demoted_in_the_order_they_were_keyed,
    check_a_full_host_drops_its_least_recent_copy,
    check_promoting_is_worth_it_only_when_copying_beats_recomputing,
    check_an_evicted_prefix_comes_back_from_the_host,
    check_random_requests_reuse_the_right_kv,
]

HOST_TIER_PROGRESS = (
    "each pass of extend must move on to the next key, or stop; demote must find a slot "
    "in one pass (a full host drops one copy)"
)

HOST_TIER_HINTS = (
    "Evicting a cached block need not lose its KV: copy it to host memory first, under a "
    "key that names its content (the whole prefix up to the block's end, chained from the "
    "root), so any later prompt with the same tokens finds it. The host has a fixed number "
    "of slots; when they run out, the copy demoted longest ago goes. A match that stops "
    "where the device tree ends can continue on the host: copy those blocks back, in "
    "order, while copying is cheaper than recomputing.",
    "remember: find the first block not in _key_of; chain block_keys from the key of the "
    "block before it (or root) over the rest. demote_evicted: the keyed blocks whose "
    "refcount is 0, each through demote, popping its key. demote: reuse the key's own "
    "slot if it has one, else a free slot, else pop the oldest of the OrderedDict (count "
    "the drop); record the key last. promote: pop the key's slot and free it. extend: lock "
    "the match; for each key after it, stop when not worth it or not on the host, make room "
    "for one block, look again, allocate, promote into ops; unlock; insert the longer "
    "prefix, remember it, free your own references to the promoted blocks.",
    "remember: the index of the first block missing from self._key_of (next() over "
    "enumerate(blocks), len(blocks) when none is), parent from blocks[first - 1] or "
    "self.root, keys over "
    "tokens[first * size : len(blocks) * size]. demote: `self._slots.popitem(last=False)` "
    "takes the least recent copy; `self._free_slots.pop()` a free slot. extend's keys: "
    "block_keys(self.root, token_ids, self.block_size)[match.num_blocks:]; the prefix to "
    "insert is token_ids[: (match.num_blocks + len(promoted)) * self.block_size] with "
    "match.blocks + promoted.",
)
