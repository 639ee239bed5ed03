"""`LeanProtocol`: the inference routes served on a plain asyncio protocol with httptools'
(llhttp) request parser, in front of aiohttp's server (`gateway.http_server: lean`).

Why: with the upstream client lean, aiohttp's server (request object, `StreamResponse`,
middlewares, its per-connection handler task) is the largest piece of the HTTP plane left
(docs/dataplane.md, item 2). This protocol parses each request head itself; a POST to an
inference route runs `serve_inference` in one task and answers through `LeanSink`, which
writes the status line, headers and body straight to the transport.

Everything else stays aiohttp's: when a head is not an inference route, the connection is
handed over — aiohttp's request handler is made for the transport, takes the guard's
place behind `_Guarded` (connections.py), and is fed the bytes from the start of that
request. Clients use separate connections for `/metrics`, `/admin` and `/ui`, so this is
rare. A request the lean path cannot hand over exactly (one pipelined behind another in
the same read) is refused with a 400 and the connection closed.

Limits are aiohttp's, from the same settings: request line and header field sizes, header
count, body size (413, also for a chunked body that grows past it), the body's arrival
time (408, connection closed), the keep-alive idle timeout; `Expect: 100-continue` is
answered before the body is read. A client that leaves cancels its request's task, which
the request path accounts as 499.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Protocol, cast

import httptools
from multidict import CIMultiDict

from servegate.config import GatewaySettings
from servegate.control.director import Director
from servegate.control.errors import (
    BadRequest,
    BodyTooLarge,
    GatewayError,
    RequestTimeout,
    error_answer,
    error_headers,
)
from servegate.control.sink import Headers
from servegate.gateway.connections import ConnectionGuard, _Guarded
from servegate.gateway.inference import serve_inference
from servegate.scheduling.request import RequestKind

LEAN_ROUTES: dict[bytes, RequestKind] = {
    b"/v1/chat/completions": RequestKind.CHAT,
    b"/v1/completions": RequestKind.COMPLETION,
    b"/v1/embeddings": RequestKind.EMBEDDING,
    b"/v1/responses": RequestKind.RESPONSES,
    b"/v1/messages": RequestKind.MESSAGES,
}
"""The routes served here (POST only); every other request goes to aiohttp."""
OWN_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
"""Framing headers the sink writes itself; a caller's copies are not sent."""
_REASONS = {s.value: s.phrase for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _Clock:
    """The `Date` header, formatted once a second rather than per answer."""

    __slots__ = ("_line", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._line = b""

    def date_line(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._line


_CLOCK = _Clock()


def _head(status: int, headers: Headers, framing: bytes) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
    for name, value in headers:
        if name.lower() not in OWN_HEADERS:
            lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode("latin-1") + _CLOCK.date_line() + framing


class SinkConnection(Protocol):
    """What `LeanSink` uses of its `LeanProtocol`: a protocol, not the class, so that a
    test can stand in for the connection where mypyc checks argument types."""

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport | None
    peer: str
    paused_writing: bool

    def connection_line(self) -> bytes: ...
    def close_if_idle(self) -> None: ...
    def send(self, *parts: bytes) -> None: ...
    async def drain(self) -> None: ...
    def abort(self) -> None: ...


class LeanSink:
    """The `ClientSink` of `LeanProtocol`: the answer written straight to the transport.

    A started answer's head waits for the first body bytes written in the same loop turn,
    so that a stream whose first event is already here costs one `writev`, not two; a
    callback sends the head alone if nothing follows in that turn."""

    __slots__ = ("_chunked", "_conn", "_head", "_started")

    def __init__(self, conn: SinkConnection) -> None:
        self._conn = conn
        self._started = False
        self._chunked = False
        self._head = b""

    @property
    def started(self) -> bool:
        return self._started

    @property
    def remote(self) -> str | None:
        return self._conn.peer or None

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        conn = self._conn
        self._started = True
        framing = b"Content-Length: %d\r\n%s\r\n" % (len(body), conn.connection_line())
        conn.send(_head(status, headers, framing), body)
        if conn.paused_writing:
            await conn.drain()

    async def start(self, status: int, headers: Headers, content_length: int | None) -> None:
        conn = self._conn
        self._started = True
        if content_length is None:
            self._chunked = True
            framing = b"Transfer-Encoding: chunked\r\n%s\r\n" % conn.connection_line()
        else:
            framing = b"Content-Length: %d\r\n%s\r\n" % (content_length, conn.connection_line())
        if conn.transport is None or conn.transport.is_closing():
            raise ConnectionResetError("the client left")
        self._head = _head(status, headers, framing)
        conn.loop.call_soon(self._send_head)

    def _send_head(self) -> None:
        """Nothing followed the head in its loop turn: it goes alone (a client waiting
        for a slow first event sees the status at once, as before)."""
        head, self._head = self._head, b""
        if head:
            conn = self._conn
            if conn.transport is not None and not conn.transport.is_closing():
                conn.send(head)

    async def write(self, data: bytes) -> None:
        if not data:
            return
        conn = self._conn
        head, self._head = self._head, b""
        if self._chunked:
            conn.send(head, b"%x\r\n" % len(data), data, b"\r\n")
        else:
            conn.send(head, data)
        if conn.paused_writing:
            await conn.drain()

    async def end(self, last: bytes) -> None:
        conn = self._conn
        head, self._head = self._head, b""
        if self._chunked:
            if last:
                conn.send(head, b"%x\r\n" % len(last), last, b"\r\n0\r\n\r\n")
            else:
                conn.send(head, b"0\r\n\r\n")
        elif last or head:
            conn.send(head, last)
        if conn.paused_writing:
            await conn.drain()

    def abort(self) -> None:
        self._head = b""
        self._conn.abort()


class LeanServer:
    """What every lean connection shares: the Director, the limits, aiohttp's protocol
    factory for hand-overs, and the requests in flight (for draining at shutdown)."""

    def __init__(
        self, director: Director, settings: GatewaySettings, guard: ConnectionGuard
    ) -> None:
        self.director = director
        self.settings = settings
        self.guard = guard
        self.aiohttp_factory: Callable[[], asyncio.Protocol] = _no_aiohttp
        self.tasks: set[asyncio.Task[None]] = set()
        self.connections: set[LeanProtocol] = set()
        self.closing = False
        """Shutting down: no new request is read, and a connection closes once it is idle."""

    def front(
        self, aiohttp_factory: Callable[[], asyncio.Protocol]
    ) -> Callable[[], asyncio.Protocol]:
        """The protocol factory to listen with, in front of `aiohttp_factory` (connections.py
        `FRONT`)."""
        self.aiohttp_factory = aiohttp_factory
        return lambda: LeanProtocol(self)

    async def drain(self, timeout_s: float) -> None:
        """At shutdown (after the listener closed): idle connections close now, requests in
        flight get up to `timeout_s` to finish and are then cancelled, as aiohttp's own
        `shutdown_timeout` does for its connections."""
        self.closing = True
        for conn in list(self.connections):
            conn.close_if_idle()
        if self.tasks:
            _, pending = await asyncio.wait(set(self.tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        for conn in list(self.connections):
            conn.close_if_idle()


def _no_aiohttp() -> asyncio.Protocol:
    raise RuntimeError("the lean server was not put in front of aiohttp's (LeanServer.front)")


class _HandOver(Exception):
    """Raised from a parser callback: this request is aiohttp's."""


class _Refuse(Exception):
    """Raised from a parser callback: answer `error` and close."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


class _Request:
    """One parsed request on the lean path: its head, and its body as it arrives."""

    __slots__ = ("body", "done", "error", "headers", "keep_alive", "kind", "path", "waiter")

    def __init__(self, kind: RequestKind, path: str, headers: CIMultiDict[str], keep_alive: bool):
        self.kind = kind
        self.path = path
        self.headers = headers
        self.keep_alive = keep_alive
        self.body: list[bytes] = []
        self.done = False
        self.error: GatewayError | None = None
        """Why its body could not be read (too large, bad framing)."""
        self.waiter: asyncio.Future[None] | None = None


class LeanProtocol(asyncio.Protocol):
    """One client connection on the lean path. Requests are answered in order, one at a
    time; pipelined ones wait in `queue` (reading pauses while one is queued)."""

    def __init__(self, server: LeanServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        """Looked up once: on Python 3.11 every `get_running_loop()` is a `getpid` system
        call, ~2 % of a request's CPU when made per request (docs/dataplane.md)."""
        settings = server.settings
        self.max_line = settings.max_line_bytes
        self.max_field = settings.max_header_bytes
        self.max_headers = settings.max_headers
        self.max_body = settings.max_body_bytes
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.guarded: _Guarded | None = None
        self.peer = ""
        self.buffer = b""
        """The bytes of the current request so far, while it may still be handed over."""
        self.tracking = True
        """The current request began at the start of a read (so `buffer` holds all of it)."""
        self.at_boundary = True
        self.completed_in_read = False
        self.url = b""
        self.raw_headers: list[tuple[str, str]] = []
        self.body_size = 0
        self.in_head = False
        self.head_bytes = 0
        self.max_head = self.max_line + settings.max_headers * (self.max_field + 4)
        """More bytes than this before a head ends cannot be a head within the limits
        (httptools gathers a header's value whole before `on_header` sees it)."""
        self.reading: _Request | None = None
        """The request whose body the parser is reading (None between requests)."""
        self.queue: list[_Request] = []
        """Requests parsed and not yet answered; the first is being served."""
        self.task: asyncio.Task[None] | None = None
        """The connection's worker: serves its requests one after another, then waits in
        `idle` for the next (one task per connection, not one per request)."""
        self.idle: asyncio.Future[_Request | None] | None = None
        self.keep_alive = True
        self.stopped: GatewayError | _HandOver | None = None
        """Parsing stopped: a hand-over or a refusal, carried out once the queue is empty."""
        self.paused_writing = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.last_active = time.monotonic()

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        self.guarded = self.server.guard.lookup(transport)
        self.server.connections.add(self)
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self.stopped is not None:
            if isinstance(self.stopped, _HandOver):
                self.buffer += data
            return
        self._feed(data)

    def eof_received(self) -> bool | None:
        """The client closed its side: the transport closes, and a request in flight is
        cancelled (`connection_lost`), as aiohttp's server does."""
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server.connections.discard(self)
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        if self.task is not None and not self.task.done():
            self.task.cancel()
        gone = ConnectionResetError("the client left")
        for waiter in (self.drain_waiter, *(r.waiter for r in self.queue)):
            if waiter is not None and not waiter.done():
                waiter.set_exception(gone)

    def pause_writing(self) -> None:
        self.paused_writing = True

    def resume_writing(self) -> None:
        self.paused_writing = False
        waiter = self.drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- parsing ---------------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self.at_boundary:
            self.buffer = data
            self.tracking = True
        elif self.tracking:
            self.buffer += data
        self.completed_in_read = False
        if self.in_head:
            self.head_bytes += len(data)
            if self.head_bytes > self.max_head:
                self._stop(BadRequest(f"the request head is longer than {self.max_head} bytes"))
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._stop(_HandOver())
        except httptools.HttpParserError as exc:
            # a callback's own exception comes back as the context of llhttp's error
            why = exc.__context__ if isinstance(exc, httptools.HttpParserCallbackError) else None
            if isinstance(why, _HandOver):
                self._stop(why)
            elif isinstance(why, _Refuse):
                self._stop(why.error)
            elif why is not None:
                raise why from exc
            else:
                self._stop(BadRequest(f"the request is not valid HTTP/1.1: {exc}"))
        else:
            if self.at_boundary:
                self.buffer = b""
            if len(self.queue) > 1 and self.transport is not None:
                self.transport.pause_reading()  # resumed when the queue is served

    def on_message_begin(self) -> None:
        if self.completed_in_read:
            self.tracking = False  # pipelined behind another request in the same read
        self.at_boundary = False
        self.in_head = True
        self.head_bytes = 0
        self.url = b""
        self.raw_headers = []
        self.body_size = 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.max_line:
            raise _Refuse(BadRequest(f"request line is longer than {self.max_line} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > self.max_field:
            raise _Refuse(BadRequest(f"a header field is longer than {self.max_field} bytes"))
        if len(self.raw_headers) >= self.max_headers:
            raise _Refuse(BadRequest(f"more than {self.max_headers} header fields"))
        self.raw_headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.in_head = False
        parser = self.parser
        path, _, _ = self.url.partition(b"?")
        kind = LEAN_ROUTES.get(path)
        if (
            kind is None
            or parser.get_method() != b"POST"
            or parser.get_http_version() != "1.1"  # HTTP/1.0 has no chunked answers
            or parser.should_upgrade()
        ):
            raise _HandOver
        headers = CIMultiDict(self.raw_headers)
        encoding = headers.get("Content-Encoding")
        if encoding is not None and encoding.strip().lower() != "identity":
            raise _HandOver  # aiohttp decodes compressed request bodies
        length = headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise _Refuse(BodyTooLarge(f"request body exceeds the limit of {self.max_body} bytes"))
        self.tracking = False
        self.buffer = b""
        request = self.reading = _Request(
            kind, path.decode("ascii"), headers, parser.should_keep_alive()
        )
        if headers.get("Expect", "").lower() == "100-continue" and not self.queue:
            self._write(_CONTINUE)
        self.queue.append(request)
        if len(self.queue) == 1:
            self._start(request)

    def on_body(self, body: bytes) -> None:
        self.body_size += len(body)
        if self.body_size > self.max_body:
            raise _Refuse(BodyTooLarge(f"request body exceeds the limit of {self.max_body} bytes"))
        if self.reading is not None:
            self.reading.body.append(body)

    def on_message_complete(self) -> None:
        self.at_boundary = True
        self.completed_in_read = True
        request = self.reading
        self.reading = None
        if request is None:
            return
        request.done = True
        waiter = request.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _stop(self, why: GatewayError | _HandOver) -> None:
        """Parsing stops here: hand the connection over, or refuse, once the requests
        before this one are answered."""
        if isinstance(why, _HandOver) and not self.tracking:
            why = BadRequest("a pipelined request to this route must come on its own connection")
        self.stopped = why
        reading = self.reading
        if reading is not None and isinstance(why, GatewayError):
            # its own answer says why; the connection closes after it (body not read)
            reading.error = why
            if reading.waiter is not None and not reading.waiter.done():
                reading.waiter.set_result(None)
            return
        if not self.queue:
            self._carry_out()
        elif self.transport is not None:
            self.transport.pause_reading()

    def _carry_out(self) -> None:
        why = self.stopped
        if isinstance(why, _HandOver):
            self._hand_over()
        elif why is not None:
            self._refuse(why)

    # -- one request -----------------------------------------------------------------------

    def _start(self, request: _Request) -> None:
        """Serve `request` now: wake the connection's idle worker, or start one.

        Why a worker per connection: on Python 3.11 a task costs a `WeakSet` entry in
        Python (`asyncio.all_tasks`), a done callback and its loop turn; ~5 µs per request
        in a tight loop (docs/dataplane.md). A keep-alive connection's next request only
        resolves a future."""
        if self.guarded is not None:
            self.guarded.enter()
        idle = self.idle
        if idle is not None and not idle.done():
            idle.set_result(request)
            return
        task = self.task = self.loop.create_task(self._work(request))
        self.server.tasks.add(task)

    async def _work(self, request: _Request | None) -> None:
        try:
            while request is not None:
                try:
                    await self._serve(request)
                except asyncio.CancelledError:
                    self._served(cancelled=True)
                    raise
                except Exception:
                    # the answer had begun (serve_inference answers every earlier error):
                    # only a cut connection can say it failed
                    self._served(failed=True)
                    return
                request = self._served()
                if request is None and self._open():
                    idle = self.idle = self.loop.create_future()
                    try:
                        request = await idle
                    finally:
                        self.idle = None
        finally:
            task = self.task
            if task is not None:
                self.server.tasks.discard(task)
            self.task = None

    def _open(self) -> bool:
        transport = self.transport
        return transport is not None and not transport.is_closing()

    async def _serve(self, request: _Request) -> None:
        async def read_body(settings: GatewaySettings) -> bytes:
            if not request.done and request.error is None:
                await self._await_body(request, settings)
            if request.error is not None:
                self.keep_alive = False
                raise request.error
            body = request.body
            request.body = []
            return body[0] if len(body) == 1 else b"".join(body)

        self.keep_alive = request.keep_alive
        error = await serve_inference(
            self.server.director,
            LeanSink(self),
            request.kind,
            "POST",
            request.path,
            request.headers,
            read_body,
        )
        if isinstance(error, RequestTimeout) or not request.done:
            self.keep_alive = False

    async def _await_body(self, request: _Request, settings: GatewaySettings) -> None:
        waiter = request.waiter = self.loop.create_future()
        try:
            async with asyncio.timeout(settings.body_timeout_s):
                await waiter
        except TimeoutError as exc:
            self.keep_alive = False  # answered with `Connection: close`, as aiohttp does
            raise RequestTimeout(
                f"the request body did not arrive within {settings.body_timeout_s:g} s"
            ) from exc
        finally:
            request.waiter = None

    def _served(self, cancelled: bool = False, failed: bool = False) -> _Request | None:
        """The request in flight ended: the connection goes on (returns the next request
        queued behind it, already parsed), waits for one (None), or closes."""
        if self.queue:
            self.queue.pop(0)
        if self.guarded is not None:
            self.guarded.leave()
        transport = self.transport
        if transport is None:
            return None
        if failed:
            transport.abort()
            return None
        if cancelled or not self.keep_alive or self.server.closing:
            transport.close()
            return None
        self.last_active = time.monotonic()
        if self.queue:
            request = self.queue[0]
            if self.guarded is not None:
                self.guarded.enter()
            if len(self.queue) == 1 and self.stopped is None:
                transport.resume_reading()
            return request
        if self.stopped is not None:
            self._carry_out()
        else:
            transport.resume_reading()
        return None

    # -- writing ---------------------------------------------------------------------------

    def connection_line(self) -> bytes:
        if self.keep_alive and not self.server.closing:
            return b""
        return b"Connection: close\r\n"

    def close_if_idle(self) -> None:
        if not self.queue and self.transport is not None:
            self.transport.close()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def send(self, *parts: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client left")
        transport.writelines(parts)

    async def drain(self) -> None:
        if not self.paused_writing:
            return
        if self.transport is None:
            raise ConnectionResetError("the client left")
        waiter = self.drain_waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self.drain_waiter = None

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _refuse(self, error: GatewayError) -> None:
        """Answer `error` (no request of this connection is being served) and close."""
        transport = self.transport
        if transport is None:
            return
        body = error_answer(error)
        framing = b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        transport.writelines([_head(error.status, error_headers(error), framing), body])
        transport.close()

    # -- hand-over ---------------------------------------------------------------------

    def _hand_over(self) -> None:
        """The connection becomes aiohttp's, from the start of the current request."""
        transport = self.transport
        if transport is None:
            return
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        inner = self.server.aiohttp_factory()
        if self.guarded is not None:
            self.guarded.inner = inner
        else:
            transport.set_protocol(inner)
        inner.connection_made(transport)
        data, self.buffer = self.buffer, b""
        self.transport = None
        idle = self.idle
        if idle is not None and not idle.done():
            idle.set_result(None)  # no connection_lost will come here: the worker ends now
        transport.resume_reading()
        inner.data_received(data)

    # -- idle keep-alive ---------------------------------------------------------------

    def _arm_idle(self) -> None:
        timeout = self.server.settings.idle_timeout_s
        self.idle_timer = self.loop.call_later(timeout, self._idle_check)

    def _idle_check(self) -> None:
        """One timer per connection, re-armed for the rest of the time when the connection
        was active since it was set (no timer per request)."""
        self.idle_timer = None
        transport = self.transport
        if transport is None:
            return
        if self.queue:
            self._arm_idle()
            return
        left = self.last_active + self.server.settings.idle_timeout_s - time.monotonic()
        if left > 0:
            self.idle_timer = self.loop.call_later(left, self._idle_check)
            return
        transport.close()
