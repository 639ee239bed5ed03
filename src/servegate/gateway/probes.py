"""Health and readiness on a port of their own, served from a thread of their own.

A gateway whose request path is saturated (thousands of connections in the
accept queue, an event loop busy relaying) must still answer its liveness and
readiness probes, or the orchestrator restarts it exactly when it is busiest.
The probe server runs its own event loop in a daemon thread and only reads the
pool's counters, so nothing on the request path can delay it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import orjson
from aiohttp import web

from servegate.pool.pool import Pool

log = logging.getLogger(__name__)


def readiness(pool: Pool) -> tuple[int, int]:
    """(ready endpoints, endpoints), safe to call from another thread."""
    for _ in range(3):
        try:
            states = list(pool)
            now = time.monotonic()
            return sum(1 for s in states if pool.is_available(s, now)), len(states)
        except RuntimeError:  # the pool changed while being copied
            continue
    return 0, 0


class NoProbes:
    """No probe port configured (`gateway.probe_port: null`): the main port answers them."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


class ProbeServer:
    def __init__(self, pool: Pool, host: str, port: int) -> None:
        self.pool = pool
        self.host = host
        self.port = port
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _ready(self, request: web.Request) -> web.Response:
        ready, total = readiness(self.pool)
        body = orjson.dumps({"ready": ready > 0, "ready_endpoints": ready, "endpoints": total})
        return web.Response(
            status=200 if ready else 503, body=body, content_type="application/json"
        )

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            if self._runner is not None:
                loop.run_until_complete(self._runner.cleanup())
            loop.close()

    def start(self, timeout: float = 10.0) -> int:
        """Start the thread; returns the bound port."""
        self._thread = threading.Thread(target=self._run, name="servegate-probes", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError("the probe server did not start")
        if self._error is not None:
            raise RuntimeError(f"the probe server failed to start: {self._error}") from self._error
        log.info("probes listening", extra={"fields": {"host": self.host, "port": self.port}})
        return self.port

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and self._thread is not None and self._thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(5.0)
