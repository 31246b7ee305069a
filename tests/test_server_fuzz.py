"""No request can take the server down: schemathesis against its own /openapi.json.

A bounded run (about a minute on a 2-core CPU) of `benchmarks/fuzz_server.py`, every
check on: no 5xx, no failed check, the server up afterwards and every KV block free or held
only by the prefix cache. The long run is `python -m benchmarks.fuzz_server
--max-examples N` (benchmarks/fuzz_server.md).

Then the requests a fuzzer is unlikely to write: malformed schemas, regexes and grammars,
a grammar that never ends, one that takes too long to compile, and bad `logit_bias`; each
is a 4xx in OpenAI's shape naming its field, within a bound, and the server serves on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict

import httpx
import pytest

from benchmarks.fuzz_server import ENGINE, MODEL, fuzz_server, page
from minserve import LLM
from minserve.server.app import build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig

MAX_EXAMPLES = 15  # fuzzing examples per operation, on top of the coverage phase's cases
MAX_TIME_S = 90  # a bound on a slow machine: the run stops there, with what it found


def test_fuzzing_the_server_finds_no_5xx_no_failed_check_and_no_leak(tiny_model) -> None:
    report = fuzz_server(LLM(tiny_model("llama"), **ENGINE), MAX_EXAMPLES, seed=0,
                         max_time_s=MAX_TIME_S)  # fmt: skip
    text = page(asdict(report), ["# the run"])  # counts, statuses, each failure in full
    assert report.cases > 500, text
    assert report.server_errors == 0, text
    assert report.failures == [], text
    assert report.errors == [], text
    assert report.server_up, text
    assert report.blocks_held == 0, text


# --- structured output and logit_bias: hostile constraints are refused, quickly ---

COMPILE_BOUND_S = 0.5  # the grammar compiler's bound in these tests (10 s when serving)
REQUEST_BOUND_S = 15.0  # any refusal arrives within this (the bound, plus a loaded CPU)


def schema_format(schema: object) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}  # fmt: skip


HOSTILE = {  # name: (endpoint, body fields, the field the error names)
    "a schema that is not an object": ("chat", schema_format([1, 2]), "response_format"),
    "a json that is not a schema": ("completions", {"structured_outputs": {"json": 5}},
                                    "structured_outputs"),
    "an unknown type": ("chat", schema_format({"type": "objekt"}), "response_format"),
    "a $ref to nowhere": ("chat", schema_format({"$ref": "#/$defs/missing"}), "response_format"),
    "an invalid pattern inside a schema": (
        "chat", schema_format({"type": "object", "properties": {
            "a": {"type": "string", "pattern": "[a-"}}, "required": ["a"]}),
        "response_format"),
    "an invalid regex": ("completions", {"structured_outputs": {"regex": "a{3,1}"}},
                         "structured_outputs"),
    "a grammar that never ends": ("completions",
                                  {"structured_outputs": {"grammar": 'root ::= "a" root'}},
                                  "structured_outputs"),
    "a schema that requires itself": ("chat", schema_format({
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
        "response_format"),
    "a logit_bias key that is not a number": ("completions", {"logit_bias": {"abc": 1}},
                                              "logit_bias"),
    "a logit_bias key past the vocabulary": ("completions", {"logit_bias": {"99999999": 1}},
                                             "logit_bias"),
    "a logit_bias of 1000": ("completions", {"logit_bias": {"5": 1000}}, "logit_bias"),
}  # fmt: skip


@pytest.fixture(scope="module")
def server_url(tiny_model) -> Iterator[str]:
    llm = LLM(tiny_model("llama"), **ENGINE)
    llm.engine.grammars().timeout_s = COMPILE_BOUND_S
    with BackgroundServer(build_server(llm.engine, ServerConfig(MODEL))) as url:
        yield url


def post(url: str, endpoint: str, fields: dict) -> tuple[httpx.Response, float]:
    """A request with `fields` on top of a valid body; the response and its seconds."""
    if endpoint == "chat":
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    else:
        body = {"model": MODEL, "prompt": "Hi"}
    start = time.monotonic()
    response = httpx.post(f"{url}/v1/{endpoint.replace('chat', 'chat/completions')}",
                          json={**body, "max_tokens": 4, **fields}, timeout=60)  # fmt: skip
    return response, time.monotonic() - start


def assert_refused(response: httpx.Response, seconds: float, field: str) -> None:
    """A 4xx in OpenAI's shape whose param (or, without one, message) names `field`."""
    assert 400 <= response.status_code < 500, response.text
    assert seconds < REQUEST_BOUND_S
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"] or error["message"]).startswith(field), error  # param: "x.y.z"


def assert_serving(url: str) -> None:
    response, _ = post(url, "completions", {})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("endpoint, fields, field", HOSTILE.values(), ids=HOSTILE)
def test_a_hostile_constraint_is_a_4xx_naming_its_field_and_the_server_serves_on(
    server_url: str, endpoint: str, fields: dict, field: str
) -> None:
    response, seconds = post(server_url, endpoint, fields)
    assert_refused(response, seconds, field)
    assert_serving(server_url)


def test_a_grammar_that_compiles_past_the_bound_is_a_400_and_the_server_serves_on(
    server_url: str,
) -> None:
    names = [f"field_{i}" for i in range(300)]  # 23 kB: about 3 s to compile on a 2-core CPU
    properties = {name: {"type": "string", "pattern": f"^x{i}[a-z]{{2,5}}$"}
                  for i, name in enumerate(names)}  # fmt: skip
    bomb = {"type": "object", "properties": properties, "required": names}
    response, seconds = post(server_url, "chat", schema_format(bomb))
    assert_refused(response, seconds, "response_format")
    assert "took longer than" in response.json()["error"]["message"]
    assert seconds < COMPILE_BOUND_S + 5
    assert_serving(server_url)
