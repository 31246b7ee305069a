"""A cache-aware router in front of several `minserve serve` replicas (SGLang's router idea).

    minserve router --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 \
        --policy cache_aware --port 8000
"""

from minserve.router.app import Router, RouterConfig, build_router
from minserve.router.journal import Journal
from minserve.router.kv_aware import KVAware, KVAwareConfig
from minserve.router.kv_blocks import KVBlocks
from minserve.router.kv_feed import KVFeed
from minserve.router.kv_source import KVEventSource
from minserve.router.policy import POLICIES, CacheAware, Decision, RoundRobin, make_policy
from minserve.router.prefix_index import PrefixIndex, prompt_key
from minserve.router.route_request import RouteRequest

__all__ = [
    "POLICIES",
    "CacheAware",
    "Decision",
    "Journal",
    "KVAware",
    "KVAwareConfig",
    "KVBlocks",
    "KVEventSource",
    "KVFeed",
    "PrefixIndex",
    "RoundRobin",
    "RouteRequest",
    "Router",
    "RouterConfig",
    "build_router",
    "make_policy",
    "prompt_key",
]
