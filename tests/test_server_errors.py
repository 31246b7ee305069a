"""Every malformed request gets the right 4xx in OpenAI's error shape; the server keeps serving.

Each case sends one bad request to the app in-process, checks the status, the error type
and the field named, then sends a good request and checks it is answered.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from minserve import LLM
from minserve.server.app import Server, build_server
from minserve.server.serving import ServerConfig

MODEL = "tiny"
MAX_MODEL_LEN = 64
MAX_BYTES = 4096
GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def with_(base: dict, **changes) -> bytes:
    return json.dumps({**base, **changes}).encode()


def without(base: dict, key: str) -> bytes:
    return json.dumps({k: v for k, v in base.items() if k != key}).encode()


# (case, path, body, status, param named in the error or None)
CASES = [
    ("bad JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("body is a list", "/v1/completions", b"[1, 2]", 400, None),
    ("missing prompt", "/v1/completions", without(GOOD, "prompt"), 400, "prompt"),
    ("prompt is a number", "/v1/completions", with_(GOOD, prompt=5), 400, "prompt"),
    ("empty prompt", "/v1/completions", with_(GOOD, prompt=""), 400, "prompt"),
    ("token id outside vocab", "/v1/completions", with_(GOOD, prompt=[10**9]), 400, "prompt"),
    ("max_tokens as string", "/v1/completions", with_(GOOD, max_tokens="5"), 400, "max_tokens"),
    ("negative max_tokens", "/v1/completions", with_(GOOD, max_tokens=-3), 400, None),
    ("huge n", "/v1/completions", with_(GOOD, n=1000), 400, "n"),
    ("n = 0", "/v1/completions", with_(GOOD, n=0), 400, "n"),
    ("negative temperature", "/v1/completions", with_(GOOD, temperature=-1), 400, None),
    ("top_p = 0", "/v1/completions", with_(GOOD, top_p=0), 400, None),
    ("penalty out of range", "/v1/completions", with_(GOOD, presence_penalty=5), 400, None),
    ("seed as string", "/v1/completions", with_(GOOD, seed="7"), 400, "seed"),
    ("stream not a bool", "/v1/completions", with_(GOOD, stream="yes"), 400, "stream"),
    ("empty stop string", "/v1/completions", with_(GOOD, stop=[""]), 400, None),
    ("too many logprobs", "/v1/completions", with_(GOOD, logprobs=100), 400, "logprobs"),
    ("unknown field echo", "/v1/completions", with_(GOOD, echo=True), 400, "echo"),
    ("unknown stream option", "/v1/completions", with_(GOOD, stream_options={"x": 1}), 400,
     "stream_options.x"),
    ("priority under fcfs", "/v1/completions", with_(GOOD, priority=1), 400, "priority"),
    ("unknown field tools", "/v1/chat/completions", with_(CHAT, tools=[]), 400, "tools"),
    ("empty messages", "/v1/chat/completions", with_(CHAT, messages=[]), 400, "messages"),
    ("messages not a list", "/v1/chat/completions", with_(CHAT, messages="hi"), 400, "messages"),
    ("unknown role", "/v1/chat/completions",
     with_(CHAT, messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    ("content is a number", "/v1/chat/completions",
     with_(CHAT, messages=[{"role": "user", "content": 3}]), 400, "messages.0.content"),
    ("top_logprobs without logprobs", "/v1/chat/completions", with_(CHAT, top_logprobs=2), 400,
     None),
    ("unknown model", "/v1/completions", with_(GOOD, model="gpt-9"), 404, "model"),
    ("oversized body", "/v1/completions", with_(GOOD, prompt="x" * MAX_BYTES), 413, None),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[Server]:
    llm = LLM(tiny_model("llama"), num_blocks=64, block_size=4, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=1)  # fmt: skip
    config = ServerConfig(MODEL, max_request_bytes=MAX_BYTES)
    started = build_server(llm, config, max_queued=0).start()
    yield started
    started.shutdown()


def send(server: Server, method: str, path: str, body: bytes = b"", **headers) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.request(method, path, content=body, headers=headers)

    return asyncio.run(go())


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    return error


def assert_still_serving(server: Server) -> None:
    response = send(server, "POST", "/v1/completions", json.dumps(GOOD).encode())
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("case, path, body, status, param", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_gets_its_4xx_and_the_server_keeps_serving(
    server, case, path, body, status, param
) -> None:
    assert_openai_error(send(server, "POST", path, body), status, param)
    assert_still_serving(server)


def test_prompt_too_long_names_both_numbers(server) -> None:
    body = with_(GOOD, prompt=[5] * 100)
    error = assert_openai_error(send(server, "POST", "/v1/completions", body), 400, "prompt")
    assert (
        "100 tokens" in error["message"] and f"max_model_len is {MAX_MODEL_LEN}" in error["message"]
    )
    assert error["code"] == "context_length_exceeded"
    assert_still_serving(server)


def test_unknown_route_and_wrong_method_are_openai_errors(server) -> None:
    assert_openai_error(send(server, "POST", "/v1/embeddings", b"{}"), 404, None)
    assert_openai_error(send(server, "GET", "/v1/completions"), 405, None)


def test_overload_is_503_and_the_server_recovers(server) -> None:
    """max_num_seqs=1 and max_queued=0: a second request while one runs is refused."""

    async def two_at_once() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            long = with_(GOOD, max_tokens=40, ignore_eos=True)
            first = asyncio.create_task(client.post("/v1/completions", content=long))
            while not server.engine.num_in_flight:
                await asyncio.sleep(0.001)
            second = await client.post("/v1/completions", content=json.dumps(GOOD).encode())
            return await first, second

    first, second = asyncio.run(two_at_once())
    assert first.status_code == 200
    assert assert_openai_error(second, 503, None)["code"] == "server_overloaded"
    assert_still_serving(server)


def test_api_key_is_required_when_set(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), num_blocks=16, block_size=4)
    keyed = build_server(llm, ServerConfig(MODEL, api_key="s3cret")).start()
    try:
        body = json.dumps(GOOD).encode()
        assert_openai_error(send(keyed, "POST", "/v1/completions", body), 401, None)
        wrong = {"authorization": "Bearer guess"}
        assert_openai_error(send(keyed, "POST", "/v1/completions", body, **wrong), 401, None)
        assert_openai_error(send(keyed, "GET", "/v1/models"), 401, None)
        right = {"authorization": "Bearer s3cret"}
        assert send(keyed, "POST", "/v1/completions", body, **right).status_code == 200
        assert send(keyed, "GET", "/health").status_code == 200  # probes need no key
    finally:
        keyed.shutdown()
