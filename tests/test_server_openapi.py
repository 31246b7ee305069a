"""/openapi.json describes what the server takes and answers; the routes it documents behave so.

The request bodies are the pydantic models' schemas with this server's numbers written in;
every route lists its error responses, each an OpenAI error body.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_server_errors import assert_openai_error, send

from minserve import LLM
from minserve.server.app import Server, build_server
from minserve.server.serving import ServerConfig

MODEL = "tiny"
MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 4
ERROR_BODY = {"$ref": "#/components/schemas/ErrorResponse"}


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(tiny_model("llama"), num_blocks=64, block_size=4, max_model_len=MAX_MODEL_LEN,
               max_num_seqs=MAX_NUM_SEQS)  # fmt: skip


@pytest.fixture(scope="module")
def server(llm: LLM) -> Iterator[Server]:
    started = build_server(llm.engine, ServerConfig(MODEL), max_queued=8).start()
    yield started
    started.shutdown()


@pytest.fixture(scope="module")
def spec(server: Server) -> dict:
    response = send(server, "GET", "/openapi.json")
    assert response.status_code == 200
    return response.json()


def test_generation_routes_document_their_request_models(spec) -> None:
    for path, model in (("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest")):  # fmt: skip
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"]
    assert chat["properties"]["messages"]["items"] == {"$ref": "#/components/schemas/ChatMessage"}
    assert "ChatMessage" in spec["components"]["schemas"]
    assert "TextPart" in spec["components"]["schemas"]


def test_request_schemas_carry_the_ranges_and_this_servers_limits(spec, llm) -> None:
    fields = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["n"]["minimum"] == 1 and fields["n"]["maximum"] == MAX_NUM_SEQS
    assert (fields["temperature"]["minimum"], fields["temperature"]["maximum"]) == (0, 100)
    assert fields["top_p"] == {**fields["top_p"], "exclusiveMinimum": 0, "maximum": 1}
    penalty = fields["repetition_penalty"]  # SamplingParams' ranges: nothing valid is refused
    assert (penalty["minimum"], penalty["maximum"]) == (0.01, 100)
    assert (fields["presence_penalty"]["minimum"], fields["presence_penalty"]["maximum"]) == (-2, 2)
    assert fields["max_tokens"]["minimum"] == 0  # 0 with echo: the prompt alone
    assert fields["max_tokens"]["maximum"] == MAX_MODEL_LEN - 1
    assert fields["seed"]["anyOf"][0] == {"type": "integer", "minimum": -(2**63),
                                          "maximum": 2**64 - 1}  # fmt: skip
    text, texts, token_ids, batch = fields["prompt"]["anyOf"]
    assert text == {"type": "string", "minLength": 1}
    assert token_ids["items"]["maximum"] == llm.vocab_size - 1
    assert token_ids["maxItems"] == MAX_MODEL_LEN - 1
    assert texts["maxItems"] == batch["maxItems"] == MAX_NUM_SEQS + 8
    assert "priority" not in fields  # refused under fcfs, so not offered
    assert fields["stop"]["anyOf"][1]["items"]["minLength"] == 1
    assert fields["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == llm.vocab_size - 1


def test_every_route_documents_its_errors_as_openai_bodies(spec) -> None:
    expected = {
        ("/v1/completions", "post"): {"400", "404", "413", "415", "500", "503"},
        ("/v1/chat/completions", "post"): {"400", "404", "413", "415", "500", "503"},
        ("/v1/models/{model_id}", "get"): {"404"},
        ("/health", "get"): {"503"},
    }
    for (path, method), statuses in expected.items():
        responses = spec["paths"][path][method]["responses"]
        assert set(responses) - {"200", "400"} == statuses - {"400"}, path
        for status in statuses:
            assert responses[status]["content"]["application/json"]["schema"] == ERROR_BODY
    for operations in spec["paths"].values():  # malformed HTTP: uvicorn's plain-text 400
        for operation in operations.values():
            assert "text/plain" in operation["responses"]["400"]["content"]
    assert "422" not in str(spec["paths"])  # invalid requests are 400s, as OpenAI answers
    stream = spec["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(stream) == {"application/json", "text/event-stream"}


def test_a_keyed_server_documents_bearer_auth_and_its_401s(llm) -> None:
    keyed = build_server(LLM(llm.loaded, num_blocks=32, block_size=4).engine,
                         ServerConfig(MODEL, api_key="s3cret"))  # fmt: skip
    spec = send(keyed, "GET", "/openapi.json").json()
    assert spec["components"]["securitySchemes"] == {"bearer": {"type": "http",
                                                                "scheme": "bearer"}}  # fmt: skip
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id}"):
        operation = next(iter(spec["paths"][path].values()))
        assert operation["security"] == [{"bearer": []}]
        assert "WWW-Authenticate" in operation["responses"]["401"]["headers"]
    assert "security" not in spec["paths"]["/health"]["get"]


def test_the_priority_policy_offers_the_priority_field(llm) -> None:
    engine = LLM(llm.loaded, num_blocks=32, block_size=4, scheduling_policy="priority")
    spec = send(build_server(engine.engine, ServerConfig(MODEL, scheduling_policy="priority")),
                "GET", "/openapi.json").json()  # fmt: skip
    priority = spec["components"]["schemas"]["CompletionRequest"]["properties"]["priority"]
    assert {"enum": ["interactive", "standard", "batch"]} in priority["anyOf"]


def test_a_model_is_retrieved_by_id(server) -> None:
    card = send(server, "GET", f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert card == send(server, "GET", "/v1/models").json()["data"][0]
    error = assert_openai_error(send(server, "GET", "/v1/models/gpt-9"), 404, "model")
    assert error["code"] == "model_not_found"
    assert error["message"] == "the model 'gpt-9' does not exist; this server serves 'tiny'"


def test_health_answers_a_json_body(server) -> None:
    response = send(server, "GET", "/health")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"status": "ok"}
