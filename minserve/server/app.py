"""The FastAPI app: OpenAI's routes over one `AsyncEngine`, plus health and metrics.

POST /v1/completions        POST /v1/chat/completions      GET /v1/models
GET  /v1/models/{model_id}  GET  /health                   GET /metrics (Prometheus text)
GET  /openapi.json          (request models, limits and error responses: openapi.py)
Disaggregated (`DisaggregatedEngine`): /v1/admin/{migrate,drain,undrain,requests} (admin.py)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from minserve.engine_client import EngineClient
from minserve.server.admin import MigratingEngine, install_admin_routes
from minserve.server.async_engine import AsyncEngine
from minserve.server.errors import APIError, check_api_key, install_error_handlers
from minserve.server.limits import ServerLimits
from minserve.server.metrics import ServerMetrics
from minserve.server.openapi import (
    PROMETHEUS_TEXT,
    errors,
    generation_responses,
    install_openapi,
    request_body,
)
from minserve.server.protocol import ChatCompletionRequest, CompletionRequest
from minserve.server.serving import OpenAIServing, ServerConfig, check_model


@dataclass
class Server:
    """An app and the engine loop behind it; `start()` before serving, `shutdown()` after."""

    app: FastAPI
    engine: AsyncEngine
    config: ServerConfig

    def start(self) -> Server:
        self.engine.start()
        return self

    def shutdown(self) -> None:
        self.engine.shutdown()


def build_server(
    engine: EngineClient,
    config: ServerConfig,
    max_queued: int = 256,
    limits_cls: type = ServerLimits,
) -> Server:
    """Wrap an engine in the HTTP app: `build_engine(EngineArgs(...))` (model loaded, KV
    pool allocated), or a prefill/decode cluster's proxy (docs/distributed.md).

    `limits_cls` refuses what a request can never get, as `ServerLimits` (chapter 09)."""
    missing = [m for m in ("check", "check_batch") if not callable(getattr(limits_cls, m, None))]
    if not isinstance(limits_cls, type) or missing:
        raise TypeError(
            f"limits_cls must be a class with check and check_batch, like ServerLimits; "
            f"got {limits_cls!r}"
        )
    _check_policy(engine.scheduler_config.scheduling_policy, config)
    loop = AsyncEngine(engine, ServerMetrics(), max_queued, engine.device)
    return Server(create_app(loop, config, limits_cls), loop, config)


def _check_policy(engine_policy: str, config: ServerConfig) -> None:
    if engine_policy != config.scheduling_policy:
        raise ValueError(
            f"the engine schedules by {engine_policy!r} but "
            f"the server config says {config.scheduling_policy!r}"
        )


def create_app(
    engine: AsyncEngine, config: ServerConfig, limits_cls: type = ServerLimits
) -> FastAPI:
    app = FastAPI(title="minserve", summary="An OpenAI-compatible server over minserve's engine")
    install_error_handlers(app)
    driven = engine.engine  # its limits, its tokenizer
    limits = limits_cls(driven.max_model_len, driven.scheduler_config.max_num_seqs,
                          engine.capacity, driven.vocab_size)  # fmt: skip
    keyed = config.api_key is not None
    install_openapi(app, limits, config.scheduling_policy == "priority", keyed)
    serving = OpenAIServing(engine, driven.get_tokenizer(), config, limits)
    created = int(time.time())
    generation = generation_responses(keyed)

    def card() -> dict:
        return {"id": config.model_name, "object": "model", "created": created,
                "owned_by": "minserve", "max_model_len": driven.max_model_len}  # fmt: skip

    @app.post("/v1/completions", responses=generation,
              openapi_extra=request_body(CompletionRequest))  # fmt: skip
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions", responses=generation,
              openapi_extra=request_body(ChatCompletionRequest))  # fmt: skip
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

    @app.get("/v1/models", responses=errors(keyed=keyed))
    async def models(request: Request) -> JSONResponse:
        check_api_key(request, config.api_key)
        return JSONResponse({"object": "list", "data": [card()]})

    @app.get("/v1/models/{model_id:path}", responses=errors(404, keyed=keyed))
    async def model(model_id: str, request: Request) -> JSONResponse:
        check_api_key(request, config.api_key)
        check_model(model_id, config.model_name)
        return JSONResponse(card())

    @app.get("/health", responses=errors(503))
    async def health() -> JSONResponse:
        if not engine.is_running:
            raise APIError(503, "the engine loop is not running", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/kv_events", responses=errors(404))
    async def kv_events(request: Request) -> JSONResponse:
        info = driven.kv_events_info()
        if info is None:
            raise APIError(404, "this server publishes no KV events; start it with "
                           "--enable-prefix-caching --kv-events-config "
                           "'{\"enable_kv_cache_events\": true}'", code="not_found")  # fmt: skip
        if info["host"] in ("*", "0.0.0.0"):  # bound everywhere: the address the client used
            info = {**info, "host": request.url.hostname}
        return JSONResponse(info)

    @app.get("/metrics", response_class=Response, responses=PROMETHEUS_TEXT)
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if isinstance(driven, MigratingEngine):  # disaggregated: live migration, draining
        install_admin_routes(app, engine, driven, config.api_key)
    return app
