"""`minserve router`: one OpenAI endpoint in front of several replicas.

    client ─► router: read body, key = prompt (text or token ids); for kv_aware also the
                      token ids, session and block keys (a `RouteRequest`, `prompt_reader.py`)
                      policy.choose(key or request, loads, replicas that are up) ─► replica i
                      forward the body with httpx; relay the answer (SSE or JSON)
              replica refuses the connection ─► mark it down, choose again among the others
              replica breaks before answering ─► mark it down, send it again elsewhere
              replica breaks mid-stream ─► continue the stream on another (`resume.py`)

POST /v1/completions   POST /v1/chat/completions   GET /v1/models (from any replica)
GET  /health (probes every replica)                GET /metrics (per-replica counts)

A streaming request (one prompt, one choice) keeps a `Journal` of what was relayed, so
another replica can continue it; `max_resumes` bounds how often a request is sent again.
kv_aware also runs a `KVFeed`: a thread per replica that follows its KV events into the
`KVBlocks` the policy reads; the app's lifespan starts and stops it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from minserve.router.gateway_error import GatewayError
from minserve.router.journal import Journal
from minserve.router.kv_aware import KVAware, KVAwareConfig
from minserve.router.kv_blocks import KVBlocks
from minserve.router.kv_feed import KVFeed
from minserve.router.policy import (
    POLICIES,
    Decision,
    Policy,
    RequestPolicy,
    as_request_policy,
    make_policy,
)
from minserve.router.prefix_index import prompt_key
from minserve.router.prompt_reader import PromptReader, load_tokenizer
from minserve.router.replicas import Replica, parse_replica_url, render_metrics
from minserve.router.resume import Leg, LegFailed, Reopen, Resends, ResumingRelay
from minserve.router.route_request import RouteRequest
from minserve.router.sse import data_event
from minserve.router.stall_histogram import StallHistogram
from minserve.server.body import read_json_body
from minserve.server.errors import APIError, install_error_handlers

FORWARDED_HEADERS = ("authorization", "content-type")
CHAT_PATH = "/v1/chat/completions"
REPLICA_HEADER = "x-minserve-replica"  # which replica answered: for logs, tests, curiosity


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
    tokenizer: str | None = None  # kv_aware: the served model's (None: the bundled model's)
    kv_aware: KVAwareConfig = KVAwareConfig()  # kv_aware: its speeds and sessions' rule
    kv_events_check_s: float = 1.0  # kv_aware: how often the feed asks for /v1/kv_events
    max_resumes: int = 2  # times a request is sent again after its replica broke (0: never)

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("the router needs at least one replica (--replica URL)")
        urls = [parse_replica_url(url) for url in self.replicas]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a replica is listed twice: {', '.join(self.replicas)}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose {POLICIES}")
        if self.kv_events_check_s <= 0:
            raise ValueError(f"kv_events_check_s must be > 0, got {self.kv_events_check_s}")
        if self.max_resumes < 0:
            raise ValueError(f"max_resumes must be >= 0, got {self.max_resumes}")


@dataclass
class Router:
    """The app and its replicas. start/shutdown have nothing to do (the app's lifespan opens
    and closes the HTTP client); they let `BackgroundServer` run a router like a server."""

    app: FastAPI
    replicas: list[Replica]
    policy: Policy | RequestPolicy
    feed: KVFeed | None = None  # kv_aware's: the replicas' KV events into its KVBlocks
    stalls: StallHistogram = field(default_factory=StallHistogram)  # resumed streams' waits

    def start(self) -> Router:
        return self

    def shutdown(self) -> None:
        pass


def build_router(
    config: RouterConfig,
    policy: Policy | RequestPolicy | None = None,
    journal_cls: type = Journal,
) -> Router:
    """The router app over `config.replicas`; `policy` replaces the one `config` names
    (your own `CacheAware` from chapter 09, say). A request policy gets a prompt reader
    (`config.tokenizer`); a `KVAware` also gets a feed that fills its `KVBlocks`.
    `journal_cls`: a class shaped like `Journal` (chapter 11's) keeps each stream's journal."""
    replicas = [Replica(parse_replica_url(url)) for url in config.replicas]
    if policy is None:
        policy = make_policy(config.policy, len(replicas), config.balance_threshold,
                             config.chunk_size, config.capacity,
                             blocks=KVBlocks(len(replicas)), kv_config=config.kv_aware)  # fmt: skip
    feed = None
    if isinstance(policy, KVAware):
        feed = KVFeed([r.url for r in replicas], policy.blocks, config.kv_events_check_s)
    reader = None
    if isinstance(policy, RequestPolicy):
        reader = PromptReader(load_tokenizer(config.tokenizer))
    stalls = StallHistogram()
    proxy = _Proxy(config, replicas, as_request_policy(policy), reader, feed, stalls, journal_cls)
    return Router(_create_app(proxy), replicas, policy, feed, stalls)


class _Proxy:
    """Chooses a replica, forwards a request to it, relays the answer, keeps the counts."""

    def __init__(
        self, config: RouterConfig, replicas: list[Replica], policy: RequestPolicy,
        reader: PromptReader | None, feed: KVFeed | None, stalls: StallHistogram,
        journal_cls: type = Journal,
    ) -> None:  # fmt: skip
        self.config, self.replicas, self.policy = config, replicas, policy
        self.reader, self.feed, self.stalls = reader, feed, stalls
        self.journal_cls = journal_cls
        self.client: httpx.AsyncClient | None = None  # opened by the app's lifespan

    def read(self, request: Request, path: str, body: bytes) -> RouteRequest:
        """What the policy reads of a request: its key, or (a request policy) all of it."""
        if self.reader is None:
            return RouteRequest(prompt_key(body))
        roots = self.feed.blocks.roots() if self.feed is not None else {}
        return self.reader.read(body, path == CHAT_PATH, request.headers, roots)

    async def forward(
        self, request: Request, path: str, body: bytes | None, route: RouteRequest
    ) -> Response:
        """Send to the chosen replica and relay its answer: a journaled stream through a
        `ResumingRelay`, another stream as it comes, JSON once whole (so that a replica that
        breaks mid-answer can be replaced)."""
        journal = None
        if body is not None and self.config.max_resumes:
            journal = self.journal_cls.of(body, path == CHAT_PATH)
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        resends, failed = Resends(self.config.max_resumes), set[int]()
        reopen = partial(self._open, route, path, headers, resends)
        sent = body if journal is None else journal.upstream_body()
        leg = await reopen(sent, failed)
        kind = leg.upstream.headers.get("content-type", "application/json")
        if not kind.startswith("text/event-stream"):
            return await self._whole(leg, sent, reopen, resends, failed)
        answer = {"content-type": kind, REPLICA_HEADER: leg.replica.url}
        if journal is None or leg.upstream.status_code != 200:
            return StreamingResponse(self._relay(leg), leg.upstream.status_code, headers=answer)
        relay = ResumingRelay(journal, leg, reopen, self._close, resends, self.stalls, failed)
        return StreamingResponse(relay.events(), 200, headers=answer)

    async def _open(
        self, route: RouteRequest, path: str, headers: dict[str, str], resends: Resends,
        body: bytes | None, failed: set[int],
    ) -> Leg:  # fmt: skip
        """A replica's answer, headers read, from the policy's choice among those not in
        `failed`. A refused connection: skip it, choose again; a replica that accepted and
        broke before answering: the same, while `resends` allow."""
        while candidates := self._candidates(failed):
            loads = [r.in_flight for r in self.replicas]
            decision = self.policy.choose_request(route, loads, candidates)
            replica = self.replicas[decision.replica]
            replica.in_flight += 1  # before awaiting: concurrent choices see the load
            try:
                upstream = await self._send(replica, path, body, headers)
            except httpx.HTTPError as error:
                replica.in_flight -= 1
                replica.mark_down(error, self.config.cooldown_s)
                failed.add(decision.replica)
                refused = isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout))
                if refused or resends.spend():  # it may have run it: resent, within bounds
                    continue
                raise GatewayError(
                    f"replica {replica.url} failed before answering: {replica.last_error}"
                ) from error
            except BaseException:  # cancelled (the client left): not in flight after all
                replica.in_flight -= 1
                raise
            self._count(decision, route, replica, recorded=body is not None)
            return Leg(decision.replica, replica, upstream)
        raise APIError(503, "no replica is available: " + "; ".join(
            f"{r.url}: {r.last_error or 'down'}" for r in self.replicas
        ), code="no_replica_available")  # fmt: skip

    def _candidates(self, tried: set[int]) -> list[int]:
        """Replicas that are up; when all are down, the untried ones (they may be back)."""
        untried = [i for i in range(len(self.replicas)) if i not in tried]
        return [i for i in untried if self.replicas[i].is_up()] or untried

    async def _send(
        self, replica: Replica, path: str, body: bytes | None, headers: dict[str, str]
    ) -> httpx.Response:
        assert self.client is not None, "the router's HTTP client opens with the app"
        method = "GET" if body is None else "POST"
        upstream = self.client.build_request(method, replica.url + path, content=body,
                                             headers=headers)  # fmt: skip
        return await self.client.send(upstream, stream=True)

    async def _close(self, leg: Leg, failure: LegFailed | None = None) -> None:
        """The leg is over: its load drops, its connection closes (a replica then aborts
        the request it was still running); a failure that broke it marks it down."""
        leg.replica.in_flight -= 1
        if failure is not None and failure.down:
            leg.replica.mark_down(failure.cause, self.config.cooldown_s)
        with anyio.CancelScope(shield=True):  # runs even when the client's task is cancelled
            await leg.upstream.aclose()

    def _count(
        self, decision: Decision, route: RouteRequest, replica: Replica, recorded: bool
    ) -> None:
        if recorded:  # generation requests only: /v1/models teaches nothing about caches
            self.policy.record_request(route, decision.replica)
            replica.routed[decision.reason] += 1
            replica.matched_units += decision.matched
            replica.expected_blocks.update(decision.blocks)

    async def _whole(
        self, leg: Leg, body: bytes | None, reopen: Reopen, resends: Resends, failed: set[int]
    ) -> Response:
        """A JSON answer, read whole before the client sees a byte: a replica that breaks
        mid-answer is replaced, the request sent again from scratch (while `resends` allow)."""
        while True:
            try:
                content = await leg.upstream.aread()
            except httpx.HTTPError as error:
                await self._close(leg, LegFailed(str(error), error))
                failed.add(leg.index)
                if not resends.spend():
                    raise GatewayError(
                        f"replica {leg.replica.url} failed mid-answer: {error}"
                    ) from error
                leg = await reopen(body, failed)
                continue
            except BaseException:  # cancelled: the leg is over all the same
                await self._close(leg)
                raise
            await self._close(leg)
            kind = leg.upstream.headers.get("content-type", "application/json")
            headers = {"content-type": kind, REPLICA_HEADER: leg.replica.url}
            return Response(content, leg.upstream.status_code, headers=headers)

    async def _relay(self, leg: Leg) -> AsyncIterator[bytes]:
        """An unjournaled stream's bytes as they come; the load drops when the answer ends
        or the client leaves (closing the upstream stream makes the replica abort it)."""
        failure = None
        try:
            async for chunk in leg.upstream.aiter_bytes():
                yield chunk
        except httpx.HTTPError as error:  # the replica died mid-answer: too late for a 502
            failure = LegFailed(f"replica {leg.replica.url} failed mid-stream: {error}", error)
            leg.replica.broken_streams += 1
            yield data_event(GatewayError(str(failure)).body())
        finally:
            await self._close(leg, failure)

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
        if proxy.feed is not None:
            proxy.feed.start()
        try:
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
                proxy.client = client
                yield
        finally:
            proxy.client = None
            if proxy.feed is not None:
                await asyncio.to_thread(proxy.feed.close)

    app = FastAPI(title="minserve router", lifespan=lifespan)
    install_error_handlers(app)

    async def generate(request: Request, path: str) -> Response:
        body = await read_json_body(request, proxy.config.max_request_bytes)
        return await proxy.forward(request, path, body, proxy.read(request, path, body))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, CHAT_PATH)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.forward(request, "/v1/models", None, RouteRequest(None))

    @app.get("/health")
    async def health() -> JSONResponse:
        up = await asyncio.gather(*(proxy.probe(r) for r in proxy.replicas))
        states = {r.url: "up" if ok else r.last_error for r, ok in zip(proxy.replicas, up)}
        if not any(up):
            raise APIError(503, f"no replica is healthy: {states}", code="no_replica_available")
        return JSONResponse({"replicas": states})

    @app.get("/metrics")
    async def metrics() -> Response:
        catchups = proxy.feed.blocks.catchup_counts() if proxy.feed is not None else None
        text = render_metrics(proxy.replicas, catchups, proxy.stalls)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app
