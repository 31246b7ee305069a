"""A failing engine step fails only the requests it ran, and the server keeps serving.

Failures are injected into the model runner's decoder pass, `sampled_hidden`, under both
`forward` and `forward_greedy` (what a kernel error or an out-of-memory would raise).
Oracles: `LLM.generate` on the same weights for the requests that go on, and the invariant
that every KV block is free once the server is idle.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from test_server import GREEDY, MODEL, expected_text, wait_until_idle

from minserve import LLM
from minserve.server.app import build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig

LONG = {"model": MODEL, "max_tokens": 300, "ignore_eos": True, "temperature": 0}


class FailingForward:
    """Wraps `runner.sampled_hidden`: raises once when `trigger()` is set, slows every step."""

    def __init__(self, forward, delay_s: float = 0.0) -> None:
        self.forward, self.delay_s = forward, delay_s
        self.trigger = threading.Event()
        self.failed = threading.Event()

    def __call__(self, inputs):
        time.sleep(self.delay_s)
        if self.trigger.is_set() and not self.failed.is_set():
            self.failed.set()
            raise RuntimeError("injected: CUDA error: an illegal memory access")
        return self.forward(inputs)


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model("llama"), num_blocks=256, block_size=4, max_num_seqs=1)


@pytest.fixture(scope="module")
def oracle(llm: LLM) -> LLM:
    return LLM(llm.loaded, num_blocks=256, block_size=4)


@pytest.fixture
def live(llm: LLM, monkeypatch) -> Iterator[tuple[BackgroundServer, FailingForward]]:
    """A fresh server (one seat: a second request waits) whose forward can be made to fail."""
    failing = FailingForward(llm.engine.worker.runner.sampled_hidden, delay_s=0.003)
    monkeypatch.setattr(llm.engine.worker.runner, "sampled_hidden", failing)
    background = BackgroundServer(build_server(llm.engine, ServerConfig(MODEL)))
    background.start()
    yield background, failing
    background.stop()


def sse_data(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def assert_step_failure(error: dict) -> None:
    assert error["type"] == "server_error"
    assert error["code"] == "engine_step_failed"
    assert "RuntimeError: injected: CUDA error" in error["message"]


def assert_serving_again(background: BackgroundServer, oracle: LLM) -> None:
    body = {"model": MODEL, "prompt": "Still there?", **GREEDY}
    response = httpx.post(background.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == expected_text(oracle, "Still there?")
    assert httpx.get(background.url + "/health").status_code == 200


def test_a_failed_step_answers_500_then_the_server_serves_the_next_request(live, oracle) -> None:
    background, failing = live
    before = wait_until_idle(background.server)
    failing.trigger.set()
    body = {"model": MODEL, "prompt": "Hello", **GREEDY}
    response = httpx.post(background.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 500
    assert_step_failure(response.json()["error"])
    stats = wait_until_idle(background.server, 30)  # the failed request's blocks are back
    assert stats["num_requests_aborted"] == before["num_requests_aborted"] + 1
    assert_serving_again(background, oracle)
    metrics = httpx.get(background.url + "/metrics").text
    assert "minserve:engine_step_failures_total 1.0" in metrics
    assert "minserve:request_failure_total 1.0" in metrics


def test_a_stream_whose_step_fails_ends_with_an_error_event_then_done(live, oracle) -> None:
    background, failing = live
    body = {**LONG, "prompt": "Tell me a long story", "stream": True}
    with httpx.stream("POST", background.url + "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = next(lines)
        failing.trigger.set()  # tokens are flowing: fail one of the next steps
        events = sse_data([first, *lines])
    assert response.status_code == 200  # the headers went out before the failure
    assert json.loads(events[0])["choices"][0]["text"] is not None
    assert events[-1] == "[DONE]"
    assert_step_failure(json.loads(events[-2])["error"])
    assert len(events) - 2 < LONG["max_tokens"]  # it did stop early
    wait_until_idle(background.server)
    assert_serving_again(background, oracle)


def test_only_the_requests_in_the_failed_step_fail(live, oracle) -> None:
    """One seat: A decodes while B waits; A's step fails; B then runs and answers in full."""
    background, failing = live
    engine = background.server.engine.engine
    before = wait_until_idle(background.server)

    async def scenario() -> tuple[list[str], httpx.Response]:
        async with httpx.AsyncClient(base_url=background.url, timeout=60) as http:
            body = {**LONG, "prompt": "Tell me a long story", "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as a:
                lines = a.aiter_lines()
                first = await anext(lines)
                b = asyncio.create_task(
                    http.post("/v1/completions", json={"prompt": "Waiting here", **GREEDY})
                )
                while len(engine.output_processor.requests) < 2:  # B is queued behind A
                    await asyncio.sleep(0.005)
                failing.trigger.set()
                events = sse_data([first] + [line async for line in lines])
            return events, await b

    events, b = asyncio.run(scenario())
    assert_step_failure(json.loads(events[-2])["error"])
    assert b.status_code == 200
    assert b.json()["choices"][0]["text"] == expected_text(oracle, "Waiting here")
    stats = wait_until_idle(background.server)
    assert stats["num_requests_aborted"] == before["num_requests_aborted"] + 1
    assert stats["num_requests_finished"] == before["num_requests_finished"] + 1


def test_a_crashed_engine_loop_fails_what_is_in_flight_and_stops_taking_work(live, monkeypatch):
    """A bug outside step() ends the loop: in-flight requests get a 500, new ones a 503."""
    background, _ = live

    def broken_metrics() -> dict:
        raise RuntimeError("injected: a bug in the metrics")

    monkeypatch.setattr(background.server.engine.engine, "get_metrics", broken_metrics)
    body = {"model": MODEL, "prompt": "Hello", **GREEDY}
    response = httpx.post(background.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 500
    assert "the engine loop crashed" in response.json()["error"]["message"]
    deadline = time.monotonic() + 10
    while background.server.engine.is_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert httpx.get(background.url + "/health").status_code == 503
    refused = httpx.post(background.url + "/v1/completions", json=body, timeout=30)
    assert refused.status_code == 503
    assert refused.json()["error"]["message"] == "the engine loop is not running"
