"""A scriptable model-server stand-in for the hostile-input suite: real HTTP on 127.0.0.1.

Every inference request is recorded (headers and raw body); `answer` decides the reply,
so a test can play a misbehaving replica (redirects, huge bodies, plain-text errors…).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from servegate.testing.gateway import GatewayRunner

MODEL = "m"
METRICS = "".join(
    f'vllm:{name}{{engine="0",model_name="{MODEL}"}} 0.0\n'
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
)
Answer = Callable[[web.Request, bytes], Awaitable[web.StreamResponse]]


@dataclass
class Call:
    path: str
    headers: dict[str, str]
    raw: bytes

    @property
    def body(self) -> Any:
        return orjson.loads(self.raw)


async def json_answer(request: web.Request, raw: bytes) -> web.StreamResponse:
    body = orjson.loads(raw)
    if body.get("stream"):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text in ("a", "b"):
            chunk = {"choices": [{"index": 0, "text": text}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response
    kv = body.get("kv_transfer_params") or {}
    params = None
    if kv.get("do_remote_decode"):
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1}
    return web.json_response(
        {"choices": [{"index": 0, "text": "ab"}], "kv_transfer_params": params}
    )


@dataclass
class Replica:
    answer: Answer = json_answer
    calls: list[Call] = field(default_factory=list)
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> Replica:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v2/health/ready", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        # the gateway's zero-config tokenizer asks here; this stand-in has no tokenizer
        app.router.add_post("/tokenize", self._no_route)
        app.router.add_route("*", "/{tail:.*}", self._inference)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _no_route(self, request: web.Request) -> web.Response:
        return web.json_response({"detail": "Not Found"}, status=404)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.calls.append(
            Call(request.path, {k.lower(): v for k, v in request.headers.items()}, raw)
        )
        return await self.answer(request, raw)


def gateway_config(
    urls: list[str],
    picker: dict[str, Any] | None = None,
    endpoints: list[dict[str, Any]] | None = None,
    top: dict[str, Any] | None = None,
    **gateway: Any,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "gateway": {"seed": 1, "port": 0, **gateway},
        "outlier_detection": {"enabled": False},
        "pool": {
            "scrape_interval_s": 0.05,
            "health": {"interval_s": 0.1, "timeout_s": 0.5},
            "endpoints": endpoints if endpoints is not None else [{"url": u} for u in urls],
        },
        **(top or {}),
    }
    if picker is not None:
        cfg["picker"] = picker
    return cfg


async def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def ready(gw: GatewayRunner, n: int) -> None:
    pool = gw.gateway.pool
    await wait_until(
        lambda: pool.ready_count() == n and pool.resolve_model(MODEL) is not None, "ready pool"
    )
