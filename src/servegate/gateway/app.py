"""The gateway application: routes, the request path, and the component wiring.

Request path: read body → authorise → parse once → resolve model → candidates →
schedule (pure) → forward bytes with fallbacks → relay → account, log, count.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from servegate.config import ServegateConfig
from servegate.datalayer import DataLayer, HealthSettings, ScrapeSettings
from servegate.datalayer.outlier import OutlierDetector
from servegate.engines.registry import EngineRegistry
from servegate.gateway.admin import add_admin_routes
from servegate.gateway.admission import (
    QUEUE_DURATION_HEADER,
    GatewayAdmission,
    build_admission,
    queue_ms,
)
from servegate.gateway.cache_routing import CacheRouting, build_cache_routing
from servegate.gateway.disagg import Disaggregator, build_disaggregator
from servegate.gateway.errors import (
    BadRequest,
    BodyTooLarge,
    GatewayError,
    ModelNotFound,
    NoEndpoints,
    NotFound,
    Unauthorized,
    render,
)
from servegate.gateway.logging import AccessLog, AccessRecord
from servegate.gateway.metrics import GatewayMetrics
from servegate.gateway.openapi import serve_openapi
from servegate.gateway.parse import parse_request
from servegate.gateway.probes import ProbeServer
from servegate.gateway.proxy import Proxy, forward_headers
from servegate.gateway.retry import RetryBudget
from servegate.pool.discovery import start_discovery
from servegate.pool.pool import Pool
from servegate.scheduling.config import DEFAULT_PICKER_CONFIG, load_picker_config
from servegate.scheduling.framework import CycleState, NoCandidates
from servegate.scheduling.registry import PluginContext
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.scheduler import Scheduler, result_as_dict

log = logging.getLogger("servegate.gateway")

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})


@dataclass(slots=True)
class Gateway:
    """Everything the request path needs, built once at startup."""

    config: ServegateConfig
    pool: Pool
    scheduler: Scheduler
    metrics: GatewayMetrics
    access_log: AccessLog
    engines: EngineRegistry
    rng: random.Random
    started_at: float = field(default_factory=time.time)
    proxy: Proxy | None = None
    datalayer: DataLayer | None = None
    session: aiohttp.ClientSession | None = None
    admission: GatewayAdmission | None = None
    outlier: OutlierDetector | None = None
    budget: RetryBudget | None = None
    probes: ProbeServer | None = None
    cache_routing: CacheRouting = field(default_factory=CacheRouting)
    disagg: Disaggregator | None = None


GATEWAY = web.AppKey("gateway", Gateway)


def build_gateway(
    config: ServegateConfig, config_dir: Path | None = None, access_stream: object = None
) -> Gateway:
    pool = Pool(config.pool.name, staleness=config.pool.metrics_staleness_s)
    engines = EngineRegistry()
    for doc in config.pool.engines:
        engines.add_custom(doc)
    for declared in config.pool.models:
        pool.declare_model(declared.id, declared.parent)
    for endpoint_cfg in config.pool.endpoints:
        endpoint = endpoint_cfg.to_endpoint(config.pool.name)
        engines.get(endpoint.engine)
        pool.add(endpoint)
    picker_doc = config.picker_document(config_dir)
    scheduler = load_picker_config(
        picker_doc if picker_doc is not None else DEFAULT_PICKER_CONFIG,
        PluginContext(staleness_s=config.pool.metrics_staleness_s),
    )
    metrics = GatewayMetrics(lambda: (pool,))
    access = AccessLog(access_stream, enabled=config.gateway.access_log)  # type: ignore[arg-type]
    admission = build_admission(
        config.flow_control, pool, metrics.registry, picker_doc, scheduler.plugins
    )
    outlier = OutlierDetector(
        pool,
        config.outlier_detection,
        on_eject=lambda state, _s: metrics.ejections.labels(state.address).inc(),
    )
    return Gateway(
        admission=admission,
        outlier=outlier,
        budget=RetryBudget(config.retries),
        config=config,
        pool=pool,
        scheduler=scheduler,
        metrics=metrics,
        access_log=access,
        engines=engines,
        rng=random.Random(config.gateway.seed),
        cache_routing=build_cache_routing(config, pool, scheduler, metrics.registry),
    )


# -- request path -----------------------------------------------------------------


def _request_id(request: web.Request) -> str:
    rid = request.headers.get("X-Request-ID")
    if rid and len(rid) <= 128 and rid.isprintable():
        return rid
    return uuid.uuid4().hex


def _authorise(gw: Gateway, request: web.Request) -> None:
    keys = gw.config.gateway.api_keys
    if not keys:
        return
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    supplied = token.strip().encode() if scheme.lower() == "bearer" else b""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(supplied, key.encode())
    if not ok:
        raise Unauthorized("invalid or missing API key; send 'Authorization: Bearer <key>'")


async def _read_body(gw: Gateway, request: web.Request) -> bytes:
    limit = gw.config.gateway.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes") from exc


def _resolve_model(gw: Gateway, llm: LLMRequest) -> None:
    entry = gw.pool.resolve_model(llm.model)
    if entry is None:
        raise ModelNotFound(f"The model `{llm.model}` does not exist.")
    llm.target_model = entry.id
    llm.base_model = entry.base
    llm.lora = entry.id if entry.parent else None


async def _inference(request: web.Request, kind: RequestKind) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    started = time.monotonic()
    rid = _request_id(request)
    record = AccessRecord(request_id=rid, method=request.method, path=request.path)
    response: web.StreamResponse | None = None
    model_labels = ("unknown", "unknown")
    series = None
    admitted = False
    try:
        _authorise(gw, request)
        body = await _read_body(gw, request)
        llm = parse_request(body, kind, _lower_headers(request), rid)
        record.model = llm.model
        _resolve_model(gw, llm)
        record.target_model = llm.target_model
        model_labels = (llm.model, llm.target_model)
        series = gw.metrics.objective(llm.model, llm.target_model)
        series.running.inc()
        assert gw.admission is not None
        queued_s = await gw.admission.admit(llm, len(body))
        admitted = True
        now = time.monotonic()
        candidates = gw.pool.candidates(llm.base_model, now, llm.lora)
        if not candidates:
            raise NoEndpoints(f"no ready endpoint serves model `{llm.model}`")
        await gw.cache_routing.prepare(llm, candidates)
        t0 = time.perf_counter()
        try:
            decision = gw.scheduler.schedule(llm, candidates, CycleState(now=now, rng=gw.rng))
        except NoCandidates as exc:
            raise NoEndpoints(f"no endpoint fits the request for model `{llm.model}`") from exc
        gw.metrics.decision.observe(time.perf_counter() - t0)
        gw.scheduler.pre_request(llm, decision, now)
        extra = {"X-Request-ID": rid, QUEUE_DURATION_HEADER: queue_ms(queued_s)}
        gw.cache_routing.headers(llm, decision, extra)
        if gw.config.gateway.debug_headers:
            result = decision.results.get(decision.profile)
            if result is not None:
                extra["x-servegate-scores"] = orjson.dumps(result_as_dict(result)).decode()
        assert gw.proxy is not None
        upstream_headers = forward_headers(
            request.headers, rid, strip_authorization=bool(gw.config.gateway.api_keys)
        )
        if llm.target_model != llm.model:
            llm.body["model"] = llm.target_model
            body = orjson.dumps(llm.body)
        tokens = llm.prompt_tokens + (llm.max_tokens or 0)
        if gw.disagg is not None and gw.disagg.handles(decision):
            response = await gw.disagg.forward(
                request, llm, decision, request.path, body, upstream_headers, tokens, record,
                started, extra,
            )  # fmt: skip
        else:
            response = await gw.proxy.forward(
                request, decision.targets, request.path, body, upstream_headers, tokens, record,
                started, extra,
            )  # fmt: skip
        gw.scheduler.response_complete(llm, decision.endpoint, time.monotonic())
        return response
    except GatewayError as exc:
        record.status = exc.status
        record.error = exc.message
        gw.metrics.request_errors.labels(*model_labels, str(exc.status)).inc()
        response = render(exc, {"X-Request-ID": rid})
        return response
    except asyncio.CancelledError:
        record.status = 499
        record.error = "client disconnected"
        raise
    finally:
        if admitted and gw.admission is not None:
            gw.admission.completed()
        elapsed = time.monotonic() - started
        record.latency_ms = elapsed * 1000.0
        if response is None and record.status == 0:
            record.status = 499
            record.error = record.error or "client disconnected"
        if series is not None:
            series.running.dec()
            series.requests.inc()
            series.duration.observe(elapsed)
            if record.ttft_ms is not None:
                series.ttft.observe(record.ttft_ms / 1000.0)
            if record.prompt_tokens is not None:
                series.input_tokens.observe(record.prompt_tokens)
            if record.completion_tokens is not None:
                series.output_tokens.observe(record.completion_tokens)
        gw.metrics.response(record.status).inc()
        gw.access_log.write(record)


def _lower_headers(request: web.Request) -> dict[str, str]:
    return {k.lower(): v for k, v in request.headers.items()}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, RequestKind.CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, RequestKind.COMPLETION)


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _inference(request, RequestKind.EMBEDDING)


async def list_models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        _authorise(gw, request)
    except GatewayError as exc:
        return render(exc)
    created = int(gw.started_at)
    data = [
        {
            "id": entry.id,
            "object": "model",
            "created": created,
            "owned_by": "servegate",
            "root": entry.base,
            "parent": entry.parent,
        }
        for entry in sorted(gw.pool.models.values(), key=lambda e: e.id)
    ]
    return web.Response(
        body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
    )


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def ready(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    count = gw.pool.ready_count()
    body = orjson.dumps({"ready": count > 0, "ready_endpoints": count, "endpoints": len(gw.pool)})
    return web.Response(status=200 if count else 503, body=body, content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return web.Response(body=gw.metrics.render(), content_type="text/plain", charset="utf-8")


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return render(NotFound(f"no route for {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed:
        exc = BadRequest(f"method {request.method} is not allowed on {request.path}")
        exc.status = 405
        return render(exc)
    except web.HTTPRequestEntityTooLarge:
        return render(BodyTooLarge("request body too large"))


# -- lifecycle ----------------------------------------------------------------------


def build_datalayer(gw: Gateway, session: aiohttp.ClientSession) -> DataLayer:
    """The scrapers and health checkers for `gw.pool`; shared by the HTTP and ext_proc modes."""
    pool_cfg = gw.config.pool
    return DataLayer(
        gw.pool,
        session,
        gw.engines,
        scrape=ScrapeSettings(
            interval=pool_cfg.scrape_interval_s, timeout=pool_cfg.scrape_timeout_s
        ),
        health=HealthSettings(
            interval=pool_cfg.health.interval_s,
            timeout=pool_cfg.health.timeout_s,
            failure_threshold=pool_cfg.health.failure_threshold,
            success_threshold=pool_cfg.health.success_threshold,
            models_every=pool_cfg.health.models_refresh_every,
        ),
    )


async def _components(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    settings = gw.config.gateway
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    gw.session = session
    gw.proxy = Proxy(session, settings, gw.pool, gw.metrics, gw.outlier, gw.budget)
    gw.disagg = build_disaggregator(
        settings, gw.config.disaggregation, gw.scheduler.plugins, gw.proxy, session, gw.pool,
        gw.metrics,
    )  # fmt: skip
    probes = None
    if settings.probe_port is not None:
        probes = gw.probes = ProbeServer(gw.pool, settings.host, settings.probe_port)
        probes.start()
    # Scrapes and health probes get their own connection pool: aiohttp reuses idle
    # connections first-in first-out, so probes cycling through the request path's pool
    # would keep every idle connection alive forever, and a saturated request pool
    # must not delay a probe.
    control = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    gw.datalayer = build_datalayer(gw, control)
    await gw.datalayer.start()
    await gw.cache_routing.start(session)
    discovery = await start_discovery(gw.config.pool.discovery, gw.pool)
    log.info(
        "gateway started",
        extra={"fields": {"endpoints": [s.address for s in gw.pool]}},
    )
    try:
        yield
    finally:
        if discovery is not None:
            await discovery.stop()
        if probes is not None:
            probes.stop()
        await gw.cache_routing.stop()
        await gw.datalayer.stop()
        await control.close()
        await session.close()


async def _stop_queueing(app: web.Application) -> None:
    admission = app[GATEWAY].admission
    if admission is not None:
        turned_away = admission.close()
        if turned_away:
            log.info("shutting down: turned away %d queued requests", turned_away)


def create_app(gw: Gateway) -> web.Application:
    app = web.Application(
        client_max_size=gw.config.gateway.max_body_bytes, middlewares=[error_middleware]
    )
    app[GATEWAY] = gw
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", serve_openapi)
    add_admin_routes(app, GATEWAY)
    app.on_shutdown.append(_stop_queueing)
    app.cleanup_ctx.append(_components)
    return app
