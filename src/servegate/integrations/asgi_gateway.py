"""servegate's gateway inside an ASGI host (a Ray Serve ingress, a BentoML service).

The gateway is an aiohttp application, and aiohttp does not speak ASGI. Rather
than re-implement the request path on top of the host's framework, the host's
ASGI layer relays each request to the real gateway running in the same process
and event loop on a loopback port: one extra loopback hop per request, in
exchange for the exact gateway (streaming, retries, errors, metrics) the
standalone server runs. Bodies stream both ways chunk by chunk; a client that
leaves mid-stream closes the relayed request, so the gateway stops the engine's
work as it does for a direct client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from aiohttp import web

from servegate.config import ServegateConfig, load_config, parse_config
from servegate.gateway.app import build_gateway, create_app
from servegate.gateway.server import server_options

log = logging.getLogger("servegate.integrations")

Message = MutableMapping[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"host",
    }
)


class _ClientGone(Exception):
    pass


def _error_body(status: int, message: str) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "code": status}})


class GatewayASGI:
    """An ASGI app that runs the gateway on its first request (or at lifespan startup)."""

    def __init__(self, config: ServegateConfig, config_dir: Path | None = None) -> None:
        gateway = config.gateway.model_copy(update={"host": "127.0.0.1", "port": 0})
        self.config = config.model_copy(update={"gateway": gateway})
        self.config_dir = config_dir
        self._lock: asyncio.Lock | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._base: str | None = None

    @classmethod
    def from_mapping(cls, document: Mapping[str, Any], source: str = "<mapping>") -> GatewayASGI:
        """From a config document (as YAML would decode); raises `ConfigError`."""
        return cls(parse_config("", source, overrides=dict(document)))

    @classmethod
    def from_file(cls, path: str | Path) -> GatewayASGI:
        return cls(load_config(path), Path(path).parent)

    @property
    def url(self) -> str | None:
        """The in-process gateway's loopback URL once started."""
        return self._base

    async def start(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._runner is not None:
                return
            gw = build_gateway(self.config, self.config_dir)
            settings = self.config.gateway
            runner = web.AppRunner(
                create_app(gw),
                handler_cancellation=True,
                access_log=None,
                shutdown_timeout=settings.drain_timeout_s,
                **server_options(settings),
            )
            await runner.setup()
            try:
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
            except BaseException:
                await runner.cleanup()
                raise
            port = runner.addresses[0][1]
            self._base = f"http://127.0.0.1:{port}"
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s),
            )
            self._runner = runner
            log.info("gateway started in-process", extra={"fields": {"url": self._base}})

    async def stop(self) -> None:
        runner, session = self._runner, self._session
        self._runner = self._session = None
        self._base = None
        if session is not None:
            await session.close()
        if runner is not None:
            await runner.cleanup()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "http":
            await self.start()
            await self._relay(scope, receive, send)
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

    async def _relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        session, base = self._session, self._base
        if session is None or base is None:
            await _answer(send, 503, "the gateway is shutting down")
            return
        raw_path = scope.get("raw_path")
        path = raw_path.decode("latin-1") if raw_path else quote(scope["path"])
        query = scope.get("query_string", b"")
        url = base + path + (f"?{query.decode('latin-1')}" if query else "")
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope.get("headers", ())
            if k.lower() not in _HOP_BY_HOP
        ]

        async def body() -> AsyncIterator[bytes]:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _ClientGone
                chunk = message.get("body", b"")
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    return

        try:
            async with session.request(
                scope["method"], url, headers=headers, data=body(), allow_redirects=False
            ) as upstream:
                await send(
                    {
                        "type": "http.response.start",
                        "status": upstream.status,
                        "headers": [
                            (k.lower(), v)
                            for k, v in upstream.raw_headers
                            if k.lower() not in _HOP_BY_HOP
                        ],
                    }
                )
                if not await _stream_until_gone(upstream, receive, send):
                    upstream.close()
        except _ClientGone:
            return
        except aiohttp.ClientError as exc:
            log.warning("relay to the in-process gateway failed: %s", exc)
            with contextlib.suppress(Exception):
                await _answer(send, 502, "the in-process gateway did not answer")


async def _stream_until_gone(
    upstream: aiohttp.ClientResponse, receive: Receive, send: Send
) -> bool:
    """True when the whole body was relayed, False when the client left first."""

    async def relay() -> None:
        async for chunk in upstream.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    streaming = asyncio.ensure_future(relay())
    watching = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((streaming, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (streaming, watching):
            task.cancel()
        for task in (streaming, watching):
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return streaming.done() and not streaming.cancelled()


async def _answer(send: Send, status: int, message: str) -> None:
    body = _error_body(status, message)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
