"""The gateway application: routes, the HTTP adapter over the request path, the wiring.

Request path: authorise → read the body → the `Director` (`control/director.py`: parse
once, rewrite the model and pick its pool, admission, candidates, schedule, lease) →
forward bytes with fallbacks (`proxy.py`, `disagg.py`) → relay → the Director accounts,
logs and counts.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from aiohttp import web

from servegate.config import GatewaySettings, ServegateConfig
from servegate.control.director import Director, Parser
from servegate.control.snapshot import RoutingSnapshot
from servegate.datalayer.outlier import OutlierDetector
from servegate.engines.registry import EngineRegistry
from servegate.gateway.access_log import AccessLog
from servegate.gateway.admin import add_admin_routes
from servegate.gateway.admission import GatewayAdmission
from servegate.gateway.cache_routing import CacheRouting
from servegate.gateway.clients import transport_for
from servegate.gateway.connections import (
    CONNECTIONS,
    FRONT,
    ConnectionCollector,
    ConnectionGuard,
    connection_middleware,
)
from servegate.gateway.disagg import Disaggregator
from servegate.gateway.errors import (
    BadRequest,
    BodyTooLarge,
    GatewayError,
    InternalError,
    ModelNotFound,
    NotFound,
    RequestTimeout,
    clip,
    describe,
    for_status,
    render,
)
from servegate.gateway.inference import serve_inference
from servegate.gateway.lean_server import LeanServer
from servegate.gateway.lifecycle import RUNNING, start_gateway
from servegate.gateway.metrics import GatewayMetrics
from servegate.gateway.model_routing import RoutingTable
from servegate.gateway.openapi import PASSTHROUGH, serve_openapi
from servegate.gateway.parse import parse_request
from servegate.gateway.pools import PoolRuntime, RuntimeCollector, build_runtimes
from servegate.gateway.proxy import Proxy
from servegate.gateway.reload import RELOADER, ConfigReloader, ConfigSource, FixedConfig, Reloader
from servegate.gateway.retry import RetryBudget
from servegate.gateway.sink import AiohttpSink
from servegate.gateway.tenants import Tenant, TenantTable
from servegate.gateway.transport import UpstreamTransport
from servegate.gateway.ui import DecisionLog, add_ui_routes
from servegate.pool.pool import Pool
from servegate.scaleout.report import add_scaleout_routes
from servegate.scheduling.request import RequestKind
from servegate.scheduling.scheduler import Scheduler

log = logging.getLogger("servegate.gateway")

PREPARED: contextvars.ContextVar[bool] = contextvars.ContextVar("prepared", default=False)
"""True once the current request's response headers are on their way (`on_response_prepare`;
reset per request by `error_middleware`: a connection's requests share one task)."""
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})


@dataclass(slots=True, eq=False)
class Gateway:
    """The process's gateway, built complete and not started: the `Director` (which holds
    the current `RoutingSnapshot`) and what lives as long as the process. What exists only
    while it serves (sessions, pool feeds, probes, scale-out, the reloader) is the
    `RunningGateway` that `start_gateway` returns (lifecycle.py). `config`, `runtimes`,
    `routing` and `tenants` read the current snapshot: a request must read
    `director.snapshot` once instead, and keep it. `pool`, `scheduler`, `admission`… are
    the default (first) pool's."""

    director: Director
    metrics: GatewayMetrics
    access_log: AccessLog
    rng: random.Random
    transport: UpstreamTransport
    """The request path's upstream client, shared by every pool's proxy."""
    budget: RetryBudget
    decisions: DecisionLog
    """The latest scheduling decisions, for the status page (`/ui`)."""
    config_dir: Path | None
    """The config file's folder, against which its relative paths resolve (pickers, chat
    templates, key files); None = a config not read from a file (the working directory)."""
    started_at: float = field(default_factory=time.time)

    @property
    def snapshot(self) -> RoutingSnapshot:
        return self.director.snapshot

    def swap(self, snapshot: RoutingSnapshot) -> None:
        """Switch every new request over to `snapshot` (one reference: requests in flight
        keep the one they started with)."""
        self.director.snapshot = snapshot

    @property
    def config(self) -> ServegateConfig:
        return self.director.snapshot.config

    @property
    def runtimes(self) -> tuple[PoolRuntime, ...]:
        return self.director.snapshot.runtimes

    @property
    def routing(self) -> RoutingTable:
        return self.director.snapshot.routing

    @property
    def tenants(self) -> TenantTable:
        """Accepted keys and their tenants; rebuilt on reload."""
        return self.director.snapshot.tenants

    def pool_runtimes(self) -> tuple[PoolRuntime, ...]:
        """Every pool's runtime (`.pool`, `.scheduler`, …); the first is the default."""
        return self.runtimes

    @property
    def default(self) -> PoolRuntime:
        return self.runtimes[0]

    @property
    def pool(self) -> Pool:
        return self.runtimes[0].pool

    @property
    def scheduler(self) -> Scheduler:
        return self.runtimes[0].scheduler

    @property
    def admission(self) -> GatewayAdmission:
        return self.runtimes[0].admission

    @property
    def outlier(self) -> OutlierDetector:
        return self.runtimes[0].state.outlier

    @property
    def cache_routing(self) -> CacheRouting:
        return self.runtimes[0].cache_routing

    @property
    def engines(self) -> EngineRegistry:
        return self.runtimes[0].state.engines

    @property
    def proxy(self) -> Proxy:
        return self.runtimes[0].proxy

    @property
    def disagg(self) -> Disaggregator:
        return self.runtimes[0].disagg

    def runtime(self, name: str) -> PoolRuntime | None:
        return self.director.snapshot.runtime(name)


GATEWAY = web.AppKey("gateway", Gateway)


def build_gateway(
    config: ServegateConfig,
    config_dir: Path | None = None,
    access_stream: object = None,
    transport: UpstreamTransport | None = None,
) -> Gateway:
    """The gateway, complete: every pool's runtime is built (nothing is started).
    `transport`: how requests reach replicas (aiohttp unless a test gives another)."""
    metrics = GatewayMetrics()
    transport = transport or transport_for(config.gateway.upstream_client)
    budget = RetryBudget(config.retries)
    runtimes, routing = build_runtimes(config, metrics, transport, budget, config_dir)
    snapshot = RoutingSnapshot(
        config, runtimes, routing, TenantTable.from_config(config, config_dir)
    )
    access = AccessLog(access_stream, enabled=config.gateway.access_log)  # type: ignore[arg-type]
    rng = random.Random(config.gateway.seed)
    decisions = DecisionLog()
    director = Director(snapshot, metrics, access, rng, decisions)
    gw = Gateway(
        director=director,
        metrics=metrics,
        access_log=access,
        rng=rng,
        transport=transport,
        budget=budget,
        decisions=decisions,
        config_dir=config_dir,
    )
    # both read whichever snapshot is current at the scrape
    metrics.watch(lambda: [r.pool for r in director.snapshot.runtimes])
    metrics.registry.register(RuntimeCollector(lambda: director.snapshot.runtimes))
    return gw


# -- request path -----------------------------------------------------------------


def _authorise(gw: Gateway, request: web.Request) -> Tenant | None:
    return gw.tenants.authenticate(request.headers.get("Authorization", ""))


async def _read_body(settings: GatewaySettings, request: web.Request) -> bytes:
    limit = settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
    try:
        if request.content.is_eof():  # all of it arrived with the head: no timer to arm
            return await request.read()
        async with asyncio.timeout(settings.body_timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes") from exc
    except web.RequestPayloadError as exc:
        # A body whose Content-Encoding or chunked framing does not decode.
        raise BadRequest(f"the request body cannot be decoded: {describe(exc)}") from exc
    except TimeoutError as exc:
        raise RequestTimeout(
            f"the request body did not arrive within {settings.body_timeout_s:g} s"
        ) from exc


async def _inference(
    request: web.Request, kind: RequestKind, parse: Parser = parse_request
) -> web.StreamResponse:
    """The HTTP adapter over the request path (`inference.py`): aiohttp's body, its sink."""
    sink = AiohttpSink(request)

    async def read_body(settings: GatewaySettings) -> bytes:
        return await _read_body(settings, request)

    director = request.app[GATEWAY].director
    error = await serve_inference(
        director, sink, kind, request.method, request.path, request.headers, read_body, parse
    )
    response = sink.answer()
    if isinstance(error, RequestTimeout):
        await _answer_and_close(request, response)
    return response


async def _answer_and_close(request: web.Request, response: web.StreamResponse) -> None:
    """Sends `response` now and closes the connection, without waiting for (lingering on)
    a body the client is still trickling."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, RequestKind.CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, RequestKind.COMPLETION)


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _inference(request, RequestKind.EMBEDDING)


async def responses(request: web.Request) -> web.StreamResponse:
    return await _inference(request, RequestKind.RESPONSES)


async def messages(request: web.Request) -> web.StreamResponse:
    return await _inference(request, RequestKind.MESSAGES)


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Any other body with a `model`: routed by it, forwarded as it is (`PASSTHROUGH_ROUTES`
    and every other `POST /v1/…`)."""
    return await _inference(request, RequestKind.OTHER)


PASSTHROUGH_ROUTES = tuple(PASSTHROUGH)
"""vLLM's routes outside `/v1/` (and the audio ones, named for the docs); every other
`POST /v1/…` reaches `passthrough` through the catch-all."""
INFERENCE_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages"}
    | set(PASSTHROUGH_ROUTES)
)
"""Routes of their own: another method on them is a 405, not a 404."""


def public_models(gw: Gateway) -> list[dict[str, object]]:
    """Aliases (their `root` the heaviest target) and every pool's models, by id."""
    created = int(gw.started_at)
    out: dict[str, dict[str, object]] = {}
    for runtime in gw.runtimes:
        for entry in runtime.pool.models.values():
            out.setdefault(
                entry.id,
                {
                    "id": entry.id,
                    "object": "model",
                    "created": created,
                    "owned_by": "servegate",
                    "root": entry.base,
                    "parent": entry.parent,
                },
            )
    for name, split in gw.routing.splits.items():
        heaviest = max(split.targets, key=lambda t: t.weight).model
        out[name] = {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "servegate",
            "root": heaviest,
            "parent": None,
        }
    return [out[k] for k in sorted(out)]


async def list_models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        _authorise(gw, request)
    except GatewayError as exc:
        return render(exc)
    data = public_models(gw)
    return web.Response(
        body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
    )


async def get_model(request: web.Request) -> web.Response:
    """`GET /v1/models/{id}`: one entry of `GET /v1/models`, or an OpenAI 404."""
    gw = request.app[GATEWAY]
    try:
        _authorise(gw, request)
        wanted = request.match_info["model"]
        for entry in public_models(gw):
            if entry["id"] == wanted:
                return web.Response(body=orjson.dumps(entry), content_type="application/json")
        raise ModelNotFound(f"The model `{wanted}` does not exist.")
    except GatewayError as exc:
        return render(exc)


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def ready(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    runtimes = gw.runtimes
    count = sum(r.pool.ready_count() for r in runtimes)
    total = sum(len(r.pool) for r in runtimes)
    body = orjson.dumps({"ready": count > 0, "ready_endpoints": count, "endpoints": total})
    return web.Response(status=200 if count else 503, body=body, content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return web.Response(body=gw.metrics.render(), content_type="text/plain", charset="utf-8")


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    prepared = PREPARED.set(False)
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return render(NotFound(f"no route for {clip(request.method)} {clip(request.path)}"))
    except web.HTTPMethodNotAllowed:
        if request.path.startswith("/v1/") and request.path not in INFERENCE_ROUTES:
            # only the POST catch-all matched: there is no such route
            return render(NotFound(f"no route for {clip(request.method)} {clip(request.path)}"))
        exc = BadRequest(f"method {clip(request.method)} is not allowed on {clip(request.path)}")
        exc.status = 405
        return render(exc)
    except web.HTTPRequestEntityTooLarge:
        return render(BodyTooLarge("request body too large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return render(for_status(exc.status, exc.text or exc.reason))
    except Exception as exc:
        if PREPARED.get():
            raise  # the answer has begun: only a cut connection can say it failed
        log.exception("unexpected error on %s %s", request.method, clip(request.path))
        return render(InternalError(f"the gateway failed: {describe(exc)}"))
    finally:
        PREPARED.reset(prepared)


async def _mark_prepared(request: web.Request, response: web.StreamResponse) -> None:
    PREPARED.set(True)


# -- lifecycle ----------------------------------------------------------------------


def _serving(source: ConfigSource | None) -> Callable[[web.Application], AsyncIterator[None]]:
    """The app's cleanup context: start the gateway (lifecycle.py) and its reloader (from
    `source`; `FixedConfig` without one), stop them at shutdown."""

    async def serving(app: web.Application) -> AsyncIterator[None]:
        gw = app[GATEWAY]
        running = app[RUNNING] = await start_gateway(gw, probe_port=gw.config.gateway.probe_port)
        reloader: Reloader = FixedConfig(gw)
        if source is not None:
            reloader = ConfigReloader(running, source)
        app[RELOADER] = reloader
        try:
            yield
        finally:
            await reloader.close()
            await running.stop()
            gw.access_log.flush()

    return serving


async def _stop_queueing(app: web.Application) -> None:
    turned_away = sum(r.admission.close() for r in app[GATEWAY].runtimes)
    if turned_away:
        log.info("shutting down: turned away %d queued requests", turned_away)


def create_app(gw: Gateway, source: ConfigSource | None = None) -> web.Application:
    """The HTTP app over `gw`; it starts the gateway when it starts. `source`: where a
    reload (SIGHUP, `POST /admin/reload`, a watched file) re-reads the config from."""
    app = web.Application(
        client_max_size=gw.config.gateway.max_body_bytes,
        middlewares=[connection_middleware, error_middleware],
    )
    app[GATEWAY] = gw
    guard = app[CONNECTIONS] = ConnectionGuard(gw.config.gateway)
    gw.metrics.registry.register(ConnectionCollector(guard))
    if gw.config.gateway.http_server == "lean":
        lean = LeanServer(gw.director, gw.config.gateway, guard)
        app[FRONT] = lean.front
        drain_s = gw.config.gateway.drain_timeout_s

        async def drain_lean(app: web.Application) -> None:
            await lean.drain(drain_s)

        app.on_shutdown.append(drain_lean)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    for path in PASSTHROUGH_ROUTES:
        app.router.add_post(path, passthrough)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", serve_openapi)
    add_admin_routes(app, GATEWAY, RELOADER)
    add_ui_routes(app, GATEWAY)
    add_scaleout_routes(app, GATEWAY, RUNNING)
    app.router.add_post("/v1/{tail:.+}", passthrough)
    app.on_response_prepare.append(_mark_prepared)
    app.on_shutdown.append(_stop_queueing)
    app.cleanup_ctx.append(_serving(source))
    return app
