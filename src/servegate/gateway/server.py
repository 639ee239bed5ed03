"""Running the gateway: uvloop, one listening socket, graceful shutdown on SIGTERM/SIGINT,
and reloading the config file on SIGHUP (or when it changes, with `reload.watch`).

On SIGTERM the listening socket closes first (new connections are refused),
requests still waiting in flow control are turned away with 503, and requests
in flight (streams included) get up to `gateway.drain_timeout_s` to finish
before they are cancelled; then the background tasks stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web

from servegate.config import GatewaySettings, ServegateConfig
from servegate.gateway.app import build_gateway, create_app
from servegate.gateway.connections import CONNECTIONS, GuardedSite
from servegate.gateway.reload import RELOADER, ConfigSource

log = logging.getLogger("servegate.server")

GC_YOUNG_THRESHOLD = 10_000


def server_options(settings: GatewaySettings) -> dict[str, Any]:
    """aiohttp's request-parser limits (request line, header field size and header count)
    and its keep-alive timeout (which also closes a connection that never sends a request)."""
    return {
        "max_line_size": settings.max_line_bytes,
        "max_field_size": settings.max_header_bytes,
        "max_headers": settings.max_headers,
        "keepalive_timeout": settings.idle_timeout_s,
    }


@contextlib.contextmanager
def settled_heap() -> Iterator[None]:
    """While serving, the start-up heap (modules, config, plugins) is frozen out of the
    cyclic collector and the young generation is larger: per-request garbage is freed by
    reference counting, and the collections it used to trigger re-walked long-lived
    objects (~10% of the gateway's CPU per request, docs/benchmarks.md)."""
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.new_event_loop
    return uvloop.new_event_loop


async def serve_until_stopped(
    config: ServegateConfig,
    config_dir: Path | None = None,
    stop: asyncio.Event | None = None,
    drain_timeout_s: float | None = None,
    on_started: Callable[[int], None] | None = None,
    source: ConfigSource | None = None,
    reuse_port: bool = False,
) -> None:
    """`source`: where to re-read the config from on SIGHUP; None = no reloading.

    `reuse_port`: several worker processes listen on the same port (SO_REUSEPORT).
    """
    gw = build_gateway(config, config_dir)
    app = create_app(gw, source)
    drain = config.gateway.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=drain,
        **server_options(config.gateway),
    )
    await runner.setup()
    site = GuardedSite(
        runner,
        app[CONNECTIONS],
        host=config.gateway.host,
        port=config.gateway.port,
        backlog=4096,
        reuse_address=True,
        reuse_port=reuse_port or None,
    )
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else config.gateway.port
    log.info("listening", extra={"fields": {"host": config.gateway.host, "port": port}})
    if on_started is not None:
        on_started(port)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    if source is not None:
        reloader = app[RELOADER]
        try:
            loop.add_signal_handler(signal.SIGHUP, reloader.signal)
        except (NotImplementedError, RuntimeError, AttributeError):
            pass
        if config.reload.watch:
            reloader.watch(config.reload.interval_s)
    try:
        with settled_heap():
            await stop.wait()
    finally:
        log.info("shutting down: draining in-flight requests")
        await runner.cleanup()


def run(
    config: ServegateConfig, config_dir: Path | None = None, source: ConfigSource | None = None
) -> None:
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve_until_stopped(config, config_dir, source=source))
