"""The gateway application: routes, the request path, and the component wiring.

Request path: read body → authorise → parse once → rewrite the model and pick its pool
(model_routing.py, pools.py) → that pool's admission → candidates → schedule (pure) →
forward bytes with fallbacks → relay → account, log, count.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import orjson
from aiohttp import web

from servegate.config import ServegateConfig
from servegate.datalayer import DataLayer
from servegate.datalayer.outlier import OutlierDetector
from servegate.engines.registry import EngineRegistry
from servegate.gateway.access_log import AccessLog, AccessRecord
from servegate.gateway.admin import add_admin_routes
from servegate.gateway.admission import QUEUE_DURATION_HEADER, GatewayAdmission, queue_ms
from servegate.gateway.cache_routing import CacheRouting
from servegate.gateway.cluster_policy import apply_cluster_policy
from servegate.gateway.connections import (
    CONNECTIONS,
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
    NoEndpoints,
    NotFound,
    RequestTimeout,
    clip,
    describe,
    for_status,
    render,
)
from servegate.gateway.headers import (
    SUBSET_HEADER,
    model_rewrite_of,
    subset_of,
    within_subset,
)
from servegate.gateway.latency import Ticket
from servegate.gateway.metrics import GatewayMetrics
from servegate.gateway.model_routing import Routed, RoutingTable
from servegate.gateway.openapi import PASSTHROUGH, serve_openapi
from servegate.gateway.parse import parse_request, strip_gateway_fields, with_model
from servegate.gateway.pools import (
    PoolRuntime,
    RuntimeCollector,
    build_pool_datalayer,
    build_runtime,
)
from servegate.gateway.probes import ProbeServer
from servegate.gateway.proxy import Proxy, forward_headers
from servegate.gateway.retry import RetryBudget
from servegate.gateway.tenants import Tenant, TenantTable
from servegate.gateway.ui import DecisionLog, add_ui_routes
from servegate.pool.pool import Pool
from servegate.scaleout.report import add_scaleout_routes
from servegate.scaleout.wiring import start_scaleout
from servegate.scheduling.framework import CycleState, NoCandidates
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.scheduler import Scheduler, result_as_dict

if TYPE_CHECKING:
    from servegate.gateway.reload import ConfigReloader

Parser = Callable[[bytes, RequestKind, Mapping[str, str], str], LLMRequest]

log = logging.getLogger("servegate.gateway")

PREPARED: contextvars.ContextVar[bool] = contextvars.ContextVar("prepared", default=False)
"""True once the current request's response headers are on their way (`on_response_prepare`;
reset per request by `error_middleware`: a connection's requests share one task)."""
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
SERVED_MODEL_HEADER = "x-servegate-served-model"
"""On responses whose model was rewritten: the model the replica was asked for."""


@dataclass(slots=True)
class Gateway:
    """Everything the request path needs. Pools and model routing are swapped whole on
    reload; `pool`, `scheduler`, `admission`… are the default (first) pool's."""

    config: ServegateConfig
    runtimes: tuple[PoolRuntime, ...]
    routing: RoutingTable
    metrics: GatewayMetrics
    access_log: AccessLog
    rng: random.Random
    started_at: float = field(default_factory=time.time)
    session: aiohttp.ClientSession | None = None
    control: aiohttp.ClientSession | None = None
    budget: RetryBudget | None = None
    probes: ProbeServer | None = None
    config_dir: Path | None = None
    reload_listeners: list[Callable[[Gateway], None]] = field(default_factory=list)
    """Called after every successful reload, with the gateway already switched over."""
    reloader: ConfigReloader | None = None
    tenants: TenantTable = field(default_factory=lambda: TenantTable([]))
    """Accepted keys and their tenants; rebuilt on reload."""
    decisions: DecisionLog = field(default_factory=DecisionLog)
    """The latest scheduling decisions, for the status page (`/ui`)."""

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
    def proxy(self) -> Proxy | None:
        return self.runtimes[0].proxy

    @property
    def disagg(self) -> Disaggregator | None:
        return self.runtimes[0].disagg

    @property
    def datalayer(self) -> DataLayer | None:
        return self.runtimes[0].state.datalayer

    @datalayer.setter
    def datalayer(self, value: DataLayer | None) -> None:
        self.runtimes[0].state.datalayer = value

    def runtime(self, name: str) -> PoolRuntime | None:
        return next((r for r in self.runtimes if r.name == name), None)


GATEWAY = web.AppKey("gateway", Gateway)


def build_runtimes(
    config: ServegateConfig,
    metrics: GatewayMetrics,
    config_dir: Path | None = None,
    previous: tuple[PoolRuntime, ...] = (),
) -> tuple[tuple[PoolRuntime, ...], RoutingTable]:
    """Every pool's runtime and the model routing table; raises before starting anything."""
    runtimes = tuple(
        build_runtime(config, entry, metrics, config_dir, previous)
        for entry in config.pool_entries()
    )
    routing = RoutingTable.from_config(config.model_rewrites)
    known = {m for r in runtimes for m in r.pool.models}
    unknown = sorted(routing.targets() - known)
    if unknown:
        log.warning(
            "rewrite targets no pool declares yet (expected from replicas' /v1/models): %s",
            ", ".join(unknown),
        )
    return runtimes, routing


def build_gateway(
    config: ServegateConfig, config_dir: Path | None = None, access_stream: object = None
) -> Gateway:
    holder: list[Gateway] = []
    metrics = GatewayMetrics(lambda: [r.pool for r in holder[0].runtimes] if holder else [])
    runtimes, routing = build_runtimes(config, metrics, config_dir)
    metrics.registry.register(RuntimeCollector(lambda: holder[0].runtimes if holder else ()))
    access = AccessLog(access_stream, enabled=config.gateway.access_log)  # type: ignore[arg-type]
    gw = Gateway(
        config=config,
        runtimes=runtimes,
        routing=routing,
        budget=RetryBudget(config.retries),
        metrics=metrics,
        access_log=access,
        rng=random.Random(config.gateway.seed),
        config_dir=config_dir,
        tenants=TenantTable.from_config(config, config_dir),
    )
    holder.append(gw)
    return gw


# -- request path -----------------------------------------------------------------


def _request_id(request: web.Request) -> str:
    rid = request.headers.get("X-Request-ID")
    if rid and len(rid) <= 128 and rid.isprintable():
        return rid
    return os.urandom(16).hex()


def _authorise(gw: Gateway, request: web.Request) -> Tenant | None:
    return gw.tenants.authenticate(request.headers.get("Authorization", ""))


async def _read_body(gw: Gateway, request: web.Request) -> bytes:
    settings = gw.config.gateway
    limit = settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
    try:
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


def route_request(gw: Gateway, llm: LLMRequest) -> PoolRuntime:
    """Rewrite the model (aliases, weighted splits, llm-d's model-name-rewrite header), then
    find the pool that serves it. A rule for the requested model wins over the header."""
    runtimes = gw.runtimes
    if not llm.model:
        # a passthrough body without a model (vLLM's default): the default pool, any endpoint
        return runtimes[0]
    routing = gw.routing
    served = routing.fallback is not None and any(
        r.pool.resolve_model(llm.model) is not None for r in runtimes
    )
    routed = routing.route(llm.model, llm.headers, gw.rng, served)
    if routed.rewritten:
        gw.metrics.rewritten(routed.rule, llm.model, routed.model)
    else:
        named = model_rewrite_of(llm.headers)
        if named is not None and named != llm.model:
            routed = Routed(named, None, True)
    for runtime in runtimes:
        if routed.pool is not None and runtime.name != routed.pool:
            continue
        entry = runtime.pool.resolve_model(routed.model)
        if entry is not None:
            llm.target_model = entry.id
            llm.base_model = entry.base
            llm.lora = entry.id if entry.parent else None
            return runtime
    if routed.rewritten:
        raise ModelNotFound(
            f"The model `{clip(llm.model)}` is routed to `{clip(routed.model)}`, "
            "which no pool serves."
        )
    raise ModelNotFound(f"The model `{clip(llm.model)}` does not exist.")


DISAGG_KINDS = frozenset({RequestKind.CHAT, RequestKind.COMPLETION})
"""Kinds the gateway-orchestrated P/D path knows how to split; others go to the decode
target as they are."""


async def _inference(
    request: web.Request, kind: RequestKind, parse: Parser = parse_request
) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    started = time.monotonic()
    rid = _request_id(request)
    record = AccessRecord(request_id=rid, method=request.method, path=request.path)
    response: web.StreamResponse | None = None
    series = None
    error_code: str | None = None
    admitted = False
    request_bytes = 0
    rt: PoolRuntime | None = None
    tenant: Tenant | None = None
    estimated = 0
    ticket: Ticket | None = None
    try:
        tenant = _authorise(gw, request)
        body = await _read_body(gw, request)
        request_bytes = len(body)
        headers = _lower_headers(request)
        llm = parse(body, kind, headers, rid)
        if strip_gateway_fields(llm.body):
            body = orjson.dumps(llm.body)
        record.model = llm.model
        estimated = llm.prompt_tokens + (llm.max_tokens or 0)
        if tenant is not None:
            record.tenant = tenant.name
            llm.fairness_id = tenant.fairness_id
            tenant.admit(estimated)
        rt = route_request(gw, llm)
        rt.enter()
        record.target_model = llm.target_model
        record.pool = rt.name
        max_priority = tenant.max_priority if tenant is not None else None
        llm.priority = rt.admission.priority_of(headers)
        if max_priority is not None and llm.priority > max_priority:
            llm.priority = max_priority
        series = gw.metrics.start(llm.model, llm.target_model, llm.fairness_id, llm.priority)
        # routing token ids before admission: a tokenizer may await (`/tokenize`), and
        # nothing may await between admission and dispatch, or a burst would pass
        # flow control before any of it counts as in flight
        early = rt.pool.candidates(llm.base_model, time.monotonic(), llm.lora)
        if early:
            await rt.cache_routing.prepare(llm, early)
        queued_s = await rt.admission.admit(llm, len(body), max_priority)
        admitted = True
        now = time.monotonic()
        candidates = rt.pool.candidates(llm.base_model or None, now, llm.lora)
        subset = subset_of(headers)
        if subset is not None:
            candidates = within_subset(candidates, subset)
            if not candidates:
                raise NoEndpoints(
                    f"no ready endpoint serves model `{llm.target_model}` within {SUBSET_HEADER}"
                )
        if not candidates:
            raise NoEndpoints(f"no ready endpoint serves model `{llm.target_model}`")
        if not early:
            await rt.cache_routing.prepare(llm, candidates)
        if rt.latency is not None:  # SLO admission (latency-slo-admitter): may wait, or shed
            pool, base, lora = rt.pool, llm.base_model, llm.lora
            fresh = await rt.latency.admit(
                llm, started, candidates, lambda at: pool.candidates(base, at, lora), gw.rng
            )
            if fresh is not None:
                now, candidates = time.monotonic(), fresh
                if not candidates:
                    raise NoEndpoints(f"no ready endpoint serves model `{llm.target_model}`")
        t0 = time.perf_counter()
        cycle = CycleState(now=now, rng=gw.rng)
        try:
            decision = rt.scheduler.schedule(llm, candidates, cycle)
        except NoCandidates as exc:
            gw.metrics.scheduled(llm.target_model, None)
            raise NoEndpoints(
                f"no endpoint fits the request for model `{llm.target_model}`"
            ) from exc
        gw.metrics.decision.observe(time.perf_counter() - t0)
        gw.metrics.observe_pick(rt.name, decision)
        gw.metrics.scheduled(llm.target_model, decision.endpoint.address)
        if rt.latency is not None:  # predicted latency into the record; learned at the end
            ticket = rt.latency.dispatch(llm, decision, record, cycle, started)
        rt.scheduler.pre_request(llm, decision, now)
        gw.decisions.record(rt.name, llm, decision, now)
        extra = {"X-Request-ID": rid, QUEUE_DURATION_HEADER: queue_ms(queued_s)}
        rt.cache_routing.headers(llm, decision, extra)
        if gw.config.gateway.debug_headers:
            result = decision.results.get(decision.profile)
            if result is not None:
                extra["x-servegate-scores"] = orjson.dumps(result_as_dict(result)).decode()
            if ticket is not None:
                ticket.debug(extra)
        assert rt.proxy is not None
        upstream_headers = forward_headers(
            request.headers,
            rid,
            strip_authorization=gw.tenants.enabled,
            client=request.remote,
        )
        if decision.upstream_headers:
            upstream_headers.update(decision.upstream_headers)
        if llm.target_model != llm.model:
            body = with_model(llm, body)
            extra[SERVED_MODEL_HEADER] = llm.target_model
        tokens = llm.prompt_tokens + (llm.max_tokens or 0)
        if rt.disagg is not None and kind in DISAGG_KINDS and rt.disagg.handles(decision):
            response = await rt.disagg.forward(
                request, llm, decision, request.path, body, upstream_headers, tokens, record,
                started, extra,
            )  # fmt: skip
        else:
            response = await rt.proxy.forward(
                request, decision.targets, request.path, body, upstream_headers, tokens, record,
                started, extra,
            )  # fmt: skip
        rt.scheduler.response_complete(llm, decision.endpoint, time.monotonic())
        return response
    except GatewayError as exc:
        record.status = exc.status
        record.error = exc.message
        error_code = exc.canonical
        if series is None:
            gw.metrics.error(exc.canonical, model=record.model or "")
        response = render(exc, {"X-Request-ID": rid})
        if isinstance(exc, RequestTimeout):
            await _answer_and_close(request, response)
        return response
    except asyncio.CancelledError:
        record.status = 499
        record.error = "client disconnected"
        raise
    except Exception as exc:
        record.error = describe(exc)
        if PREPARED.get():
            raise  # the answer has begun: only a cut connection can say it failed
        log.exception("unexpected error on request %s", rid)
        error = InternalError(f"the gateway failed: {describe(exc)}")
        record.status = error.status
        error_code = error.canonical
        if series is None:
            gw.metrics.error(error.canonical, model=record.model or "")
        response = render(error, {"X-Request-ID": rid})
        return response
    finally:
        if tenant is not None and admitted and record.completion_tokens is not None:
            tenant.settle(estimated, (record.prompt_tokens or 0) + record.completion_tokens)
        if ticket is not None:
            ticket.done(record, time.monotonic())
        if rt is not None:
            if admitted:
                rt.admission.completed()
            rt.leave()
        elapsed = time.monotonic() - started
        record.latency_ms = elapsed * 1000.0
        if response is None and record.status == 0:
            record.status = 499
            record.error = record.error or "client disconnected"
        if series is not None:
            gw.metrics.finish(series, record, elapsed, request_bytes, error_code)
        gw.metrics.response(record.status).inc()
        gw.access_log.write(record)


async def _answer_and_close(request: web.Request, response: web.StreamResponse) -> None:
    """Sends `response` now and closes the connection, without waiting for (lingering on)
    a body the client is still trickling."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()


def _lower_headers(request: web.Request) -> dict[str, str]:
    return {k.lower(): v for k, v in request.headers.items()}


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


def build_datalayer(gw: Gateway, session: aiohttp.ClientSession) -> DataLayer:
    """The scrapers and health checkers for `gw.pool`; shared by the HTTP and ext_proc modes."""
    return build_pool_datalayer(gw.default.state.settings, gw.pool, session, gw.engines)


async def start_runtimes(
    gw: Gateway, runtimes: tuple[PoolRuntime, ...], config: ServegateConfig | None = None
) -> None:
    assert gw.session is not None and gw.control is not None
    for runtime in runtimes:
        await runtime.start(config or gw.config, gw.session, gw.control, gw.metrics, gw.budget)


async def _components(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    settings = gw.config.gateway
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
    # No cookie jar: a replica's Set-Cookie is never replayed on other clients' requests
    # (nor relayed to the client: proxy.UPSTREAM_DROP).
    session = aiohttp.ClientSession(
        connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
    )
    gw.session = session
    probes = None
    if settings.probe_port is not None:
        probes = gw.probes = ProbeServer(gw.pool, settings.host, settings.probe_port)
        probes.start()
    # Scrapes and health probes get their own connection pool: aiohttp reuses idle
    # connections first-in first-out, so probes cycling through the request path's pool
    # would keep every idle connection alive forever, and a saturated request pool
    # must not delay a probe.
    control = gw.control = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar()
    )
    scaleout = await start_scaleout(gw, app)  # before the runtimes: a follower scrapes nothing
    await start_runtimes(gw, gw.runtimes)
    apply_cluster_policy(gw)  # and again whenever the cluster's objects or the config change
    gw.reload_listeners.append(apply_cluster_policy)
    log.info(
        "gateway started",
        extra={
            "fields": {
                "pools": {r.name: [s.address for s in r.pool] for r in gw.runtimes},
            }
        },
    )
    try:
        yield
    finally:
        if gw.reloader is not None:
            await gw.reloader.close()
        if probes is not None:
            probes.stop()
        if scaleout is not None:
            await scaleout.stop()
        for runtime in gw.runtimes:
            await runtime.stop(keep_state=False)
        await control.close()
        await session.close()
        gw.access_log.flush()


async def _stop_queueing(app: web.Application) -> None:
    turned_away = sum(r.admission.close() for r in app[GATEWAY].runtimes)
    if turned_away:
        log.info("shutting down: turned away %d queued requests", turned_away)


def create_app(gw: Gateway) -> web.Application:
    app = web.Application(
        client_max_size=gw.config.gateway.max_body_bytes,
        middlewares=[connection_middleware, error_middleware],
    )
    app[GATEWAY] = gw
    guard = app[CONNECTIONS] = ConnectionGuard(gw.config.gateway)
    gw.metrics.registry.register(ConnectionCollector(guard))
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
    add_admin_routes(app, GATEWAY)
    add_ui_routes(app, GATEWAY)
    add_scaleout_routes(app, GATEWAY)
    app.router.add_post("/v1/{tail:.+}", passthrough)
    app.on_response_prepare.append(_mark_prepared)
    app.on_shutdown.append(_stop_queueing)
    app.cleanup_ctx.append(_components)
    return app
