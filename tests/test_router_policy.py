"""The router's pieces on their own: the prompt key, the prefix index and the policies.

Oracle: longest common prefix computed by hand (os.path.commonprefix) at chunk granularity.
"""

from __future__ import annotations

import json
import os

import pytest

from minserve.router import CacheAware, PrefixIndex, RoundRobin, RouterConfig, make_policy
from minserve.router.prefix_index import prompt_key


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_prompt_key_is_the_text_the_token_ids_or_the_conversation():
    assert prompt_key(body(prompt="hello")) == "hello"
    assert prompt_key(body(prompt=[5, 6, 7])) == (5, 6, 7)
    assert prompt_key(body(prompt=["first", "second"])) == "first"
    assert prompt_key(body(prompt=[[1, 2], [3]])) == (1, 2)
    turn1 = [{"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    assert prompt_key(body(messages=turn2)).startswith(prompt_key(body(messages=turn1)))
    text_parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    parts = [{"role": "user", "content": text_parts}]
    assert prompt_key(body(messages=parts)) == prompt_key(body(messages=turn1))


@pytest.mark.parametrize("raw", [b"{oops", b"[1, 2]", b'{"prompt": 5}', b'{"prompt": [1, "a"]}'])
def test_prompt_key_of_a_body_without_a_prompt_is_none(raw):
    assert prompt_key(raw) is None


@pytest.mark.parametrize("shared", [0, 3, 4, 5, 11, 12, 13, 20])
def test_match_is_the_common_prefix_rounded_down_to_whole_chunks(shared):
    index = PrefixIndex(num_replicas=2, chunk_size=4)
    seen = "a" * shared + "x" * 9
    index.insert(seen, replica=1)
    asked = "a" * shared + "y" * 9
    common = len(os.path.commonprefix([seen, asked]))
    assert index.match(asked) == [0, common // 4 * 4]
    assert index.match(seen) == [0, len(seen) // 4 * 4]


def test_eviction_forgets_the_least_recently_sent_prompts_tails_first():
    index = PrefixIndex(num_replicas=1, chunk_size=2, capacity=4)
    index.insert("aabbcc", 0)  # 3 chunks
    index.insert("zzyy", 0)  # 2 more: over capacity by one, the oldest tail goes
    assert index.size(0) == 4
    assert index.match("aabbcc") == [4]  # "aa", "bb" kept; "cc" evicted
    assert index.match("zzyy") == [4]


def test_cache_aware_prefers_the_longest_prefix_then_the_least_loaded():
    policy = CacheAware(PrefixIndex(3, chunk_size=2), balance_threshold=2)
    policy.record("aabbcc", 1)
    policy.record("aabb", 2)
    decision = policy.choose("aabbccdd", loads=[0, 0, 0], candidates=[0, 1, 2])
    assert (decision.replica, decision.reason, decision.matched) == (1, "prefix", 6)
    assert policy.choose("aabbccdd", [0, 2, 0], [0, 1, 2]).replica == 1  # 2 - 0 <= 2
    balanced = policy.choose("aabbccdd", [0, 3, 1], [0, 1, 2])  # 3 - 0 > 2
    assert (balanced.replica, balanced.reason) == (0, "balance")
    assert policy.choose("aabbccdd", [0, 0, 0], [0, 2]).replica == 2  # 1 is down: next best
    unknown = policy.choose("qqrr", [3, 1, 2], [0, 1, 2])
    assert (unknown.replica, unknown.reason) == (1, "least_loaded")


def test_ties_in_load_rotate_and_round_robin_skips_down_replicas():
    policy = CacheAware(PrefixIndex(2), balance_threshold=0)
    assert [policy.choose(None, [0, 0], [0, 1]).replica for _ in range(4)] == [0, 1, 0, 1]
    rr = RoundRobin()
    assert [rr.choose(None, [9, 0, 0], [0, 1, 2]).replica for _ in range(4)] == [0, 1, 2, 0]
    assert {rr.choose(None, [0, 0, 0], [0, 2]).replica for _ in range(4)} == {0, 2}


def test_bad_settings_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random", 2)
    with pytest.raises(ValueError, match="at least one replica"):
        RouterConfig(())
    with pytest.raises(ValueError, match="must start with http"):
        RouterConfig(("localhost:8000",))
    with pytest.raises(ValueError, match="listed twice"):
        RouterConfig(("http://a:1", "http://a:1/v1"))
    with pytest.raises(ValueError, match="balance_threshold must be >= 0"):
        make_policy("cache_aware", 2, balance_threshold=-1)
