"""The server's OpenAPI description (`GET /openapi.json`): what each route takes, and every
answer it can give.

The generation routes read their raw body, so that its size and nesting are bounded before
any parser runs; FastAPI therefore cannot see their request models, and this module writes
them in: the request body (the pydantic model's JSON schema, with this server's own numbers:
n, max_tokens against max_model_len, token ids against the vocabulary, batch size) and, per
route, the error responses, each an OpenAI error body. Tools that read the description
(clients, schemathesis) then know what the server accepts and what it answers.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from minserve.server.limits import ServerLimits
from minserve.server.protocol import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"
REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest)

# status -> when the server answers it (every one with an ErrorResponse body)
WHEN = {
    400: "The request is malformed or asks for what this server cannot give "
    "(docs/server.md, Limits and errors)",
    401: "The API key is missing or wrong (`Authorization: Bearer KEY`)",
    404: "No such model",
    413: "The body is larger than --max-request-bytes",
    415: "The body is not declared as JSON (Content-Type: application/json)",
    500: "The engine failed while generating; the request was aborted",
    503: "The server is overloaded (retry later; a request refused to keep its TTFT or TPOT "
    "target says when, in Retry-After) or its engine loop has stopped",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every refusal's body: OpenAI's error shape."""

    error: ErrorDetail


def errors(*statuses: int, keyed: bool = False) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for these error statuses, and 401 when the route needs a key (the
    401 names its scheme in a header)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in sorted({*statuses, *((401,) if keyed else ())}):
        out[status] = {"model": ErrorResponse, "description": WHEN[status]}
        if status == 401:
            header = {"description": "Bearer", "schema": {"type": "string"}}
            out[status]["headers"] = {"WWW-Authenticate": header}
        if status == 503:  # admission's refusals say when to come back (docs/server.md)
            wait = {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}
            out[status]["headers"] = {"Retry-After": wait}
    return out


# one server-sent event (OpenAPI 3.2's itemSchema; tools read a 3.1 `schema` so)
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE]"}},
}


def generation_responses(keyed: bool) -> dict[int | str, dict[str, Any]]:
    """A generation route's answers: a completion (JSON, or a stream), or a refusal."""
    ok = {
        "description": "A completion object, or with `stream: true` server-sent events "
        "(`data: {chunk}` ... `data: [DONE]`)",
        "content": {"application/json": {"schema": {"type": "object"}},
                    "text/event-stream": {"schema": SSE_EVENT}},
    }  # fmt: skip
    return {200: ok, **errors(400, 404, 413, 415, 500, 503, keyed=keyed)}


PROMETHEUS_TEXT = {200: {"description": "Prometheus text format",
                         "content": {"text/plain": {"schema": {"type": "string"}}}}}  # fmt: skip


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """FastAPI `openapi_extra=` for a route that reads `model` from its raw JSON body."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI, limits: ServerLimits, takes_priority: bool, keyed: bool) -> None:
    """Serve the description with the request models in, built once on first request.

    takes_priority: the `priority` field is accepted (--scheduling-policy priority);
    keyed: the /v1 routes need `Authorization: Bearer KEY`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, summary=app.summary,
                               routes=app.routes)  # fmt: skip
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(request_schemas(limits, takes_priority))
            _drop_validation_errors(spec)
            _add_malformed_http(spec)
            if keyed:
                _require_bearer(spec)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def request_schemas(limits: ServerLimits, takes_priority: bool) -> dict[str, dict]:
    """The request models' JSON schemas (and the models they use), with this server's numbers."""
    schemas: dict[str, dict] = {}
    for model in REQUEST_MODELS:
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        _write_limits(schema["properties"], limits, takes_priority)
    _write_prompt_limits(schemas["CompletionRequest"]["properties"]["prompt"], limits)
    return schemas


def _write_limits(fields: dict[str, dict], limits: ServerLimits, takes_priority: bool) -> None:
    """What this server always refuses: more samples than seats, token ids past the
    vocabulary (stop and resume tokens), more tokens than the context leaves after a
    one-token prompt, `priority` without the priority policy."""
    fields["n"]["maximum"] = min(fields["n"]["maximum"], limits.max_num_seqs)
    fields["stop_token_ids"]["anyOf"][0]["items"]["maximum"] = limits.vocab_size - 1
    resume = fields["resume_token_ids"]["anyOf"][0]  # after a prompt of at least one token
    resume.update(items={**resume["items"], "maximum": limits.vocab_size - 1},
                  maxItems=limits.max_model_len - 1)  # fmt: skip
    logit_bias_keys = fields["logit_bias"]["anyOf"][0]["propertyNames"]
    logit_bias_keys["pattern"] = f"^({integers_up_to(limits.vocab_size - 1)})$"
    for name in ("max_tokens", "max_completion_tokens"):
        if name in fields:
            fields[name]["maximum"] = limits.max_model_len - 1
    if not takes_priority:
        del fields["priority"]


def integers_up_to(limit: int) -> str:
    """A regex of the decimal integers 0 to `limit` (no leading zeros): JSON object keys
    (logit_bias' token ids) cannot be bounded as numbers."""
    digits = str(limit)
    shorter = ["0"] + ([f"[1-9][0-9]{{0,{len(digits) - 2}}}"] if len(digits) > 1 else [])
    same_length = []  # below `limit` from its first differing digit on, then `limit` itself
    for i, top in enumerate(digits):
        low = 1 if i == 0 else 0
        if int(top) > low:
            rest = len(digits) - i - 1
            tail = f"[0-9]{{{rest}}}" if rest else ""
            same_length.append(f"{digits[:i]}[{low}-{int(top) - 1}]{tail}")
    if len(digits) > 1:
        same_length.append(digits)
    return "|".join(shorter + same_length) if len(digits) > 1 else f"[0-{limit}]"


def _write_prompt_limits(prompt: dict[str, list[dict]], limits: ServerLimits) -> None:
    """Token ids below the vocabulary size, fewer than max_model_len of them; at most
    `capacity` prompts in a batch."""
    text, texts, _, _ = prompt["anyOf"]
    token_id = {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}
    token_ids = {"type": "array", "items": token_id, "minItems": 1,
                 "maxItems": limits.max_model_len - 1}  # fmt: skip
    batch = {"minItems": 1, "maxItems": limits.capacity}
    prompt["anyOf"] = [text, {**texts, **batch}, token_ids,
                       {"type": "array", "items": token_ids, **batch}]  # fmt: skip


def _drop_validation_errors(spec: dict[str, Any]) -> None:
    """FastAPI documents a 422 for routes with parameters; this server answers 400 instead."""
    for operations in spec.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    schemas = spec.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)


def _add_malformed_http(spec: dict[str, Any]) -> None:
    """Any route can get a request too malformed for HTTP (a header `content-length: %`):
    the HTTP server (uvicorn) answers it 400 in plain text, before the app sees it."""
    plain = {"text/plain": {"schema": {"type": "string"}}}
    for operations in spec["paths"].values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            bad = responses.setdefault("400", {"description": "A malformed HTTP request"})
            bad.setdefault("content", {}).update(plain)


def _require_bearer(spec: dict[str, Any]) -> None:
    """Declare the bearer scheme on every operation that documents a 401."""
    spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for operations in spec["paths"].values():
        for operation in operations.values():
            if "401" in operation.get("responses", {}):
                operation["security"] = [{"bearer": []}]
