"""`minserve router`: one OpenAI endpoint in front of several replicas.

    client ─► router: read body, key = prompt (text or token ids)
                      policy.choose(key, loads, replicas that are up) ─► replica i
                      forward the body with httpx; relay the answer (SSE or JSON) unchanged
              replica refuses the connection ─► mark it down, choose again among the others

POST /v1/completions   POST /v1/chat/completions   GET /v1/models (from any replica)
GET  /health (probes every replica)                GET /metrics (per-replica counts)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from minserve.router.policy import POLICIES, Decision, Policy, make_policy
from minserve.router.prefix_index import Key, prompt_key
from minserve.router.replicas import Replica, parse_replica_url, render_metrics
from minserve.server.body import read_json_body
from minserve.server.errors import APIError, install_error_handlers

FORWARDED_HEADERS = ("authorization", "content-type")
REPLICA_HEADER = "x-minserve-replica"  # which replica answered: for logs, tests, curiosity


class GatewayError(APIError):
    """502: the chosen replica broke after it accepted the request (it may have run it, so
    the router does not send it again)."""

    def __init__(self, message: str) -> None:
        super().__init__(502, message, code="bad_gateway")

    def body(self) -> dict:
        body = super().body()
        body["error"]["type"] = "server_error"
        return body


@dataclass(frozen=True)
class RouterConfig:
    """The replicas and how to choose among them."""

    replicas: tuple[str, ...]
    policy: str = "cache_aware"
    balance_threshold: int = 4  # cache_aware: in-flight requests above the least loaded
    chunk_size: int = 16  # prefix granularity, in characters or token ids
    capacity: int = 65536  # prefix chunks remembered per replica
    cooldown_s: float = 5.0  # a replica that refused a connection is skipped this long
    connect_timeout_s: float = 5.0
    max_request_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("the router needs at least one replica (--replica URL)")
        urls = [parse_replica_url(url) for url in self.replicas]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a replica is listed twice: {', '.join(self.replicas)}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose {POLICIES}")


@dataclass
class Router:
    """The app and its replicas. start/shutdown have nothing to do (the app's lifespan opens
    and closes the HTTP client); they let `BackgroundServer` run a router like a server."""

    app: FastAPI
    replicas: list[Replica]
    policy: Policy

    def start(self) -> Router:
        return self

    def shutdown(self) -> None:
        pass


def build_router(config: RouterConfig, policy: Policy | None = None) -> Router:
    """The router app over `config.replicas`; `policy` replaces the one `config` names
    (your own `CacheAware` from chapter 09, say)."""
    replicas = [Replica(parse_replica_url(url)) for url in config.replicas]
    if policy is None:
        policy = make_policy(config.policy, len(replicas), config.balance_threshold,
                             config.chunk_size, config.capacity)  # fmt: skip
    proxy = _Proxy(config, replicas, policy)
    return Router(_create_app(proxy), replicas, policy)


class _Proxy:
    """Chooses a replica, forwards a request to it, relays the answer, keeps the counts."""

    def __init__(self, config: RouterConfig, replicas: list[Replica], policy: Policy) -> None:
        self.config, self.replicas, self.policy = config, replicas, policy
        self.client: httpx.AsyncClient | None = None  # opened by the app's lifespan

    async def forward(
        self, request: Request, path: str, body: bytes | None, key: Key | None
    ) -> Response:
        """Send to the chosen replica; on a refused connection, skip it and choose again."""
        tried: set[int] = set()
        while candidates := self._candidates(tried):
            decision = self.policy.choose(key, [r.in_flight for r in self.replicas], candidates)
            replica = self.replicas[decision.replica]
            replica.in_flight += 1  # before awaiting: concurrent choices see the load
            try:
                upstream = await self._send(replica, path, body, request)
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:
                self._failed(replica, error)
                tried.add(decision.replica)
                continue
            except httpx.HTTPError as error:  # it accepted, then broke: do not send twice
                self._failed(replica, error)
                raise GatewayError(
                    f"replica {replica.url} failed before answering: {replica.last_error}"
                ) from error
            self._count(decision, key, replica, recorded=body is not None)
            headers = {"content-type": upstream.headers.get("content-type", "application/json"),
                       REPLICA_HEADER: replica.url}  # fmt: skip
            return StreamingResponse(
                self._relay(upstream, replica), upstream.status_code, headers=headers
            )
        raise APIError(503, "no replica is available: " + "; ".join(
            f"{r.url}: {r.last_error or 'down'}" for r in self.replicas
        ), code="no_replica_available")  # fmt: skip

    def _candidates(self, tried: set[int]) -> list[int]:
        """Replicas that are up; when all are down, the untried ones (they may be back)."""
        untried = [i for i in range(len(self.replicas)) if i not in tried]
        return [i for i in untried if self.replicas[i].is_up()] or untried

    async def _send(
        self, replica: Replica, path: str, body: bytes | None, request: Request
    ) -> httpx.Response:
        assert self.client is not None, "the router's HTTP client opens with the app"
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        method = "GET" if body is None else "POST"
        upstream = self.client.build_request(method, replica.url + path, content=body,
                                             headers=headers)  # fmt: skip
        return await self.client.send(upstream, stream=True)

    def _failed(self, replica: Replica, error: Exception) -> None:
        replica.in_flight -= 1
        replica.mark_down(error, self.config.cooldown_s)

    def _count(self, decision: Decision, key: Key | None, replica: Replica, recorded: bool) -> None:
        if recorded:  # generation requests only: /v1/models teaches nothing about caches
            self.policy.record(key, decision.replica)
            replica.routed[decision.reason] += 1
            replica.matched_units += decision.matched

    async def _relay(self, upstream: httpx.Response, replica: Replica) -> AsyncIterator[bytes]:
        """The replica's bytes as they come; the load drops when the answer ends or the
        client leaves (closing the upstream stream makes the replica abort the request)."""
        try:
            async for chunk in upstream.aiter_bytes():
                yield chunk
        except httpx.HTTPError as error:  # the replica died mid-answer: too late for a 502
            replica.mark_down(error, self.config.cooldown_s)
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                failure = GatewayError(f"replica {replica.url} failed mid-stream: {error}")
                yield f"data: {json.dumps(failure.body())}\n\n".encode()
        finally:
            replica.in_flight -= 1
            with anyio.CancelScope(shield=True):  # runs even when the client's task is cancelled
                await upstream.aclose()

    async def probe(self, replica: Replica) -> bool:
        """GET /health on one replica; updates whether it is routed to."""
        assert self.client is not None
        try:
            response = await self.client.get(replica.url + "/health", timeout=2.0)
        except httpx.HTTPError as error:
            replica.mark_down(error, self.config.cooldown_s)
            return False
        if response.status_code != 200:
            replica.mark_down(RuntimeError(f"/health answered {response.status_code}"),
                              self.config.cooldown_s)  # fmt: skip
            return False
        replica.mark_up()
        return True


def _create_app(proxy: _Proxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(None, connect=proxy.config.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            proxy.client = client
            yield
        proxy.client = None

    app = FastAPI(title="minserve router", lifespan=lifespan)
    install_error_handlers(app)

    async def generate(request: Request, path: str) -> Response:
        body = await read_json_body(request, proxy.config.max_request_bytes)
        return await proxy.forward(request, path, body, prompt_key(body))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.forward(request, "/v1/models", None, None)

    @app.get("/health")
    async def health() -> JSONResponse:
        up = await asyncio.gather(*(proxy.probe(r) for r in proxy.replicas))
        states = {r.url: "up" if ok else r.last_error for r, ok in zip(proxy.replicas, up)}
        if not any(up):
            raise APIError(503, f"no replica is healthy: {states}", code="no_replica_available")
        return JSONResponse({"replicas": states})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(proxy.replicas), media_type=CONTENT_TYPE_LATEST)

    return app
