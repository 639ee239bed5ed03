"""A model-server stand-in for data-layer tests: real HTTP on 127.0.0.1, a free port.

It serves a metrics page on every engine's metrics path, answers health probes
with a configurable status, lists models like vLLM's `/v1/models`, and can be
slowed down, stopped and restarted on the same port.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import orjson
from aiohttp import web

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "metrics"


def fixture_page(name: str) -> str:
    return (FIXTURES / f"{name}.txt").read_text()


class FakeReplica:
    def __init__(self, page: str = "", models: list[dict[str, object]] | None = None) -> None:
        self.page = page
        self.metrics_status = 200
        self.health_status = 200
        self.models_body: bytes = orjson.dumps(
            {"object": "list", "data": models if models is not None else []}
        )
        self.delay = 0.0
        self.requests: Counter[str] = Counter()
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_models(self, models: list[dict[str, object]]) -> None:
        self.models_body = orjson.dumps({"object": "list", "data": models})

    async def start(self) -> FakeReplica:
        app = web.Application()
        for path in ("/metrics", "/prometheus/metrics"):
            app.router.add_get(path, self._metrics)
        for path in ("/health", "/v2/health/ready"):
            app.router.add_get(path, self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _pause(self, path: str) -> None:
        self.requests[path] += 1
        if self.delay:
            await asyncio.sleep(self.delay)

    async def _metrics(self, request: web.Request) -> web.Response:
        await self._pause(request.path)
        return web.Response(status=self.metrics_status, text=self.page, content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        await self._pause(request.path)
        return web.Response(status=self.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        await self._pause(request.path)
        return web.Response(body=self.models_body, content_type="application/json")


async def wait_until(predicate: Callable[[], bool], within: float = 3.0) -> None:
    """Poll `predicate()` every 10 ms; fail the test if it stays false for `within` s."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"condition not met within {within} s")
        await asyncio.sleep(0.01)
