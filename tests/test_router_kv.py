"""kv_aware routing: the feed keeps the router's index equal to what each replica's KV events
said (through dropped batches, lost logs and restarts), the policy picks the lowest estimated
time to first token, sessions stick, and the router app sends a prompt to its holder.

Oracles: the publishers' own held sets (what an engine holds), a brute-force minimum of the
cost formula over replicas, prefixes counted with set unions, and a real replica's own
tokenization of the prompts the router reads.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from minserve.kvcache.block_key import UNSHARED_ROOT, BlockKey, block_keys
from minserve.kvcache.kv_event_socket import KVEventPublisher
from minserve.kvcache.kv_events import MEDIA, AllBlocksCleared, BlockStored, EventLog, KVEvent
from minserve.router import KVAware, KVAwareConfig, KVBlocks, KVEventSource, KVFeed
from minserve.router.app import REPLICA_HEADER, RouterConfig, build_router
from minserve.router.prompt_reader import PromptReader, load_tokenizer
from minserve.router.route_request import RouteRequest
from minserve.server.background import BackgroundServer

ROOT_A = bytes(range(16))  # two models' key roots (any 16 bytes name a root)
ROOT_B = bytes(range(16, 32))
KEYS = block_keys(UNSHARED_ROOT, list(range(200)), 4)  # 50 chained keys


# ---------------------------------------------------------------- stand-in replicas


class Publisher:
    """A replica's KV event side: what it holds per medium, published as it changes."""

    def __init__(self, instance: str, capacity: int = 100, root: BlockKey = ROOT_A,
                 block_size: int = 4) -> None:  # fmt: skip
        self.held: dict[str, set[BlockKey]] = {m: set() for m in MEDIA}
        self.root, self.block_size = root, block_size
        self.socket = KVEventPublisher(EventLog(instance, capacity), lambda: self.held)
        self.publish(tuple(AllBlocksCleared(m) for m in MEDIA))  # a fresh log's first batch

    def change(self, events: tuple[KVEvent, ...]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.held[event.medium].update(event.keys)
            elif isinstance(event, AllBlocksCleared):
                self.held[event.medium].clear()

    def publish(self, events: tuple[KVEvent, ...]) -> None:
        self.change(events)
        self.socket.publish(events)

    def drop(self, events: tuple[KVEvent, ...]) -> None:
        """A change numbered and logged, never sent: lost on the way to every subscriber."""
        self.change(events)
        self.socket.log.append(events)

    def contract(self) -> dict:
        return {"instance": self.socket.log.instance, "root": self.root.hex(),
                "block_size": self.block_size, "host": "127.0.0.1", "port": self.socket.port,
                "replay_port": self.socket.replay_port}  # fmt: skip

    def close(self) -> None:
        self.socket.close()


class StandIn:
    """An OpenAI-shaped replica that records what reached it and serves /v1/kv_events."""

    def __init__(self, publisher: Publisher | None) -> None:
        self.publisher = publisher  # None: answers 404, publishes no events
        self.received: list[dict] = []

    @property
    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/kv_events")
        async def kv_events() -> JSONResponse:
            if self.publisher is None:
                return JSONResponse({"error": {"message": "no KV events"}}, status_code=404)
            return JSONResponse(self.publisher.contract())

        async def answer(body: dict) -> JSONResponse:
            self.received.append(body)
            return JSONResponse({"choices": [{"index": 0, "text": "ok"}]})

        app.post("/v1/completions")(answer)
        app.post("/v1/chat/completions")(answer)
        return app

    def start(self) -> StandIn:
        return self

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()


@contextmanager
def serving(*stand_ins: StandIn, port: int = 0) -> Iterator[list[str]]:
    servers = [BackgroundServer(s, port=port) for s in stand_ins]
    try:
        yield [server.start() for server in servers]
    finally:
        for server in servers:
            server.stop()


@contextmanager
def following(
    urls: list[str], check_s: float, blocks: KVBlocks | None = None
) -> Iterator[KVBlocks]:
    """A feed running over `urls` into `blocks` (new ones by default), stopped on exit."""
    blocks = KVBlocks(len(urls)) if blocks is None else blocks
    feed = KVFeed(urls, blocks, check_s=check_s, replay_timeout_s=0.5).start()
    try:
        yield blocks
    finally:
        feed.close()


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the feed did not catch up in time"
        time.sleep(0.01)


def synced(blocks: KVBlocks, replica: int, publisher: Publisher) -> bool:
    """The index holds exactly what the publisher holds, and has every batch it logged."""
    source = blocks.source(replica)
    if source is None or source.instance != publisher.socket.log.instance:
        return False
    if source.port != publisher.socket.port:
        return False
    return blocks.next_seq(replica) == publisher.socket.log.next_seq and all(
        blocks.held(replica, m) == publisher.held[m] for m in MEDIA
    )


def stored(keys: list[BlockKey], medium: str = "device") -> tuple[KVEvent, ...]:
    return (BlockStored(tuple(keys), None, medium),)


# ---------------------------------------------------------------- the feed


def test_published_batches_reach_the_index_and_a_dropped_one_is_replayed():
    publisher = Publisher("a")
    with serving(StandIn(publisher)) as urls, following(urls, check_s=0.1) as blocks:
        wait_for(lambda: synced(blocks, 0, publisher))  # the log so far, by the first replay
        publisher.publish(stored(KEYS[:4]) + stored(KEYS[4:6], "host"))
        wait_for(lambda: synced(blocks, 0, publisher))
        replays = blocks.catchup_counts()[0]["replay"]
        publisher.drop(stored(KEYS[10:12], "disk"))  # nobody hears it
        publisher.publish(stored(KEYS[20:21]))  # its number shows the gap
        wait_for(lambda: synced(blocks, 0, publisher))
        assert blocks.held(0, "disk") == set(KEYS[10:12])
        assert blocks.catchup_counts()[0]["replay"] == replays + 1
        assert blocks.catchup_counts()[0]["resync"] == 0


def test_batches_published_while_away_are_replayed_or_once_the_log_lost_them_a_snapshot():
    publisher = Publisher("a", capacity=3)
    blocks = KVBlocks(1)
    with serving(StandIn(publisher)) as urls:
        with following(urls, check_s=0.1, blocks=blocks):
            publisher.publish(stored(KEYS[:4]))
            wait_for(lambda: synced(blocks, 0, publisher))
        before = blocks.catchup_counts()[0]
        publisher.publish(stored(KEYS[4:6], "host"))  # the router is away: nobody hears it
        with following(urls, check_s=0.1, blocks=blocks):
            wait_for(lambda: synced(blocks, 0, publisher))
        replayed = blocks.catchup_counts()[0]
        assert (replayed["replay"], replayed["resync"]) == (before["replay"] + 1, 0)
        for i in range(4):  # more batches than the log keeps
            publisher.publish(stored(KEYS[10 + 5 * i : 13 + 5 * i], MEDIA[i % 3]))
        with following(urls, check_s=0.1, blocks=blocks):
            wait_for(lambda: synced(blocks, 0, publisher))  # the snapshot's number, + 1
        assert blocks.catchup_counts()[0]["resync"] == 1


def test_a_restarted_replica_starts_over_with_its_new_publisher():
    first = Publisher("a")
    stand_in = StandIn(first)
    with serving(stand_in) as urls, following(urls, check_s=0.05) as blocks:
        first.publish(stored(KEYS[:8]) + stored(KEYS[8:10], "disk"))
        wait_for(lambda: synced(blocks, 0, first))
        second = Publisher("a")  # new ports, its log from 0 with every medium cleared
        second.publish(stored(KEYS[30:33], "host"))
        stand_in.publisher = second
        first.close()
        wait_for(lambda: synced(blocks, 0, second))
        assert blocks.held(0, "device") == set() and blocks.held(0, "disk") == set()
        assert blocks.held(0, "host") == set(KEYS[30:33])
        assert blocks.catchup_counts()[0]["reset"] == 1


def test_batch_zero_again_on_the_same_sockets_starts_the_replica_over():
    blocks = KVBlocks(1)
    source = KVEventSource("a", ROOT_A, 4, "127.0.0.1", 1, 2)
    assert blocks.attach(0, source) and blocks.attach(0, source)  # the same source: kept
    before, after = EventLog("a"), EventLog("a")
    for batch in (before.append(stored(KEYS[:3])), before.append(stored(KEYS[3:5], "host"))):
        assert blocks.apply(0, batch)
    assert blocks.apply(0, before.since(0)[0])  # a batch seen again: skipped, nothing lost
    assert blocks.held(0, "host") == set(KEYS[3:5])
    assert blocks.apply(0, after.append(tuple(AllBlocksCleared(m) for m in MEDIA)))
    assert all(blocks.held(0, m) == set() for m in MEDIA) and blocks.next_seq(0) == 1
    assert blocks.catchup_counts()[0]["reset"] == 1
    other = KVBlocks(2)
    assert other.attach(0, source) and not other.attach(1, source)  # one name, two replicas


def free_url() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}", port


def test_a_replica_that_is_down_is_followed_once_up_and_one_without_events_never():
    url, port = free_url()
    quiet = StandIn(None)
    publisher = Publisher("late")
    publisher.publish(stored(KEYS[:5]))
    with serving(quiet) as (quiet_url,), following([url, quiet_url], check_s=0.05) as blocks:
        time.sleep(0.2)  # both asked a few times: one refuses the connection, one says 404
        assert blocks.source(0) is None and blocks.source(1) is None
        with serving(StandIn(publisher), port=port):
            wait_for(lambda: synced(blocks, 0, publisher))
        assert blocks.source(1) is None and blocks.match(1, {ROOT_A: KEYS}) is None


# ---------------------------------------------------------------- the policy


def prefix_by_union(keys: list[BlockKey], held: dict[str, set[BlockKey]]) -> dict[str, int]:
    """Leading blocks held in each medium or a faster one, counted by set unions."""
    counts, union = {}, set()
    for medium in MEDIA:
        union |= held[medium]
        counts[medium] = next((i for i, k in enumerate(keys) if k not in union), len(keys))
    return counts


def brute_force_seconds(
    config: KVAwareConfig, prompt: int, size: int, counts: dict[str, int] | None, guessed: int,
    load: int,
) -> float:  # fmt: skip
    """The cost formula, written out: prefill + loads from host and disk + queue."""
    queue = load * config.decode_s_per_request
    if counts is None:
        return (prompt - min(guessed, prompt)) / config.prefill_tokens_per_s + queue
    cached = min(counts["disk"] * size, prompt)
    loads = (counts["host"] - counts["device"]) * config.host_block_load_s + (
        counts["disk"] - counts["host"]
    ) * config.disk_block_load_s
    return (prompt - cached) / config.prefill_tokens_per_s + loads + queue


@pytest.mark.parametrize("seed", range(8))
def test_kv_aware_chooses_the_brute_force_minimum_of_the_estimate(seed):
    rng = random.Random(seed)
    config = KVAwareConfig(decode_s_per_request=rng.choice([0.01, 0.1]),
                           disk_block_load_s=rng.choice([0.005, 0.05]))  # fmt: skip
    blocks = KVBlocks(4)  # replicas 0, 1 (root A), 2 (root B) publish; 3 does not
    kinds = (("r0", ROOT_A, 4), ("r1", ROOT_A, 4), ("r2", ROOT_B, 8))
    sources = [KVEventSource(n, root, size, "127.0.0.1", 1, 2) for n, root, size in kinds]
    base = [rng.randrange(1000) for _ in range(48)]
    held = []  # per replica and medium: a random part of the base prompt's blocks, holes too
    for replica, source in enumerate(sources):
        blocks.attach(replica, source)
        log = EventLog(source.instance)
        mine = block_keys(source.root, base, source.block_size)
        held.append({m: set(rng.sample(mine, rng.randint(0, len(mine)))) for m in MEDIA})
        for medium in MEDIA:
            blocks.apply(replica, log.append(stored(sorted(held[-1][medium]), medium)))
    policy = KVAware(blocks, config)
    for _ in range(30):
        shared = rng.randint(0, 48)  # the base prompt's first `shared` tokens, then others
        ids = tuple(base[:shared] + [rng.randrange(1000, 2000) for _ in range(48 - shared)])
        keys = {root: tuple(block_keys(root, ids, size)) for root, size in blocks.roots().items()}
        request = RouteRequest(None, ids, None, keys)
        loads = [rng.randrange(4) for _ in range(4)]
        candidates = sorted(rng.sample(range(4), rng.randint(1, 4)))
        guessed = policy.guesses.match(ids)
        seconds = {}
        for r in candidates:
            source = sources[r] if r < 3 else None
            counts = None if source is None else prefix_by_union(
                list(request.block_keys[source.root]), held[r])  # fmt: skip
            size = 0 if source is None else source.block_size
            seconds[r] = brute_force_seconds(config, len(ids), size, counts, guessed[r], loads[r])
        decision = policy.choose_request(request, loads, candidates)
        assert seconds[decision.replica] == pytest.approx(min(seconds.values()), abs=1e-12)
        policy.record_request(request, decision.replica)


def test_held_blocks_on_the_device_beat_host_beat_disk_and_load_tips_the_balance():
    blocks = KVBlocks(3)
    ids = tuple(range(64))
    keys = block_keys(ROOT_A, ids, 16)  # 4 blocks
    for replica, medium in enumerate(MEDIA):
        blocks.attach(replica, KVEventSource(f"r{replica}", ROOT_A, 16, "127.0.0.1", 1, 2))
        blocks.apply(replica, EventLog(f"r{replica}").append(stored(keys, medium)))
    policy = KVAware(blocks, KVAwareConfig(prefill_tokens_per_s=500, decode_s_per_request=0.1))
    request = RouteRequest(None, ids, None, {ROOT_A: tuple(keys)})
    decision = policy.choose_request(request, [0, 0, 0], [0, 1, 2])
    assert (decision.replica, decision.reason, decision.matched) == (0, "kv", 64)
    assert decision.blocks == {"device": 4, "host": 0, "disk": 0}
    assert policy.choose_request(request, [0, 0, 0], [1, 2]).blocks == {
        "device": 0, "host": 4, "disk": 0
    }  # fmt: skip
    busy = policy.choose_request(request, [1, 0, 0], [0, 1, 2])  # 0.1 s of queue > 4 loads
    assert busy.replica == 1
    nothing = RouteRequest(
        None, (7,) * 64, None, {ROOT_A: tuple(block_keys(ROOT_A, (7,) * 64, 16))}
    )
    cold = policy.choose_request(nothing, [2, 1, 3], [0, 1, 2])
    assert (cold.replica, cold.reason, cold.matched) == (1, "least_loaded", 0)


def test_sessions_stick_within_their_ttl_and_move_after_it_or_when_their_replica_is_down():
    now = [0.0]
    blocks = KVBlocks(2)
    for replica in range(2):
        blocks.attach(replica, KVEventSource(f"r{replica}", ROOT_A, 16, "127.0.0.1", 1, 2))
    config = KVAwareConfig(prefill_tokens_per_s=500, session_ttl_s=300, session_margin_s=0.5)
    policy = KVAware(blocks, config, clock=lambda: now[0])
    ids = tuple(range(64))
    request = RouteRequest(None, ids, "alice", {ROOT_A: tuple(block_keys(ROOT_A, ids, 16))})
    first = policy.choose_request(request, [0, 0], [0, 1])
    home, other = first.replica, 1 - first.replica
    policy.record_request(request, home)
    blocks.apply(other, EventLog(f"r{other}").append(stored(block_keys(ROOT_A, ids, 16))))
    now[0] = 299.0  # the other replica now holds the prompt: 64 / 500 s = 0.128 s sooner
    stuck = policy.choose_request(request, [0, 0], [0, 1])
    assert (stuck.replica, stuck.reason) == (home, "session")
    policy.record_request(request, home)  # used again: its time to live starts over
    now[0] = 299.0 + 300.0
    moved = policy.choose_request(request, [0, 0], [0, 1])
    assert (moved.replica, moved.reason) == (other, "kv")
    now[0] = 600.0  # a fresh session on `home` ...
    policy.record_request(request, home)
    down = policy.choose_request(request, [0, 0], [other])  # ... whose replica is down
    assert (down.replica, down.reason) == (other, "kv")
    strict = KVAware(blocks, KVAwareConfig(session_margin_s=0.05), clock=lambda: now[0])
    strict.record_request(request, home)  # 0.128 s worse than the best > 0.05 s margin
    assert strict.choose_request(request, [0, 0], [0, 1]).replica == other


def test_a_replica_without_events_is_judged_by_the_prompts_it_was_sent():
    blocks = KVBlocks(2)
    blocks.attach(0, KVEventSource("r0", ROOT_A, 16, "127.0.0.1", 1, 2))  # holds nothing
    policy = KVAware(blocks)
    ids = tuple(range(64))
    request = RouteRequest(None, ids, None, {ROOT_A: tuple(block_keys(ROOT_A, ids, 16))})
    policy.record_request(request, 1)
    decision = policy.choose_request(request, [0, 0], [0, 1])
    assert (decision.replica, decision.reason, decision.matched) == (1, "kv", 64)
    assert decision.blocks == {}  # a guess names no medium


def test_bad_kv_aware_settings_are_refused():
    with pytest.raises(ValueError, match="prefill_tokens_per_s must be > 0"):
        KVAwareConfig(prefill_tokens_per_s=0)
    with pytest.raises(ValueError, match="must be >= 0: session_ttl_s"):
        KVAwareConfig(session_ttl_s=-1)
    with pytest.raises(ValueError, match="unusable body"):
        KVEventSource.from_json({"instance": "a", "root": "zz"})
    with pytest.raises(ValueError, match="root of 16 bytes"):
        KVEventSource.from_json({"instance": "a", "root": "ab", "block_size": 4, "host": "h",
                                 "port": 1, "replay_port": 2})  # fmt: skip


# ---------------------------------------------------------------- prompts and the app


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()  # the bundled model's, as the router's default


def test_the_router_reads_prompts_as_a_real_replica_tokenizes_them(tiny_model):
    from minserve import LLM
    from minserve.server.app import build_server
    from minserve.server.serving import ServerConfig

    tokenizer = load_tokenizer(tiny_model("llama"))  # as --tokenizer names the served model
    reader = PromptReader(tokenizer)
    llm = LLM(tiny_model("llama"), num_blocks=64)
    text = "The router hashes blocks of tokens, not characters: naïve café ünïcode."
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    with BackgroundServer(build_server(llm.engine, ServerConfig("m"))) as url:
        echo = {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0}
        echoed = httpx.post(url + "/v1/completions", json=echo).json()
        chat = httpx.post(url + "/v1/chat/completions",
                          json={"messages": messages, "max_tokens": 1}).json()  # fmt: skip
    ids = reader.token_ids(httpx.Request("POST", "/", json={"prompt": text}).content, chat=False)
    assert echoed["choices"][0]["logprobs"]["tokens"] == [
        tokenizer.decode([t], skip_special_tokens=False) for t in ids
    ]
    chat_ids = reader.token_ids(httpx.Request("POST", "/", json={"messages": messages}).content,
                                chat=True)  # fmt: skip
    assert chat["usage"]["prompt_tokens"] == len(chat_ids) > len(ids)
    assert reader.token_ids(b'{"prompt": [5, 6, 7]}', chat=False) == [5, 6, 7]
    assert reader.token_ids(b'{"prompt": "x", "bogus": 1}', chat=False) is None  # refused there


def test_the_router_sends_a_request_to_the_replica_that_holds_its_prefix(tokenizer):
    reader = PromptReader(tokenizer)
    completion = {"prompt": "You are a careful assistant. " * 8 + "What is a KV cache?",
                  "max_tokens": 2}  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "Tell me about radix trees. " * 6}]}
    ids = reader.token_ids(httpx.Request("POST", "/", json=completion).content, chat=False)
    chat_ids = reader.token_ids(httpx.Request("POST", "/", json=chat).content, chat=True)
    a, b = Publisher("a", block_size=16), Publisher("b", block_size=16)
    b.publish(stored(block_keys(ROOT_A, ids, 16)))  # B holds the completion's prompt
    a.publish(stored(block_keys(ROOT_A, chat_ids, 16), "host"))  # A the chat's, on host
    stand_ins = [StandIn(a), StandIn(b)]
    with serving(*stand_ins) as urls:
        router = BackgroundServer(build_router(RouterConfig(tuple(urls), policy="kv_aware",
                                                            kv_events_check_s=0.05)))  # fmt: skip
        router.start()
        try:
            blocks = router.server.feed.blocks
            wait_for(lambda: synced(blocks, 0, a) and synced(blocks, 1, b))
            assert router.server.feed.instances() == {urls[0]: "a", urls[1]: "b"}
            answered = [httpx.post(router.url + "/v1/completions", json=completion)
                        for _ in range(2)]  # fmt: skip
            to_a = httpx.post(router.url + "/v1/chat/completions", json=chat,
                              headers={"x-session-id": "s1"})  # fmt: skip
            metrics = httpx.get(router.url + "/metrics").text
        finally:
            router.stop()
    assert [r.headers[REPLICA_HEADER] for r in answered] == [urls[1]] * 2
    assert stand_ins[1].received == [completion] * 2
    assert to_a.headers[REPLICA_HEADER] == urls[0] and stand_ins[0].received == [chat]
    full = len(ids) // 16
    assert f'expected_block_hits_total{{medium="device",replica="{urls[1]}"}} {2.0 * full}' in (
        metrics
    )
    host = f'expected_block_hits_total{{medium="host",replica="{urls[0]}"}} {len(chat_ids) // 16}'
    assert host + ".0" in metrics
    assert f'requests_routed_total{{reason="kv",replica="{urls[1]}"}} 2.0' in metrics
