"""/metrics is current when scraped: from start, during a long step, and once idle.

The engine thread retakes its snapshot after every change, so a scrape while a step runs
sees the request that step runs; with the prefix cache on, free + evictable blocks add up
to the pool once nothing runs ("nothing leaked", read directly).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from test_server import wait_until_idle

from minserve import LLM
from minserve.server.app import build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig

MODEL = "tiny"
NUM_BLOCKS = 64


class HeldForward:
    """Wraps the model runner's forward: the `hold`-th call waits until `release` is set."""

    def __init__(self, forward, hold: int) -> None:
        self.forward, self.hold, self.calls = forward, hold, 0
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.hold:
            self.entered.set()
            self.release.wait(timeout=30)
        return self.forward(*args, **kwargs)


def scrape(url: str) -> dict[str, float]:
    """The unlabelled samples of /metrics (name -> value)."""
    text = httpx.get(url + "/metrics").text
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#") and "{" not in line
    }


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model("llama"), num_blocks=NUM_BLOCKS, block_size=4,
               enable_prefix_caching=True)  # fmt: skip


@pytest.fixture
def live(llm: LLM) -> Iterator[BackgroundServer]:
    background = BackgroundServer(build_server(llm.engine, ServerConfig(MODEL)))
    background.start()
    yield background
    background.stop()


def test_the_pool_size_is_exported_before_any_request(llm) -> None:
    server = build_server(LLM(llm.loaded, num_blocks=48, block_size=4).engine, ServerConfig(MODEL))
    with BackgroundServer(server, start_engine=False) as url:  # no engine loop has run yet
        metrics = scrape(url)
    assert metrics["minserve:kv_cache_total_blocks"] == 48
    assert metrics["minserve:kv_cache_free_blocks"] == 48


@pytest.mark.parametrize("hold, running, waiting", [(1, 0, 1), (3, 1, 0)],
                         ids=["during the prefill", "during a decode step"])  # fmt: skip
def test_gauges_show_the_request_a_long_step_runs(live, monkeypatch, hold, running, waiting):
    runner = live.server.engine.engine.worker.runner
    held = HeldForward(runner.sampled_hidden, hold)
    monkeypatch.setattr(runner, "sampled_hidden", held)
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 6, "ignore_eos": True}
    answer: list[httpx.Response] = []

    def post() -> None:
        answer.append(httpx.post(live.url + "/v1/completions", json=body, timeout=60))

    thread = threading.Thread(target=post)
    thread.start()
    try:
        assert held.entered.wait(timeout=30)
        metrics = scrape(live.url)  # the engine thread is inside the step
    finally:
        held.release.set()
        thread.join()
    assert metrics["minserve:num_requests_running"] == running
    assert metrics["minserve:num_requests_waiting"] == waiting
    assert metrics["minserve:num_requests_in_flight"] == 1  # read live, not from the snapshot
    assert metrics["minserve:kv_cache_total_blocks"] == NUM_BLOCKS
    assert answer[0].status_code == 200
    after = scrape(live.url)
    assert after["minserve:num_requests_running"] == after["minserve:num_requests_waiting"] == 0
    assert after["minserve:num_requests_in_flight"] == 0


def test_blocks_held_only_by_the_prefix_cache_are_a_gauge(live) -> None:
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    assert httpx.post(live.url + "/v1/completions", json=body, timeout=60).status_code == 200
    wait_until_idle(live.server)
    metrics = scrape(live.url)
    evictable = metrics["minserve:kv_cache_evictable_blocks"]
    assert evictable >= 3  # the prompt's full blocks of 4 tokens stay cached
    assert metrics["minserve:kv_cache_free_blocks"] + evictable == NUM_BLOCKS
    assert metrics["minserve:kv_cache_usage_perc"] == 0  # cached blocks nobody holds count free
