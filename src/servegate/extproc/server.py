"""`servegate extproc`: the endpoint picker as Envoy's external processor, with health and metrics.

Three listeners, as the Gateway API Inference Extension's picker has them:

    9002  gRPC  envoy.service.ext_proc.v3.ExternalProcessor  (one stream per HTTP request)
    9003  gRPC  grpc.health.v1.Health: `liveness`, `readiness`, the ExternalProcessor's name
    9090  HTTP  /metrics (the HTTP gateway's metrics), /health, /ready

The `Gateway` is the HTTP gateway's (`build_gateway`): the same Director, every
pool's runtime (data layer, discovery, scheduler, flow control) and metrics. On
stop: readiness goes NOT_SERVING, queued requests are turned away, open streams get
`shutdown_grace_s` to finish, then the runtimes stop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
from aiohttp import web
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import (
    ExternalProcessorServicer,
    add_ExternalProcessorServicer_to_server,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]

from servegate.config import ExtProcSettings, ServegateConfig
from servegate.extproc.protocol import SERVICE_NAME, Message, ProtocolMismatch
from servegate.extproc.stream import ExtProcStream
from servegate.gateway.app import Gateway, build_gateway, start_runtimes
from servegate.gateway.cluster_policy import apply_cluster_policy

log = logging.getLogger("servegate.extproc")

HEALTH_SERVICES = ("", "liveness", "readiness", SERVICE_NAME)
"""What the health port answers for; readiness and the processor turn NOT_SERVING on stop."""
GRPC_OPTIONS = (
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
)


class PickerServicer(ExternalProcessorServicer):  # type: ignore[misc]
    """`Process`: one bidirectional stream per HTTP request, answered by an `ExtProcStream`."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def Process(
        self, request_iterator: AsyncIterator[Message], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Message]:
        stream = ExtProcStream(self.gw)
        try:
            async for request in request_iterator:
                try:
                    responses = await stream.handle(request)
                except ProtocolMismatch as exc:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                for response in responses:
                    yield response
                if stream.finished:
                    return
        finally:
            stream.close()


def _metrics_app(gw: Gateway) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=gw.metrics.render(), content_type="text/plain", charset="utf-8")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def ready(_: web.Request) -> web.Response:
        count = sum(r.pool.ready_count() for r in gw.runtimes)
        body = orjson.dumps(
            {
                "ready": count > 0,
                "ready_endpoints": count,
                "endpoints": sum(len(r.pool) for r in gw.runtimes),
            }
        )
        return web.Response(
            status=200 if count else 503, body=body, content_type="application/json"
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    return app


class ExtProcServer:
    """`async with ExtProcServer(gw, settings) as server:` — `server.port`, `.health_port`, `.metrics_port`."""

    def __init__(self, gw: Gateway, settings: ExtProcSettings | None = None) -> None:
        self.gw = gw
        self.settings = settings or gw.config.extproc
        self.port = 0
        self.health_port = 0
        self.metrics_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._health_grpc: grpc.aio.Server | None = None
        self._health: Any = None
        self._metrics: web.AppRunner | None = None
        self._started = False

    async def start(self) -> None:
        gw, settings = self.gw, self.settings
        gw.transport.open()
        gw.control = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar()
        )
        # every pool, as in HTTP mode: data layer, discovery (its objectives reach
        # admission), routing tokenizers
        await start_runtimes(gw, gw.runtimes)
        self._started = True
        apply_cluster_policy(gw)

        self._grpc = grpc.aio.server(options=GRPC_OPTIONS)
        add_ExternalProcessorServicer_to_server(PickerServicer(gw), self._grpc)
        self.port = self._grpc.add_insecure_port(f"{settings.host}:{settings.port}")
        self._health = health_aio.HealthServicer()
        self._health_grpc = grpc.aio.server(options=GRPC_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_grpc)
        self.health_port = self._health_grpc.add_insecure_port(
            f"{settings.host}:{settings.health_port}"
        )
        self._metrics = web.AppRunner(_metrics_app(gw), access_log=None)
        await self._metrics.setup()
        site = web.TCPSite(self._metrics, settings.host, settings.metrics_port)
        await site.start()
        self.metrics_port = self._metrics.addresses[0][1]
        await self._grpc.start()
        await self._health_grpc.start()
        for service in HEALTH_SERVICES:
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "ext_proc picker listening",
            extra={
                "fields": {
                    "port": self.port,
                    "health_port": self.health_port,
                    "metrics_port": self.metrics_port,
                    "endpoints": [s.address for s in gw.pool],
                }
            },
        )

    async def stop(self, grace_s: float | None = None) -> None:
        gw = self.gw
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        if self._health is not None:
            for service in ("readiness", SERVICE_NAME):
                await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        turned_away = sum(r.admission.close() for r in gw.runtimes)
        if turned_away:
            log.info("shutting down: turned away %d queued requests", turned_away)
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self._health_grpc is not None:
            await self._health_grpc.stop(0)
        if self._metrics is not None:
            await self._metrics.cleanup()
        if self._started:
            self._started = False
            for runtime in gw.runtimes:
                await runtime.stop(keep_state=False)
        if gw.control is not None:
            await gw.control.close()
            gw.control = None
        await gw.transport.close()

    async def __aenter__(self) -> ExtProcServer:
        try:
            await self.start()
        except BaseException:
            await self.stop(0)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def serve_until_stopped(
    config: ServegateConfig, config_dir: Path | None = None, stop: asyncio.Event | None = None
) -> None:
    gw = build_gateway(config, config_dir)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    async with ExtProcServer(gw):
        await stop.wait()
        log.info("shutting down: draining open ext_proc streams")


def run(config: ServegateConfig, config_dir: Path | None = None) -> None:
    from servegate.gateway.server import event_loop_factory

    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve_until_stopped(config, config_dir))
