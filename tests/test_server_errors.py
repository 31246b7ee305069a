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
from minserve.server.body import nesting_depth
from minserve.server.protocol import CompletionRequest
from minserve.server.serving import ServerConfig

MODEL = "tiny"
MAX_MODEL_LEN = 64
MAX_BYTES = 1 << 16  # room for '[' * 50000
GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
JSON = {"content-type": "application/json"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def with_(base: dict, **changes) -> bytes:
    return json.dumps({**base, **changes}).encode()


def without(base: dict, key: str) -> bytes:
    return json.dumps({k: v for k, v in base.items() if k != key}).encode()


def raw(**fields: str) -> bytes:
    """GOOD with fields spelled as given: `Infinity`, `NaN` and `1e999` are no JSON values,
    but Python's JSON reader takes them."""
    extra = "".join(f', "{name}": {text}' for name, text in fields.items())
    return json.dumps(GOOD)[:-1].encode() + extra.encode() + b"}"


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
    ("unknown field suffix", "/v1/completions", with_(GOOD, suffix="x"), 400, "suffix"),
    ("echo as string", "/v1/completions", with_(GOOD, echo="yes"), 400, "echo"),
    ("echo with too many logprobs", "/v1/completions", with_(GOOD, echo=True, logprobs=21), 400,
     "logprobs"),
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
    ("JSON nested 50000 deep", "/v1/completions", b"[" * 50000, 400, None),
    ("objects nested 2000 deep", "/v1/completions", b'{"a": ' * 2000 + b"1" + b"}" * 2000, 400,
     None),
    ("JSON nested in a field", "/v1/completions",
     with_(GOOD, prompt=json.loads("[" * 40 + "]" * 40)), 400, None),
    ("a 5000-digit number", "/v1/completions",
     b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    ("temperature Infinity", "/v1/completions", raw(temperature="Infinity"), 400, "temperature"),
    ("temperature 1e999", "/v1/completions", raw(temperature="1e999"), 400, "temperature"),
    ("top_p NaN", "/v1/completions", raw(top_p="NaN"), 400, "top_p"),
    ("repetition_penalty Infinity", "/v1/completions", raw(repetition_penalty="Infinity"), 400,
     "repetition_penalty"),
    ("max_tokens 2.5", "/v1/completions", with_(GOOD, max_tokens=2.5), 400, "max_tokens"),
    ("max_tokens Infinity", "/v1/completions", raw(max_tokens="Infinity"), 400, "max_tokens"),
    ("seed past 2**64 - 1", "/v1/completions", with_(GOOD, seed=2**64), 400, "seed"),
    ("seed below -2**63", "/v1/completions", with_(GOOD, seed=-(2**63) - 1), 400, "seed"),
    ("token id past 64 bits", "/v1/completions", with_(GOOD, prompt=[2**70]), 400, "prompt"),
    ("max_tokens past the context", "/v1/completions", with_(GOOD, max_tokens=10**30), 400,
     "max_tokens"),
    ("max_completion_tokens past the context", "/v1/chat/completions",
     with_(CHAT, max_completion_tokens=MAX_MODEL_LEN), 400, "max_completion_tokens"),
    ("max_tokens past the schema's maximum beside max_completion_tokens", "/v1/chat/completions",
     with_(CHAT, max_completion_tokens=2, max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    ("stop token id past the vocabulary", "/v1/completions",
     with_(GOOD, stop_token_ids=[49152], min_tokens=1), 400, "stop_token_ids"),
    ("more samples than seats", "/v1/completions", with_(GOOD, n=2), 400, "n"),
    ("more prompts than the server holds", "/v1/completions", with_(GOOD, prompt=["a", "b"]), 400,
     "prompt"),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[Server]:
    llm = LLM(tiny_model("llama"), num_blocks=64, block_size=4, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=1)  # fmt: skip
    config = ServerConfig(MODEL, max_request_bytes=MAX_BYTES)
    started = build_server(llm.engine, config, max_queued=0).start()
    yield started
    started.shutdown()


def send(
    server: Server, method: str, path: str, body: bytes = b"", json_body: bool = True, **headers
) -> httpx.Response:
    """One request to the app in-process; a body is declared JSON unless `json_body=False`."""
    if body and json_body:
        headers.setdefault("content-type", "application/json")

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
            first = asyncio.create_task(client.post("/v1/completions", content=long, headers=JSON))
            while not server.engine.num_in_flight:
                await asyncio.sleep(0.001)
            second = await client.post("/v1/completions", json=GOOD)
            return await first, second

    first, second = asyncio.run(two_at_once())
    assert first.status_code == 200
    assert assert_openai_error(second, 503, None)["code"] == "server_overloaded"
    assert_still_serving(server)


def test_api_key_is_required_when_set(tiny_model) -> None:
    llm = LLM(tiny_model("llama"), num_blocks=16, block_size=4)
    keyed = build_server(llm.engine, ServerConfig(MODEL, api_key="s3cret")).start()
    try:
        body = json.dumps(GOOD).encode()
        refused = send(keyed, "POST", "/v1/completions", body)
        assert_openai_error(refused, 401, None)
        assert refused.headers["www-authenticate"] == "Bearer"
        wrong = {"authorization": "Bearer guess"}
        assert_openai_error(send(keyed, "POST", "/v1/completions", body, **wrong), 401, None)
        assert_openai_error(send(keyed, "GET", "/v1/models"), 401, None)
        assert_openai_error(send(keyed, "GET", f"/v1/models/{MODEL}"), 401, None)
        right = {"authorization": "Bearer s3cret"}
        assert send(keyed, "POST", "/v1/completions", body, **right).status_code == 200
        assert send(keyed, "GET", f"/v1/models/{MODEL}", **right).json()["id"] == MODEL
        assert send(keyed, "GET", "/health").status_code == 200  # probes need no key
    finally:
        keyed.shutdown()


def test_kv_events_are_404_when_the_server_publishes_none(server) -> None:
    error = assert_openai_error(send(server, "GET", "/v1/kv_events"), 404, None)
    assert "--kv-events-config" in error["message"]


def test_deep_nesting_is_refused_before_any_parser_recurses(server) -> None:
    response = send(server, "POST", "/v1/completions", b"[" * 50000)
    error = assert_openai_error(response, 400, None)
    assert error["code"] == "json_too_deep"
    assert "50000 levels deep" in error["message"] and "at most 32" in error["message"]


def test_nesting_depth_counts_brackets_outside_strings() -> None:
    assert nesting_depth(b'{"a": [1, {"b": []}]}') == 4
    assert nesting_depth(b'{"prompt": "[[[[{{{{ \\" [[["}') == 1  # brackets in a string
    assert nesting_depth(b"[" * 50000) == 50000
    assert nesting_depth(b"7") == 0


def test_json_is_required_on_the_generation_routes(server) -> None:
    body = json.dumps(GOOD).encode()
    for path in ("/v1/completions", "/v1/chat/completions"):
        missing = send(server, "POST", path, body, json_body=False)
        assert assert_openai_error(missing, 415, None)["code"] == "unsupported_media_type"
        assert "no Content-Type" in missing.json()["error"]["message"]
    text = send(server, "POST", "/v1/completions", body, **{"content-type": "text/plain"})
    assert "'text/plain'" in assert_openai_error(text, 415, None)["message"]
    charset = {"content-type": "application/json; charset=utf-8"}
    assert send(server, "POST", "/v1/completions", body, **charset).status_code == 200


def test_an_integral_float_counts_as_an_integer(server) -> None:
    response = send(server, "POST", "/v1/completions", with_(GOOD, max_tokens=2.0, n=1.0))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_a_seed_may_be_any_64_bit_value_signed_or_unsigned(server) -> None:
    for seed in (-(2**63), 2**64 - 1):
        request = CompletionRequest.model_validate_json(with_(GOOD, seed=seed))
        assert request.sampling_params().seed == seed
    response = send(server, "POST", "/v1/completions", with_(GOOD, seed=2**40, temperature=1))
    assert response.status_code == 200, response.text


def test_max_tokens_past_the_context_names_both_numbers(server) -> None:
    response = send(server, "POST", "/v1/completions", with_(GOOD, prompt=[5] * 10, max_tokens=60))
    error = assert_openai_error(response, 400, "max_tokens")
    assert error["code"] == "context_length_exceeded"
    assert error["message"] == (
        "max_tokens is 60, but the prompt has 10 tokens and max_model_len is 64: "
        "at most 54 tokens can be generated (10 + 60 > 64)"
    )
    fits = send(server, "POST", "/v1/completions", with_(GOOD, prompt=[5] * 10, max_tokens=54))
    assert fits.status_code == 200, fits.text


def test_the_default_max_tokens_stops_at_the_end_of_the_context(server) -> None:
    body = json.dumps({"prompt": [5] * 60, "ignore_eos": True, "temperature": 0}).encode()
    response = send(server, "POST", "/v1/completions", body)  # max_tokens defaults to 16
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 60
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_what_can_never_fit_is_400_with_the_numbers_not_503(server) -> None:
    batch = send(server, "POST", "/v1/completions", with_(GOOD, prompt=["a"] * 600))
    error = assert_openai_error(batch, 400, "prompt")
    assert error["code"] == "too_many_prompts"
    assert "600 prompts" in error["message"] and "at most 1 requests" in error["message"]
    samples = send(server, "POST", "/v1/completions", with_(GOOD, n=16))
    error = assert_openai_error(samples, 400, "n")
    assert "n is 16" in error["message"] and "at most 1 sequences" in error["message"]


def test_a_wrong_method_names_the_allowed_one(server) -> None:
    response = send(server, "GET", "/v1/completions")
    assert_openai_error(response, 405, None)
    assert response.headers["allow"] == "POST"


def test_chapter_09s_solution_limits_answer_every_case_as_minserves(server) -> None:
    """`build_server(..., limits_cls=...)` with chapter 09's ServerLimits: the same responses."""
    from solutions.ch09_server import ServerLimits as SolutionLimits

    llm = LLM(server.engine.engine.loaded, num_blocks=64, block_size=4,
              max_model_len=MAX_MODEL_LEN, max_num_seqs=1)  # fmt: skip
    config = ServerConfig(MODEL, max_request_bytes=MAX_BYTES)
    solution = build_server(llm.engine, config, max_queued=0, limits_cls=SolutionLimits).start()
    try:
        for case, path, body, _status, _param in CASES:
            want, got = send(server, "POST", path, body), send(solution, "POST", path, body)
            assert (got.status_code, got.json()) == (want.status_code, want.json()), case
    finally:
        solution.shutdown()


def test_a_limits_class_without_check_is_refused(server) -> None:
    llm = LLM(server.engine.engine.loaded, num_blocks=16, block_size=4)
    with pytest.raises(TypeError, match="limits_cls must be a class with check and check_batch"):
        build_server(llm.engine, ServerConfig(MODEL), limits_cls=dict)
