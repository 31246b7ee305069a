"""The router in front of two live replicas: answers equal a direct call, and requests go
where the policy says.

Oracle: the same request sent straight to a replica (both replicas share the weights), and
each replica's own engine counters (which requests it finished, which prompt tokens its
prefix cache served), not the router's claims about itself.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from openai import OpenAI

from minserve import LLM
from minserve.router import RouterConfig, build_router
from minserve.router.app import REPLICA_HEADER
from minserve.router.policy import Decision
from minserve.server.app import build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig

MODEL = "tiny-llama"
GREEDY = dict(temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
SHARED = "You are a careful assistant. Answer every question about caches briefly. " * 2


@pytest.fixture(scope="module")
def replicas(tiny_model) -> Iterator[list[BackgroundServer]]:
    """Two `minserve serve` replicas with prefix caching, on ephemeral ports."""
    first = LLM(tiny_model("llama"), num_blocks=256, block_size=4, enable_prefix_caching=True)
    second = LLM(first.loaded, num_blocks=256, block_size=4, enable_prefix_caching=True)
    servers = [
        BackgroundServer(build_server(llm.engine, ServerConfig(MODEL))) for llm in (first, second)
    ]
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.stop()


def start_router(urls: list[str], **options) -> BackgroundServer:
    background = BackgroundServer(build_router(RouterConfig(tuple(urls), **options)))
    background.start()
    return background


@pytest.fixture(scope="module")
def cache_aware(replicas) -> Iterator[BackgroundServer]:
    router = start_router([r.url for r in replicas], policy="cache_aware")
    yield router
    router.stop()


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def settled_stats(replica: BackgroundServer, timeout_s: float = 30.0) -> dict:
    """The replica's stats once its engine is idle and the snapshot has caught up with it."""
    engine, deadline = replica.server.engine, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.stats
        if not engine.engine.has_unfinished_requests() and stats == engine.engine.get_metrics():
            return stats
        time.sleep(0.01)
    raise AssertionError(f"replica {replica.url} did not settle within {timeout_s} s")


def finished(replica: BackgroundServer, at_least: int = 0, timeout_s: float = 30.0) -> int:
    """Requests the replica's engine finished (its stats snapshot trails by one loop)."""
    deadline = time.monotonic() + timeout_s
    while (count := replica.server.engine.stats["num_requests_finished"]) < at_least:
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return int(count)


def send(router_url: str, prompt: str) -> str:
    """POST a completion through the router; return the replica that answered."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    response = httpx.post(router_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.headers[REPLICA_HEADER]


def test_completion_and_chat_through_the_router_equal_a_direct_call(cache_aware, replicas):
    direct, routed = client(replicas[0].url), client(cache_aware.url)
    want = direct.completions.create(model=MODEL, prompt="Hello, my name is", **GREEDY)
    got = routed.completions.create(model=MODEL, prompt="Hello, my name is", **GREEDY)
    assert got.choices[0].text == want.choices[0].text
    assert got.usage == want.usage
    messages = [{"role": "user", "content": "Name three colours."}]
    want = direct.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    got = routed.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert got.choices[0].message.content == want.choices[0].message.content


def test_streams_come_through_the_openai_client_unchanged(cache_aware, replicas):
    direct, routed = client(replicas[1].url), client(cache_aware.url)
    options = dict(model=MODEL, prompt="Once upon a time", stream=True,
                   stream_options={"include_usage": True}, **GREEDY)  # fmt: skip
    want = list(direct.completions.create(**options))
    got = list(routed.completions.create(**options))
    assert len(got) == len(want) > 2
    assert [c.choices[0].text for c in got if c.choices] == [
        c.choices[0].text for c in want if c.choices
    ]
    assert got[-1].choices == [] and got[-1].usage == want[-1].usage
    messages = [{"role": "user", "content": "Hi!"}]
    chunks = routed.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY)
    reply = direct.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        reply.choices[0].message.content
    )


def test_cache_aware_sends_a_shared_prefix_to_one_replica_whose_cache_then_hits(
    cache_aware, replicas
):
    settled = [settled_stats(r) for r in replicas]
    before = [int(s["num_requests_finished"]) for s in settled]
    hits_before = [s["prefix_cache_hits"] for s in settled]
    answered = [send(cache_aware.url, SHARED + f"Question {i}: why?") for i in range(4)]
    assert len(set(answered)) == 1
    chosen = [r.url for r in replicas].index(answered[0])
    after = [finished(r, at_least=before[i] + 4 * (i == chosen)) for i, r in enumerate(replicas)]
    assert after[chosen] - before[chosen] == 4 and after[1 - chosen] == before[1 - chosen]
    hits = replicas[chosen].server.engine.stats["prefix_cache_hits"] - hits_before[chosen]
    assert hits >= 3 * 16  # the 3 later requests each reused at least 16 prefix tokens


def test_round_robin_alternates_even_when_prompts_share_a_prefix(replicas):
    router = start_router([r.url for r in replicas], policy="round_robin")
    try:
        answered = [send(router.url, SHARED + f"Question {i}: why?") for i in range(4)]
    finally:
        router.stop()
    a, b = (r.url for r in replicas)
    assert answered in ([a, b, a, b], [b, a, b, a])


class AlwaysSecond:
    """A policy object of one's own (as chapter 09's exercise plugs in): always replica 1."""

    name = "always_second"

    def __init__(self) -> None:
        self.recorded: list[int] = []

    def choose(self, key, loads, candidates) -> Decision:
        return Decision(1, "prefix")

    def record(self, key, replica: int) -> None:
        self.recorded.append(replica)


def test_a_policy_object_given_to_build_router_decides(replicas):
    policy = AlwaysSecond()
    config = RouterConfig(tuple(r.url for r in replicas), "round_robin")
    router = BackgroundServer(build_router(config, policy=policy))
    router.start()
    try:
        answered = [send(router.url, f"Question {i}: why?") for i in range(3)]
    finally:
        router.stop()
    assert answered == [replicas[1].url] * 3 and policy.recorded == [1, 1, 1]


@dataclass
class GatedReplica:
    """A stand-in replica whose answers wait until `gate` opens: a request held in flight."""

    gate: threading.Event

    @property
    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions() -> StreamingResponse:
            async def wait() -> AsyncIterator[bytes]:
                while not self.gate.is_set():
                    await asyncio.sleep(0.005)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(wait(), media_type="text/event-stream")

        return app

    def start(self) -> GatedReplica:
        return self

    def shutdown(self) -> None:
        self.gate.set()


def test_a_busy_replica_loses_its_prefix_past_the_balance_threshold():
    gates = [threading.Event(), threading.Event()]
    servers = [BackgroundServer(GatedReplica(gate)) for gate in gates]
    urls = [server.start() for server in servers]
    router = start_router(urls, policy="cache_aware", balance_threshold=1)
    http = httpx.Client(base_url=router.url, timeout=30)

    def open_stream(prompt: str) -> httpx.Response:  # headers now, body once its gate opens
        return http.send(http.build_request("POST", "/v1/completions", json={"prompt": prompt}),
                         stream=True)  # fmt: skip

    try:
        first, second = open_stream(SHARED + "0"), open_stream(SHARED + "1")
        home = first.headers[REPLICA_HEADER]
        assert second.headers[REPLICA_HEADER] == home  # loads 1 vs 0: within the threshold
        third = open_stream(SHARED + "2")  # loads 2 vs 0: past it, so the least loaded
        assert third.headers[REPLICA_HEADER] != home
        for gate in gates:
            gate.set()
        for response in (first, second, third):
            response.read()
        assert open_stream(SHARED + "3").headers[REPLICA_HEADER] == home  # idle: prefix wins
    finally:
        http.close()
        router.stop()
        for server in servers:
            server.stop()


def test_a_client_that_leaves_mid_answer_no_longer_counts_as_load():
    gate = threading.Event()
    replica = BackgroundServer(GatedReplica(gate))
    router = start_router([replica.start()])
    try:
        with httpx.stream("POST", router.url + "/v1/completions", json={"prompt": "hi"}):
            assert router.server.replicas[0].in_flight == 1  # the answer has not come
        deadline = time.monotonic() + 5  # left without reading: the router notices
        while router.server.replicas[0].in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert router.server.replicas[0].in_flight == 0
    finally:
        router.stop()
        replica.stop()


def free_port_url() -> str:
    """An address nothing listens on (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_dead_replica_is_skipped_and_shown_in_metrics(replicas):
    dead = free_port_url()
    router = start_router([dead, replicas[0].url], policy="round_robin", cooldown_s=60)
    try:
        answered = [send(router.url, f"prompt {i}") for i in range(3)]
        health = httpx.get(router.url + "/health")
        metrics = httpx.get(router.url + "/metrics").text
    finally:
        router.stop()
    assert answered == [replicas[0].url] * 3
    assert health.status_code == 200 and health.json()["replicas"][replicas[0].url] == "up"
    assert "ConnectError" in health.json()["replicas"][dead]
    assert f'minserve_router:replica_up{{replica="{dead}"}} 0.0' in metrics
    # refused: the first request, then the /health probe (the cooldown kept the rest off it)
    assert f'minserve_router:replica_errors_total{{replica="{dead}"}} 2.0' in metrics
    assert f'minserve_router:requests_in_flight{{replica="{replicas[0].url}"}} 0.0' in metrics
    routed = f'requests_routed_total{{reason="round_robin",replica="{replicas[0].url}"}} 3.0'
    assert "minserve_router:" + routed in metrics


def test_no_live_replica_is_a_503_in_openai_format_and_the_router_keeps_serving(replicas):
    router = start_router([free_port_url(), free_port_url()])
    try:
        for _ in range(2):  # refused twice: still answering
            response = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"})
            assert response.status_code == 503
            error = response.json()["error"]
            assert error["code"] == "no_replica_available" and error["type"] == "overloaded_error"
            assert error["message"].startswith("no replica is available: http://127.0.0.1:")
        assert httpx.get(router.url + "/health").status_code == 503
        assert httpx.get(router.url + "/metrics").status_code == 200
    finally:
        router.stop()


def test_a_replicas_own_error_is_relayed_unchanged(cache_aware, replicas):
    bad = {"model": MODEL, "prompt": "hi", "max_tokens": -1}
    direct = httpx.post(replicas[0].url + "/v1/completions", json=bad)
    routed = httpx.post(cache_aware.url + "/v1/completions", json=bad)
    assert routed.status_code == direct.status_code == 400
    assert routed.json() == direct.json()
    assert httpx.post(cache_aware.url + "/v1/completions", content=b"{oops").status_code == 400
    models = httpx.get(cache_aware.url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL
