"""Admin routes of a disaggregated server: live migration and draining (Llumnix).

    POST /v1/admin/migrate   {"request_id": "req-3-0", "to": 3}  202; 404 unknown request,
                                                                  400 not a decode rank,
                                                                  409 cannot move it now
    POST /v1/admin/drain     {"instance": 3}    202: the requests it held move off, and no
                                                new one is placed there
    POST /v1/admin/undrain   {"instance": 3}    200: it takes new requests again
    GET  /v1/admin/requests                     each request in flight: instance, migrating_to

Installed only over an engine that migrates (`DisaggregatedEngine`). Its methods are safe
from the handlers' thread: they check, then queue an order the next round carries out
(`GET /v1/admin/requests` and the metrics tell the outcome). The migration counters are
exported on `GET /metrics` with the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel

from minserve.disagg.migration_control import (
    MigrationConflictError,
    UnknownInstanceError,
    UnknownRequestError,
)
from minserve.server.async_engine import AsyncEngine
from minserve.server.errors import APIError, check_api_key
from minserve.server.metrics import PREFIX

# engine stat -> (metric, help)
MIGRATION_COUNTERS = {
    "num_migrations_started": ("migrations_started", "Live migrations started"),
    "num_migrations_committed": ("migrations_committed", "Live migrations committed"),
    "num_migrations_aborted": ("migrations_aborted", "Live migrations aborted (the source "
                               "kept the request)"),
    "migration_blocks_precopied": ("migration_blocks_precopied", "KV blocks sent by pre-copy "
                                   "stages, while the source decoded"),
    "migration_pause_seconds_total": ("migration_pause_seconds", "Seconds of final stages, "
                                      "the requests paused"),
    "num_requests_resumed": ("requests_resumed", "Requests resumed elsewhere after their "
                             "instance died"),
}  # fmt: skip


@runtime_checkable
class MigratingEngine(Protocol):
    """What the admin routes drive: `DisaggregatedEngine`'s migration methods."""

    def migrate(self, request_id: str, to_rank: int) -> int: ...

    def drain(self, rank: int) -> list[str]: ...

    def undrain(self, rank: int) -> None: ...

    def placements(self) -> list[dict[str, Any]]: ...


class MigrateBody(BaseModel):
    request_id: str
    to: int


class InstanceBody(BaseModel):
    instance: int


class _MigrationCollector(Collector):
    """The migration counters from the engine loop's latest stats, at scrape time."""

    def __init__(self, loop: AsyncEngine) -> None:
        self.loop = loop

    def collect(self) -> Iterator[Metric]:
        for key, (name, text) in MIGRATION_COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, text, value=self.loop.stats.get(key, 0))


def as_api_error(error: Exception) -> APIError:
    """A refused migration or drain as the OpenAI-style error with its status."""
    if isinstance(error, UnknownRequestError):
        return APIError(404, str(error), param="request_id", code="request_not_found")
    if isinstance(error, UnknownInstanceError):
        return APIError(400, str(error), code="not_a_decode_instance")
    return APIError(409, str(error), code="conflict")


def install_admin_routes(
    app: FastAPI, loop: AsyncEngine, engine: MigratingEngine, api_key: str | None
) -> None:
    """Add the admin routes and the migration metrics to a disaggregated server's app."""
    loop.metrics.registry.register(_MigrationCollector(loop))
    refused = (UnknownRequestError, UnknownInstanceError, MigrationConflictError)

    @app.post("/v1/admin/migrate", status_code=202)
    async def migrate(body: MigrateBody, request: Request) -> JSONResponse:
        check_api_key(request, api_key)
        try:
            source = engine.migrate(body.request_id, body.to)
        except refused as error:
            raise as_api_error(error) from error
        return JSONResponse({"object": "migration", "request_id": body.request_id,
                             "from": source, "to": body.to}, status_code=202)  # fmt: skip

    @app.post("/v1/admin/drain", status_code=202)
    async def drain(body: InstanceBody, request: Request) -> JSONResponse:
        check_api_key(request, api_key)
        try:
            moving = engine.drain(body.instance)
        except refused as error:
            raise as_api_error(error) from error
        return JSONResponse({"object": "drain", "instance": body.instance,
                             "request_ids": moving}, status_code=202)  # fmt: skip

    @app.post("/v1/admin/undrain")
    async def undrain(body: InstanceBody, request: Request) -> JSONResponse:
        check_api_key(request, api_key)
        try:
            engine.undrain(body.instance)
        except refused as error:
            raise as_api_error(error) from error
        return JSONResponse({"object": "undrain", "instance": body.instance})

    @app.get("/v1/admin/requests")
    async def requests(request: Request) -> JSONResponse:
        check_api_key(request, api_key)
        return JSONResponse({"object": "list", "data": engine.placements()})
