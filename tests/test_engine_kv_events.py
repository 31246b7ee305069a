"""The engine's KV events: a subscriber's index equals what the tiers hold, exactly.

Oracles: the radix tree itself (every path from its root spells a cached prefix; its
blocks' keys are the chained digests of those tokens, computed here from the tokens) and
the host tier's own account of its copies. Workload: four system prompts taking turns in
a pool that holds about two (tests/test_prefix_policy.py), so blocks are cached, evicted,
demoted to the host tier and promoted back; greedy tokens equal the reference path's.
"""

from __future__ import annotations

import pytest
from test_engine import token_ids
from test_prefix_policy import round_robin_workload

from minserve import LLM, SamplingParams
from minserve.kvcache.block_key import BlockKey, block_keys
from minserve.kvcache.kv_event_socket import KVEventSubscriber
from minserve.kvcache.kv_events import AllBlocksCleared, EventBatch
from minserve.kvcache.radix_cache import RadixCache, RadixNode
from minserve.router.exact_index import ExactIndex

EVENTS = {"enable_kv_cache_events": True}


def tree_keys(cache: RadixCache, root: BlockKey) -> set[BlockKey]:
    """The keys of every block the radix tree holds, from the tokens on its paths."""
    keys: set[BlockKey] = set()

    def walk(node: RadixNode, tokens: tuple[int, ...]) -> None:
        for child in node.children.values():
            path = tokens + child.key
            keys.update(block_keys(root, path, cache.block_size)[len(tokens) // cache.block_size :])
            walk(child, path)

    walk(cache.root, ())
    return keys


def receive_all(subscriber: KVEventSubscriber, index: ExactIndex, instance: str) -> int:
    """Apply every batch that arrives, replaying any gap; the number of batches received."""
    received = 0
    while (batch := subscriber.receive(timeout_ms=300)) is not None:
        received += 1
        if not index.apply(batch):
            kind, batches = subscriber.replay(index.replicas[instance].behind)
            assert kind == "batches"
            index.replay(instance, batches)
    return received


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[list[int]]:
    prompts, params = round_robin_workload()
    return token_ids(LLM(tiny_model("llama"), engine="reference").generate(prompts, params))


def _llm(tiny_model, **options) -> LLM:
    return LLM(tiny_model("llama"), enable_prefix_caching=True, block_size=4, num_blocks=12,
               max_num_seqs=1, kv_events_config=EVENTS, **options)  # fmt: skip


@pytest.mark.parametrize("host_gib", [0.0, 0.01])
def test_the_index_kept_from_events_equals_the_tiers(tiny_model, expected, host_gib) -> None:
    llm = _llm(tiny_model, kv_offloading_size=host_gib)
    engine = llm.engine
    info = engine.kv_events_info()
    subscriber = KVEventSubscriber(info["host"], info["port"], info["replay_port"])
    try:
        index = ExactIndex([info["instance"]])
        # the batches published before this subscriber joined (the opening "cleared" one)
        index.replay(info["instance"], subscriber.replay(0)[1])
        prompts, params = round_robin_workload()
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
        assert receive_all(subscriber, index, info["instance"]) > 0
        root = bytes.fromhex(info["root"])
        device = tree_keys(engine.kv.prefix.cache, root)
        assert device and index.blocks(info["instance"], "device") == device
        host = engine.kv.prefix.host
        held = set(host._slots) if host is not None else set()
        assert index.blocks(info["instance"], "host") == held
        assert bool(held) == (host_gib > 0)  # the workload does demote with a host tier
        assert index.replicas[info["instance"]].next_seq == engine.kv_events.log.next_seq
    finally:
        subscriber.close()
        engine.shutdown()


def test_a_late_subscriber_catches_up_from_a_snapshot(tiny_model) -> None:
    llm = _llm(tiny_model, kv_offloading_size=0.01)
    engine = llm.engine
    engine.kv_events.log._kept = type(engine.kv_events.log._kept)(maxlen=2)  # a short log
    prompts, params = round_robin_workload()
    llm.generate(prompts, params, use_tqdm=False)
    info = engine.kv_events_info()
    subscriber = KVEventSubscriber(info["host"], info["port"], info["replay_port"])
    try:
        kind, (snapshot,) = subscriber.replay(0)  # batch 0 fell out of the log
        assert kind == "snapshot"
        assert any(isinstance(e, AllBlocksCleared) for e in snapshot.events)
        index = ExactIndex([info["instance"]])
        index.resync(snapshot)
        root = bytes.fromhex(info["root"])
        assert index.blocks(info["instance"], "device") == tree_keys(engine.kv.prefix.cache, root)
        assert index.blocks(info["instance"], "host") == set(engine.kv.prefix.host._slots)
    finally:
        subscriber.close()
        engine.shutdown()


def test_events_have_keys_another_process_computes_from_the_tokens(tiny_model) -> None:
    """The same prompt gives the same keys in a fresh engine: keys are content addresses."""
    prompt = list(range(1, 14))  # 3 full blocks of 4, one token over
    keys = []
    for _ in range(2):
        llm = _llm(tiny_model)
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        events = engine_events(llm)
        keys.append([k for batch in events for e in batch.events if hasattr(e, "keys")
                     for k in e.keys])  # fmt: skip
        llm.engine.shutdown()
    root = bytes.fromhex(llm.engine.kv_events_info()["root"])
    assert keys[0] == keys[1]  # the prompt's blocks, then those its output filled
    assert keys[0][:3] == block_keys(root, prompt[:12], 4)


def engine_events(llm: LLM) -> list[EventBatch]:
    return list(llm.engine.kv_events.log._kept)


def test_events_need_the_prefix_cache(tiny_model) -> None:
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        LLM(tiny_model("llama"), kv_events_config=EVENTS)
    with pytest.raises(ValueError, match="unknown kv_events_config key"):
        LLM(tiny_model("llama"), enable_prefix_caching=True, kv_events_config={"enable": 1})
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        LLM(tiny_model("llama"), enable_prefix_caching=True,
            kv_events_config={**EVENTS, "endpoint": "localhost:5557"})  # fmt: skip


def test_the_server_says_where_its_events_are_published(tiny_model) -> None:
    from test_server_errors import send

    from minserve.server.app import ServerConfig, build_server

    llm = _llm(tiny_model)
    server = build_server(llm.engine, ServerConfig("tiny")).start()
    try:
        info = send(server, "GET", "/v1/kv_events").json()
        assert info == llm.engine.kv_events_info()
        subscriber = KVEventSubscriber(info["host"], info["port"], info["replay_port"])
        try:
            index = ExactIndex([info["instance"]])
            index.replay(info["instance"], subscriber.replay(0)[1])
            body = b'{"model": "tiny", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9], "max_tokens": 1}'
            assert send(server, "POST", "/v1/completions", body).status_code == 200
            receive_all(subscriber, index, info["instance"])
            root = bytes.fromhex(info["root"])
            assert index.blocks(info["instance"], "device") == set(
                block_keys(root, list(range(1, 9)), 4)
            )
        finally:
            subscriber.close()
    finally:
        server.shutdown()
        llm.engine.shutdown()
