"""What a routing policy may read of one request."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from minserve.kvcache.block_key import BlockKey
from minserve.router.prefix_index import Key


@dataclass(frozen=True)
class RouteRequest:
    """A request as the router sees it before choosing a replica.

    `key` is all a key policy (round_robin, cache_aware, your own) reads. A request policy
    (kv_aware) also gets the prompt's token ids, tokenized exactly as a replica will, its
    session, and the keys of its full blocks under each replica root the router follows
    (a root fixes the block size: it is one of the fingerprint's fields).
    """

    key: Key | None
    token_ids: tuple[int, ...] | None = None  # None: not read, or not a valid request
    session: str | None = None  # the x-session-id header, else the body's "user"
    block_keys: Mapping[BlockKey, tuple[BlockKey, ...]] = field(default_factory=dict)
