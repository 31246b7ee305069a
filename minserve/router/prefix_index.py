"""What the router believes each replica has cached: SGLang's approximate prefix tree, as
chained chunk hashes (the same trick as the engine's block hashes).

The router never sees a replica's radix cache. It remembers the prompts it sent where, and
assumes a replica still holds a prompt it served recently. A prompt is cut into chunks of
`chunk_size` units (characters of text, or token ids); chunk i is named by a hash of chunk i
and the hash of chunk i-1, so one hash stands for the whole prefix up to it:

    prompt   [ system prompt ....... | user 1 ......... | user 2 ... ]
    hashes     h0 ─► h1 ─► h2 ─► h3 ─► h4 ─► h5 ─► h6     (the tail shorter than a chunk: none)

A replica "holds" a prefix of n chunks when it has h0..h(n-1). Each replica keeps at most
`capacity` hashes, evicted least recently used first, as its own cache would.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

from minserve.kvcache.block_key import UNSHARED_ROOT, BlockKey, block_keys

Key = str | tuple[int, ...]  # a prompt as text (characters) or as token ids


def prompt_key(body: bytes) -> Key | None:
    """The part of an OpenAI request body that a replica caches; None if there is none.

    Chat messages become one text (role and content, separated so "ab"+"c" != "a"+"bc");
    a batch of prompts is keyed by its first prompt.
    """
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    if isinstance(request.get("messages"), list):
        return "".join(_message_text(m) for m in request["messages"])
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: the first prompt stands for it
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return tuple(prompt)
    return None


def _message_text(message: object) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):  # text parts
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return f"\x1e{message.get('role')}\x1f{content}"


def chunk_hashes(key: Key, chunk_size: int) -> list[BlockKey]:
    """One hash per full chunk; each covers the whole prefix up to the end of its chunk.
    Chained with `block_key.next_key` (text as its characters' code points), so the same
    prompt hashes the same in every process and after a restart."""
    units = [ord(c) for c in key] if isinstance(key, str) else list(key)
    return block_keys(UNSHARED_ROOT, units, chunk_size)


class PrefixIndex:
    """Per replica, an LRU set of prefix hashes: which prompts it was sent and may still hold."""

    def __init__(self, num_replicas: int, chunk_size: int = 16, capacity: int = 65536) -> None:
        if chunk_size < 1 or capacity < 1:
            raise ValueError(f"chunk_size and capacity must be >= 1, got {chunk_size}, {capacity}")
        self.chunk_size, self.capacity = chunk_size, capacity
        self._held: list[OrderedDict[BlockKey, None]] = [OrderedDict() for _ in range(num_replicas)]

    def match(self, key: Key) -> list[int]:
        """For each replica, how many leading units of `key` it is expected to hold."""
        hashes = chunk_hashes(key, self.chunk_size)
        return [self._run(held, hashes) * self.chunk_size for held in self._held]

    def insert(self, key: Key, replica: int) -> None:
        """Record that `replica` was sent `key`; evict its least recently used hashes."""
        held = self._held[replica]
        # Touch the deepest chunk first, so a prefix's root is the most recent: eviction
        # then trims prompts from their tails, as a radix tree evicts leaves first.
        for h in reversed(chunk_hashes(key, self.chunk_size)):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def size(self, replica: int) -> int:
        """Chunks recorded for `replica`."""
        return len(self._held[replica])

    @staticmethod
    def _run(held: OrderedDict[BlockKey, None], hashes: Sequence[BlockKey]) -> int:
        count = 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        return count
