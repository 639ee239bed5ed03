"""servegate's gateway as an ASGI application (a Ray Serve ingress, a BentoML service).

The host's ASGI server carries the bytes; the request path is the gateway's own, run
directly: `gateway/inference.py` drives the `Director` and the proxy, which answer
through an `AsgiSink` (`asgi_sink.py`). No loopback relay and no listening socket of its
own (not even `gateway.probe_port`: the host serves `/health` and `/ready` here).

Routes: the inference routes of the HTTP gateway (and its `POST /v1/…` catch-all),
`GET /v1/models[/{id}]`, `/health`, `/ready`, `/metrics`, `/openapi.json` and the
operator routes under `/admin/`. The status page (`/ui`) and the scale-out report are
aiohttp's alone. Errors are OpenAI's, as on the HTTP plane: an unknown route is a 404, a
known one with another method a 405, a body over `max_body_bytes` (declared, received or
decompressed) a 413, one that trickles past `body_timeout_s` a 408.

A client that leaves (`http.disconnect`) cancels its request, as aiohttp's handler
cancellation does: the replica's request is closed and the access log says 499.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import zlib
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import orjson
from multidict import CIMultiDict

from servegate.config import GatewaySettings, ServegateConfig, load_config, parse_config
from servegate.control.errors import (
    BadRequest,
    BodyTooLarge,
    GatewayError,
    InternalError,
    ModelNotFound,
    NotFound,
    RequestTimeout,
    ShuttingDown,
    clip,
    describe,
)
from servegate.control.sink import send_error
from servegate.gateway.admin import (
    check_admin_key,
    pool_state,
    pools_state,
    reload_config,
    set_draining,
)
from servegate.gateway.app import (
    INFERENCE_ROUTES,
    PASSTHROUGH_ROUTES,
    Gateway,
    build_gateway,
    public_models,
)
from servegate.gateway.inference import serve_inference
from servegate.gateway.lifecycle import RunningGateway, start_gateway
from servegate.gateway.openapi import openapi_json
from servegate.gateway.reload import FixedConfig
from servegate.gateway.transport import UpstreamTransport
from servegate.integrations.asgi_sink import (
    AnswerAborted,
    AsgiSink,
    Message,
    Receive,
    Scope,
    Send,
)
from servegate.scheduling.request import RequestKind

__all__ = ["AnswerAborted", "GatewayASGI", "Message", "Receive", "Scope", "Send"]

log = logging.getLogger("servegate.integrations")

INFERENCE_KINDS: Mapping[str, RequestKind] = {
    "/v1/chat/completions": RequestKind.CHAT,
    "/v1/completions": RequestKind.COMPLETION,
    "/v1/embeddings": RequestKind.EMBEDDING,
    "/v1/responses": RequestKind.RESPONSES,
    "/v1/messages": RequestKind.MESSAGES,
    **{path: RequestKind.OTHER for path in PASSTHROUGH_ROUTES},
}
UNDECODABLE = frozenset({"br", "zstd"})
"""Encodings aiohttp's server knows but cannot decode without an optional library (not
installed with servegate): a 400 there, a 400 here."""
DRAIN_PATH = re.compile(r"^/admin/endpoints/(?P<address>[^/]+)/(?P<action>drain|undrain)$")
JSON = [("Content-Type", "application/json")]

Handler = Callable[[Gateway, "Exchange"], Awaitable[None]]


class Exchange:
    """One HTTP request of the ASGI host: its scope, its body as it arrives, its sink."""

    __slots__ = ("body_read", "headers", "method", "path", "receive", "sink")

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers = CIMultiDict(
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", ())
        )
        client = scope.get("client")
        self.receive = receive
        self.sink = AsgiSink(send, client[0] if client else None)
        self.body_read = asyncio.Event()
        """Set once the whole body has been received: `receive` then only says disconnect."""

    async def read_body(self, settings: GatewaySettings) -> bytes:
        """The body, decoded, within `max_body_bytes` and `body_timeout_s`."""
        limit = settings.max_body_bytes
        declared = self.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(settings.body_timeout_s):
                while True:
                    message = await self.receive()
                    if message["type"] == "http.disconnect":
                        self.sink.gone = True
                        raise ConnectionResetError("the client left before its body arrived")
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError as exc:
            raise RequestTimeout(
                f"the request body did not arrive within {settings.body_timeout_s:g} s"
            ) from exc
        self.body_read.set()
        return _decoded(b"".join(chunks), self.headers.get("Content-Encoding", ""), limit)

    async def until_gone(self) -> None:
        """Returns when the client has left (after its body: `receive` is the host's own)."""
        await self.body_read.wait()
        while (await self.receive())["type"] != "http.disconnect":
            pass
        if self.sink.ended:
            # A host says disconnect once the answer is complete (uvicorn): the request
            # path is only finishing its accounting, which must not be cancelled.
            await asyncio.get_running_loop().create_future()
        self.sink.gone = True

    async def json(self, data: Any, status: int = 200) -> None:
        await self.sink.respond(status, JSON, orjson.dumps(data))


def _decoded(body: bytes, encoding: str, limit: int) -> bytes:
    """The body without its `Content-Encoding`, decoded as aiohttp's server decodes one
    (gzip; deflate with or without its zlib header; any encoding it does not know is
    left as it is), never inflated past `limit` bytes."""
    name = encoding.strip().lower()
    if name in UNDECODABLE:
        raise BadRequest(f"the request body cannot be decoded: Content-Encoding {name}")
    if name == "gzip":
        bits = 16 + zlib.MAX_WBITS
    elif name == "deflate":
        zlib_header = bool(body) and body[0] & 0x0F == 8
        bits = zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS
    else:
        return body
    inflater = zlib.decompressobj(bits)
    try:
        out = inflater.decompress(body, limit + 1)
        if len(out) > limit or inflater.unconsumed_tail:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
        out += inflater.flush()
    except zlib.error as exc:
        raise BadRequest(f"the request body cannot be decoded: {describe(exc)}") from exc
    if not inflater.eof:
        raise BadRequest("the request body cannot be decoded: it ends before its stream does")
    if len(out) > limit:
        raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
    return out


async def until_done_or_gone(work: Awaitable[object], gone: Awaitable[object]) -> None:
    """Run `work` until it ends or `gone` (the client left) does, whichever is first; the
    other is cancelled and awaited. An ASGI host, unlike aiohttp, does not cancel the
    handler of a client that leaves, so the request watches for it itself."""
    tasks = (asyncio.ensure_future(work), asyncio.ensure_future(gone))
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


class GatewayASGI:
    """An ASGI app that starts the gateway at lifespan startup (or on its first request)."""

    def __init__(
        self,
        config: ServegateConfig,
        config_dir: Path | None = None,
        transport: UpstreamTransport | None = None,
    ) -> None:
        self.config = config
        self.config_dir = config_dir
        self._transport = transport
        self._lock: asyncio.Lock | None = None
        self._running: RunningGateway | None = None
        self._get: dict[str, Handler] = {
            "/v1/models": _list_models,
            "/health": _health,
            "/ready": _ready,
            "/metrics": _metrics,
            "/openapi.json": _openapi,
            "/admin/pool": _admin_pool,
            "/admin/pools": _admin_pools,
        }
        self._post: dict[str, Handler] = {"/admin/reload": _admin_reload}

    @classmethod
    def from_mapping(cls, document: Mapping[str, Any], source: str = "<mapping>") -> GatewayASGI:
        """From a config document (as YAML would decode); raises `ConfigError`."""
        return cls(parse_config("", source, overrides=dict(document)))

    @classmethod
    def from_file(cls, path: str | Path) -> GatewayASGI:
        return cls(load_config(path), Path(path).parent)

    @property
    def gateway(self) -> Gateway | None:
        """The running gateway; None before `start` and after `stop`."""
        return self._running.gateway if self._running is not None else None

    async def start(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._running is not None:
                return
            gw = build_gateway(self.config, self.config_dir, transport=self._transport)
            self._running = await start_gateway(gw)  # no probe port in a host's process

    async def stop(self) -> None:
        running, self._running = self._running, None
        if running is None:
            return
        gw = running.gateway
        turned_away = sum(r.admission.close() for r in gw.runtimes)
        if turned_away:
            log.info("shutting down: turned away %d queued requests", turned_away)
        await running.stop()
        gw.access_log.flush()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "http":
            await self.start()
            await self._http(Exchange(scope, receive, send))
        else:
            await send({"type": "websocket.close", "code": 1003})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, exchange: Exchange) -> None:
        running = self._running
        if running is None:
            await send_error(exchange.sink, ShuttingDown("the gateway is shutting down"))
            return
        gw = running.gateway
        method, path = exchange.method, exchange.path
        kind = INFERENCE_KINDS.get(path)
        if kind is None and path.startswith("/v1/") and method == "POST":
            kind = RequestKind.OTHER  # the catch-all, as on the HTTP gateway
        if kind is not None and method == "POST":
            await self._inference(gw, exchange, kind)
        else:
            await self._other(gw, exchange)
        if exchange.sink.aborted:
            raise AnswerAborted(f"the answer to {method} {clip(path)} was cut off")

    async def _inference(self, gw: Gateway, exchange: Exchange, kind: RequestKind) -> None:
        """The request path, cancelled when the client leaves (after its body)."""
        work = asyncio.ensure_future(
            serve_inference(
                gw.director,
                exchange.sink,
                kind,
                exchange.method,
                exchange.path,
                exchange.headers,
                exchange.read_body,
            )
        )
        await until_done_or_gone(work, exchange.until_gone())

    async def _other(self, gw: Gateway, exchange: Exchange) -> None:
        method, path = exchange.method, exchange.path
        try:
            handler = self._handler(method, path)
            await handler(gw, exchange)
        except GatewayError as exc:
            await send_error(exchange.sink, exc)
        except Exception as exc:
            if exchange.sink.started:
                raise
            log.exception("unexpected error on %s %s", method, clip(path))
            await send_error(exchange.sink, InternalError(f"the gateway failed: {describe(exc)}"))

    def _handler(self, method: str, path: str) -> Handler:
        """The route's handler; raises the HTTP gateway's 404 or 405."""
        table = self._get if method in ("GET", "HEAD") else self._post
        handler = table.get(path)
        if handler is not None:
            return handler
        if method in ("GET", "HEAD") and path.startswith("/v1/models/"):
            return _get_model
        match = DRAIN_PATH.match(path)
        if match is not None and method == "POST":
            return _admin_drain if match["action"] == "drain" else _admin_undrain
        known = (
            path in self._get
            or path in self._post
            or path in INFERENCE_ROUTES
            or match is not None
            or path.startswith("/v1/models/")
        )
        if not known or (path.startswith("/v1/") and path not in INFERENCE_ROUTES):
            raise NotFound(f"no route for {clip(method)} {clip(path)}")
        exc = BadRequest(f"method {clip(method)} is not allowed on {clip(path)}")
        exc.status = 405
        raise exc


async def _list_models(gw: Gateway, exchange: Exchange) -> None:
    gw.tenants.authenticate(exchange.headers.get("Authorization", ""))
    await exchange.json({"object": "list", "data": public_models(gw)})


async def _get_model(gw: Gateway, exchange: Exchange) -> None:
    gw.tenants.authenticate(exchange.headers.get("Authorization", ""))
    wanted = exchange.path.removeprefix("/v1/models/")
    for entry in public_models(gw):
        if entry["id"] == wanted:
            await exchange.json(entry)
            return
    raise ModelNotFound(f"The model `{clip(wanted)}` does not exist.")


async def _health(gw: Gateway, exchange: Exchange) -> None:
    await exchange.sink.respond(200, [("Content-Type", "text/plain; charset=utf-8")], b"ok")


async def _ready(gw: Gateway, exchange: Exchange) -> None:
    runtimes = gw.runtimes
    count = sum(r.pool.ready_count() for r in runtimes)
    total = sum(len(r.pool) for r in runtimes)
    body = {"ready": count > 0, "ready_endpoints": count, "endpoints": total}
    await exchange.json(body, 200 if count else 503)


async def _metrics(gw: Gateway, exchange: Exchange) -> None:
    headers = [("Content-Type", "text/plain; charset=utf-8")]
    await exchange.sink.respond(200, headers, gw.metrics.render())


async def _openapi(gw: Gateway, exchange: Exchange) -> None:
    await exchange.sink.respond(200, JSON, openapi_json())


def _admin(gw: Gateway, exchange: Exchange) -> None:
    check_admin_key(gw.config.gateway.admin_keys, exchange.headers.get("Authorization", ""))


async def _admin_pool(gw: Gateway, exchange: Exchange) -> None:
    _admin(gw, exchange)
    await exchange.json(pool_state(gw))


async def _admin_pools(gw: Gateway, exchange: Exchange) -> None:
    _admin(gw, exchange)
    await exchange.json(pools_state(gw))


async def _admin_reload(gw: Gateway, exchange: Exchange) -> None:
    _admin(gw, exchange)
    status, body = await reload_config(FixedConfig(gw))  # its config is the host's code's
    await exchange.json(body, status)


async def _admin_drain(gw: Gateway, exchange: Exchange) -> None:
    await _drain(gw, exchange, True)


async def _admin_undrain(gw: Gateway, exchange: Exchange) -> None:
    await _drain(gw, exchange, False)


async def _drain(gw: Gateway, exchange: Exchange, draining: bool) -> None:
    _admin(gw, exchange)
    match = DRAIN_PATH.match(exchange.path)
    if match is None:
        raise NotFound(f"no route for POST {clip(exchange.path)}")
    await exchange.json(set_draining(gw, match["address"], draining))
