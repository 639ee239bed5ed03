"""A lean pooled HTTP/1.1 client on asyncio (uvloop) protocols with httptools' parser.

A benchmark subject, not gateway code: it speaks just enough HTTP/1.1 to relay
OpenAI requests to replicas on loopback (keep-alive, Content-Length or chunked
answers, no redirects, no TLS, no proxy, no timeouts, no back-pressure). Two ways
to use one request:

- callbacks (`LeanPool.send`): the parser's callbacks call `on_head`, `on_body`,
  `on_done` directly from `data_received` — no task, no future, no queue per request;
- awaitable (`LeanPool.request`): a `LeanResponse` with `await read()` or
  `async for chunk in chunks()`, for servers whose handlers are coroutines.

The request's header block is built once per upstream (`Host`, `Content-Type`) and
only `Content-Length` is formatted per request.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import cast

import httptools

Head = Callable[[int, list[tuple[bytes, bytes]]], None]
Body = Callable[[bytes], None]
Done = Callable[[BaseException | None], None]


def nodelay(transport: asyncio.BaseTransport) -> None:
    """Small writes (one SSE event each) go out at once: no Nagle wait for the peer's ACK."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class LeanResponse:
    """One answer, filled by the connection's parser callbacks."""

    __slots__ = ("_chunks", "_error", "_finished", "_head", "_waiter", "headers", "status")

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []
        self._finished = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head: asyncio.Future[None] | None = None

    # -- fed by the connection ---------------------------------------------------
    def on_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.headers = headers
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._wake()

    def on_done(self, error: BaseException | None) -> None:
        self._finished = True
        self._error = error
        if error is not None and self._head is not None and not self._head.done():
            self._head.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the relay -------------------------------------------------------
    async def wait_head(self) -> None:
        if self.status or self._finished:
            if self._error is not None:
                raise self._error
            return
        self._head = asyncio.get_running_loop().create_future()
        await self._head

    async def read(self) -> bytes:
        while not self._finished:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self._error is not None:
            raise self._error
        return b"".join(self._chunks)

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            if self._chunks:
                ready, self._chunks = self._chunks, []
                yield ready[0] if len(ready) == 1 else b"".join(ready)
                continue
            if self._finished:
                if self._error is not None:
                    raise self._error
                return
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter


class _Connection(asyncio.Protocol):
    __slots__ = ("_body", "_done", "_fields", "_head", "_idle", "_name", "parser", "transport")

    def __init__(self, idle: list[_Connection]) -> None:
        self._idle = idle
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self._fields: list[tuple[bytes, bytes]] = []
        self._head: Head | None = None
        self._body: Body | None = None
        self._done: Done | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        nodelay(transport)

    def start(self, request: list[bytes], head: Head, body: Body, done: Done) -> None:
        self._fields = []
        self._head, self._body, self._done = head, body, done
        assert self.transport is not None
        self.transport.writelines(request)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        if self._head is not None:
            self._head(self.parser.get_status_code(), self._fields)

    def on_body(self, body: bytes) -> None:
        if self._body is not None:
            self._body(body)

    def on_message_complete(self) -> None:
        done, self._done = self._done, None
        self._head = self._body = None
        if self.parser.should_keep_alive():
            self._idle.append(self)
        elif self.transport is not None:
            self.transport.close()
        if done is not None:
            done(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self._idle:
            self._idle.remove(self)
        self._fail(exc or ConnectionResetError("upstream closed the connection"))

    def _fail(self, exc: BaseException) -> None:
        done, self._done = self._done, None
        self._head = self._body = None
        if self.transport is not None:
            self.transport.close()
        if done is not None:
            done(exc)


class _Upstream:
    __slots__ = ("host", "idle", "port", "prefix")

    def __init__(self, url: str) -> None:
        hostport = url.removeprefix("http://").rstrip("/")
        host, _, port = hostport.partition(":")
        self.host = host
        self.port = int(port or 80)
        self.idle: list[_Connection] = []
        self.prefix = (
            b"\r\nHost: " + hostport.encode() + b"\r\nContent-Type: application/json"
            b"\r\nContent-Length: "
        )


class LeanPool:
    """Keep-alive connections per upstream URL (`http://host:port`)."""

    def __init__(self, urls: list[str]) -> None:
        self._upstreams = {url: _Upstream(url) for url in urls}

    def _request(self, upstream: _Upstream, path: bytes, body: bytes) -> list[bytes]:
        head = b"POST " + path + b" HTTP/1.1" + upstream.prefix
        return [head + str(len(body)).encode() + b"\r\n\r\n", body]

    def send(
        self, url: str, path: bytes, body: bytes, head: Head, on_body: Body, done: Done
    ) -> None:
        """Starts one POST; callbacks only. Connects (one task) when no idle connection."""
        upstream = self._upstreams[url]
        request = self._request(upstream, path, body)
        if upstream.idle:
            upstream.idle.pop().start(request, head, on_body, done)
            return
        asyncio.get_running_loop().create_task(
            self._connect_and_start(upstream, request, head, on_body, done)
        )

    async def _connect_and_start(
        self, upstream: _Upstream, request: list[bytes], head: Head, on_body: Body, done: Done
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(
                lambda: _Connection(upstream.idle), upstream.host, upstream.port
            )
        except OSError as exc:
            done(exc)
            return
        conn.start(request, head, on_body, done)

    async def request(self, url: str, path: bytes, body: bytes) -> LeanResponse:
        """Starts one POST and waits for the answer's status line and headers."""
        response = LeanResponse()
        self.send(url, path, body, response.on_head, response.on_body, response.on_done)
        await response.wait_head()
        return response

    def close(self) -> None:
        for upstream in self._upstreams.values():
            for conn in upstream.idle:
                if conn.transport is not None:
                    conn.transport.close()
            upstream.idle.clear()
