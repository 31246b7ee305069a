"""Exercise 5.3's checks: the solutions pass them, and the usual wrong host tiers are caught
with a message that names what went wrong."""

from __future__ import annotations

import types

import pytest

from minserve.course import checks_ch05_host_tier as checks
from minserve.kvcache.block_key import block_keys
from minserve.kvcache.host_tier import HostPrefixTier
from minserve.messages import Demote


class KeysFromTheRoot(HostPrefixTier):
    """Keys each new block as if its prefix started at the root."""

    def remember(self, tokens, blocks):
        first = next((i for i, b in enumerate(blocks) if b not in self._key_of), len(blocks))
        size = self.block_size
        keys = block_keys(self.root, tokens[first * size : len(blocks) * size], size)
        self._key_of.update(zip(blocks[first:], keys))


class RekeysEverything(HostPrefixTier):
    """Hashes the whole prefix again every time (right keys, quadratic work)."""

    def remember(self, tokens, blocks):
        size = self.block_size
        self._key_of.update(zip(blocks, block_keys(self.root, tokens[: len(blocks) * size], size)))


class KeepsEvictedKeys(HostPrefixTier):
    """Demotes evicted blocks but never forgets their device keys."""

    def demote_evicted(self, allocator):
        return [self.demote(self._key_of[b], b) for b in self._key_of if allocator.refcount(b) == 0]


class DropsTheNewest(HostPrefixTier):
    """A full host drops its most recent copy instead of its least recent one."""

    def demote(self, key, block):
        if key in self._slots:
            self._free_slots.append(self._slots.pop(key))
        if not self._free_slots:
            _, slot = self._slots.popitem(last=True)
            self._free_slots.append(slot)
            self.num_dropped += 1
        slot = self._free_slots.pop()
        self._slots[key] = slot
        self.bytes_demoted += self.block_nbytes
        return Demote(block, slot)


class PromoteKeepsTheSlot(HostPrefixTier):
    """Promotes without freeing the host slot: the host fills up with copies it gave back."""

    def promote(self, key, block):
        promoted = super().promote(key, block)
        self._free_slots.remove(promoted.slot)
        self._slots[key.hex().encode()] = promoted.slot  # a slot nobody will ever free
        return promoted


class PromotionsAfterTheLoop(HostPrefixTier):
    """Queues its promotions after every demotion the loop decided, not in decision order."""

    def extend(self, match, token_ids, cache, allocator, make_room, ops):
        cache.lock(match.node)
        promoted, promotions = [], []
        for key in block_keys(self.root, token_ids, self.block_size)[match.num_blocks :]:
            if not self.worth_promoting() or key not in self:
                break
            make_room(1)
            if key not in self or not allocator.can_allocate(1):
                break
            promoted.append(allocator.allocate())
            promotions.append(self.promote(key, promoted[-1]))
        ops += promotions
        cache.unlock(match.node)
        if not promoted:
            return match
        tokens = token_ids[: (match.num_blocks + len(promoted)) * self.block_size]
        extended = cache.insert(tokens, match.blocks + promoted)
        self.remember(tokens, extended.blocks)
        for block in promoted:
            allocator.free(block)
        return extended


class AlwaysPromotes(HostPrefixTier):
    def worth_promoting(self):
        return True


def _student(tier_cls: type) -> types.SimpleNamespace:
    return types.SimpleNamespace(HostPrefixTier=tier_cls)


def test_the_solutions_pass_every_host_tier_check() -> None:
    import solutions.ch05_radix_cache as solutions

    for check in checks.HOST_TIER_CHECKS:
        check(solutions)


@pytest.mark.parametrize(
    ("check", "tier_cls", "says"),
    [
        (
            checks.check_remember_chains_keys_from_the_root,
            KeysFromTheRoot,
            "so its key chains from the key of [1, 2]",
        ),
        (
            checks.check_remember_hashes_each_block_once,
            RekeysEverything,
            "expected 4 digests (one per block), got 10",
        ),
        (
            checks.check_evicted_blocks_are_demoted_in_the_order_they_were_keyed,
            KeepsEvictedKeys,
            "expected (each block's key `in` the tier, _key_of, bytes_demoted, len)",
        ),
        (
            checks.check_a_full_host_drops_its_least_recent_copy,
            DropsTheNewest,
            "after demote(k0, 10), demote(k1, 11), demote(k2, 12): expected the operation and "
            "num_dropped (Demote(block=12, slot=0), 1), got (Demote(block=12, slot=1), 1)",
        ),
        (
            checks.check_promoting_is_worth_it_only_when_copying_beats_recomputing,
            AlwaysPromotes,
            "got (True, True)",
        ),
        (
            checks.check_random_requests_reuse_the_right_kv,
            PromoteKeepsTheSlot,
            "expected (tokens reused, block operations)",
        ),
        (
            checks.check_random_requests_reuse_the_right_kv,
            PromotionsAfterTheLoop,
            "were handed out for its prefix but hold other KV",
        ),
    ],
    ids=[
        "keys-from-the-root",
        "rekeys-everything",
        "keeps-evicted-keys",
        "drops-the-newest",
        "always-promotes",
        "promote-keeps-the-slot",
        "promotions-after-the-loop",
    ],
)
def test_a_wrong_host_tier_is_caught_with_what_went_wrong(check, tier_cls, says) -> None:
    with pytest.raises(AssertionError) as caught:
        check(_student(tier_cls))
    assert says in str(caught.value), str(caught.value)
