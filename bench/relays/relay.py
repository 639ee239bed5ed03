"""Bare OpenAI relays on uvloop + orjson: the floor a Python data plane can reach.

Each parses the request body once (orjson), picks the next upstream round-robin and
relays the answer (whole, or chunk by chunk when `"stream": true`). No routing, no
logging, no metrics, no timeouts. Servers and clients:

    --server aiohttp --client aiohttp   aiohttp web handler, pooled aiohttp ClientSession
    --server aiohttp --client lean      aiohttp web handler, lean.LeanPool (httptools)
    --server raw     --client lean      an httptools server protocol driving LeanPool by
                                        callbacks: no task, future or queue per request

    python bench/relays/relay.py --port 9000 --server raw --client lean \\
        --upstream http://127.0.0.1:8101 --upstream http://127.0.0.1:8102

granian (RSGI) is in granian_relay.py. The first stdout line is `listening on URL`.
"""

from __future__ import annotations

import argparse
import asyncio
import http
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from typing import cast

import orjson
import uvloop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lean import LeanPool, nodelay

JSON = "application/json"


def _stream_requested(body: bytes) -> bool:
    payload = orjson.loads(body)
    return isinstance(payload, dict) and bool(payload.get("stream"))


# -- aiohttp server ----------------------------------------------------------------------


def aiohttp_app(upstreams: list[str], client: str) -> object:
    from aiohttp import ClientSession, TCPConnector, web

    order: Iterator[str] = itertools.cycle(upstreams)
    state: dict[str, object] = {}

    async def on_startup(app: web.Application) -> None:
        if client == "aiohttp":
            state["session"] = ClientSession(connector=TCPConnector(limit=0))
        else:
            state["pool"] = LeanPool(upstreams)

    async def on_cleanup(app: web.Application) -> None:
        session = state.get("session")
        if isinstance(session, ClientSession):
            await session.close()

    async def via_aiohttp(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        stream = _stream_requested(body)
        session = state["session"]
        assert isinstance(session, ClientSession)
        url = next(order) + request.path
        async with session.post(url, data=body, headers={"Content-Type": JSON}) as upstream:
            if not stream:
                return web.Response(
                    status=upstream.status, body=await upstream.read(), content_type=JSON
                )
            out = web.StreamResponse(
                status=upstream.status, headers={"Content-Type": "text/event-stream"}
            )
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def via_lean(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        stream = _stream_requested(body)
        pool = state["pool"]
        assert isinstance(pool, LeanPool)
        upstream = await pool.request(next(order), request.path.encode(), body)
        if not stream:
            return web.Response(
                status=upstream.status, body=await upstream.read(), content_type=JSON
            )
        out = web.StreamResponse(
            status=upstream.status, headers={"Content-Type": "text/event-stream"}
        )
        await out.prepare(request)
        async for chunk in upstream.chunks():
            await out.write(chunk)
        await out.write_eof()
        return out

    app = web.Application()
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/{tail:.*}", via_aiohttp if client == "aiohttp" else via_lean)
    return app


# -- raw server: httptools request parser + LeanPool callbacks --------------------------------

_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}


def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %b\r\n" % (status, _REASONS.get(status, b"Unknown"))


class RawRelay(asyncio.Protocol):
    """One client connection; requests are answered in order (no pipelining)."""

    def __init__(self, pool: LeanPool, pick: Callable[[], str]) -> None:
        import httptools

        self._pool = pool
        self._pick = pick
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []
        self._stream = False
        self._keep_alive = True
        self._answer: list[bytes] = []
        self._status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        nodelay(transport)

    def data_received(self, data: bytes) -> None:
        import httptools

        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                self._transport.close()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self._body)
        path, self._url, self._body = self._url, b"", []
        self._keep_alive = self._parser.should_keep_alive()
        try:
            self._stream = _stream_requested(body)
        except orjson.JSONDecodeError:
            self._finish(400, b'{"error":{"message":"bad JSON"}}')
            return
        self._pool.send(self._pick(), path, body, self._on_head, self._on_body, self._on_done)

    # -- upstream callbacks --
    def _on_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._status = status
        if self._stream and self._transport is not None:
            self._transport.write(
                _status_line(status)
                + b"Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )

    def _on_body(self, chunk: bytes) -> None:
        if not self._stream:
            self._answer.append(chunk)
        elif self._transport is not None:
            self._transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))

    def _on_done(self, error: BaseException | None) -> None:
        if error is not None:
            if self._transport is not None:
                self._transport.close()
            return
        if self._stream:
            if self._transport is not None:
                self._transport.write(b"0\r\n\r\n")
                if not self._keep_alive:
                    self._transport.close()
            return
        body, self._answer = b"".join(self._answer), []
        self._finish(self._status, body)

    def _finish(self, status: int, body: bytes) -> None:
        if self._transport is None:
            return
        self._transport.write(
            _status_line(status)
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body
        )
        if not self._keep_alive:
            self._transport.close()


async def serve_raw(upstreams: list[str], host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    pool = LeanPool(upstreams)
    order = itertools.cycle(upstreams)
    pick = order.__next__
    server = await loop.create_server(lambda: RawRelay(pool, pick), host, port, backlog=1024)
    bound = server.sockets[0].getsockname()[1]
    print(f"listening on http://{host}:{bound}", flush=True)
    async with server:
        await server.serve_forever()


async def serve_aiohttp(upstreams: list[str], client: str, host: str, port: int) -> None:
    from aiohttp import web

    app = aiohttp_app(upstreams, client)
    assert isinstance(app, web.Application)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    print(f"listening on http://{host}:{runner.addresses[0][1]}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--server", choices=["aiohttp", "raw"], default="aiohttp")
    parser.add_argument("--client", choices=["aiohttp", "lean"], default="aiohttp")
    parser.add_argument("--upstream", action="append", required=True)
    args = parser.parse_args()
    if args.server == "raw" and args.client != "lean":
        parser.error("--server raw drives the lean client only")
    coroutine = (
        serve_raw(args.upstream, args.host, args.port)
        if args.server == "raw"
        else serve_aiohttp(args.upstream, args.client, args.host, args.port)
    )
    uvloop.run(coroutine)


if __name__ == "__main__":
    main()
