"""`LeanTransport`: the request path's upstream client as plain asyncio (uvloop) protocols
with httptools' (llhttp) response parser, in place of aiohttp's client.

Why: aiohttp's client is about a third of the gateway's CPU per request (docs/benchmarks.md,
"Lean upstream client"); most of it is machinery the request path never uses (cookie jar,
redirects, auto headers, tracing, per-request timer contexts, a task per connect). What
is left is what a relay to replicas needs:

- keep-alive HTTP/1.1 connections pooled per origin, reused only after a body the parser
  saw end (a connection abandoned mid-body, or that broke, is closed, never reused); an
  idle connection the replica closed leaves the pool at once (`connection_lost`), and a
  request whose reused connection closes before a byte of answer is sent once more on a
  fresh one (the replica's keep-alive timer, not the replica, ended it);
- the request head built as one string (the origin's `Host` line made once);
- Content-Length, chunked and close-delimited answers; 1xx interim answers skipped as
  aiohttp does, 101 handed back (the proxy refuses it) and its connection closed;
- a bounded body buffer: reading from the socket pauses past `HIGH_WATER` buffered bytes
  and resumes when the relay has taken them, so a fast replica and a slow client never
  make the gateway hold a whole answer;
- `connect_s` bounds opening a connection, `total_s` the whole exchange (connect, head
  and body), as aiohttp's `sock_connect` and `total` do; no redirects are followed. A
  deadline 10 s or more away is checked by a once-a-second sweep (`Deadlines`), so it may
  fire up to a second late; a nearer one has its own timer;
- a response head over `MAX_HEAD_BYTES` or bytes llhttp rejects fail the request.

Errors are the kinds the proxy already translates: `UpstreamMalformed` is an
`aiohttp.ClientPayloadError`, `UpstreamClosed` an `aiohttp.ServerDisconnectedError`,
connect failures `OSError`, timeouts `TimeoutError`. An upstream reset is never raised as
`ConnectionResetError`, which the proxy reads as the *client* leaving.

The aiohttp session is still opened, for the calls beside the request path (routing
tokenizers' `/tokenize`), as the seam's `session` says.
"""

from __future__ import annotations

import asyncio
import math
import re
import socket
import ssl
from collections.abc import Coroutine, Mapping
from typing import cast
from urllib.parse import urlsplit

import aiohttp
import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from servegate.gateway.deadlines import Deadlines
from servegate.gateway.transport import AiohttpTransport

HIGH_WATER = 256 * 1024
"""Buffered, unread body bytes at which the socket stops being read."""
MAX_HEAD_BYTES = 64 * 1024
"""A status line and headers longer than this are refused (aiohttp refuses 8 KiB lines)."""
KEEPALIVE_S = 15.0
"""An idle connection older than this is closed rather than reused (aiohttp's default)."""
OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
"""Framing headers the transport writes itself; a caller's copies are not sent."""
_PLAIN_PATH = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/%?]*")
"""A path that needs no quoting (everything the gateway's routes use)."""
_NO_BODY = frozenset({204, 304})


class UpstreamMalformed(aiohttp.ClientPayloadError):
    """The replica's bytes are not HTTP/1.1 the gateway accepts (a garbage status line, a
    head over `MAX_HEAD_BYTES`, broken chunk framing)."""


class UpstreamClosed(aiohttp.ServerDisconnectedError):
    """The replica's connection closed (or reset) before its answer ended."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class _Stale(UpstreamClosed):
    """A reused connection closed before any byte of the answer: sent again, fresh."""


class LeanResponse:
    """One answer: its head, and its body as the parser delivers it (also its own
    `UpstreamBody`: no second object per request)."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_complete",
        "_conn",
        "_deadlines",
        "_error",
        "_head",
        "_then",
        "_timer",
        "_waiter",
        "_when",
        "content_length",
        "content_type",
        "headers",
        "status",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, deadlines: Deadlines | None = None) -> None:
        self.status = 0
        self.headers: CIMultiDictProxy[str] = _EMPTY
        self.content_type = "application/octet-stream"
        self.content_length: int | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head: asyncio.Future[None] = loop.create_future()
        self._conn: _Connection | None = None
        self._deadlines = deadlines
        self._timer: asyncio.TimerHandle | None = None
        self._when: float | None = None
        """The armed deadline (loop time); with no `_timer` it waits in `_deadlines`' sweep."""
        self._then: float | None = None
        """When the armed deadline is the first-byte one: the total one to arm if the head
        came in time (`inf`: none). One deadline per exchange, not one more per timeout."""

    @property
    def content(self) -> LeanResponse:
        return self

    # -- fed by the connection ----------------------------------------------------------

    def _on_head(self, status: int, fields: list[tuple[bytes, bytes]]) -> None:
        headers: CIMultiDict[str] = CIMultiDict(
            [
                (name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape"))
                for name, value in fields
            ]
        )
        self.status = status
        self.headers = CIMultiDictProxy(headers)
        ctype = headers.get("Content-Type")
        if ctype:
            self.content_type = ctype.partition(";")[0].strip().lower()
        length = headers.get("Content-Length")
        if length is not None and length.isdigit():
            self.content_length = int(length)
        if not self._head.done():
            self._head.set_result(None)

    def _feed(self, data: bytes) -> int:
        self._chunks.append(data)
        self._buffered += len(data)
        self._wake()
        return self._buffered

    def _finish(self) -> None:
        self._complete = True
        self._stop_timer()
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._complete or self._error is not None:
            return
        self._error = exc
        self._stop_timer()
        if not self._head.done():
            self._head.set_exception(exc)
            self._head.exception()  # retrieved: a failure nobody awaits is not "never retrieved"
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _arm(self, when: float) -> None:
        """Expire at `when` (loop time): swept when far off, else by a timer of its own."""
        self._when = when
        deadlines = self._deadlines
        if deadlines is None:
            self._timer = self._head.get_loop().call_at(when, self._expire)
            return
        self._timer = deadlines.arm(self, when, self._expire)

    def _expire(self) -> None:
        """A deadline passed: `head_s` before the head, or `total_s`. The exchange fails and
        its connection goes; a first-byte deadline after the head only arms the total one."""
        self._timer = None
        self._when = None
        then, self._then = self._then, None
        if then is not None:
            if self._head.done():
                if then != math.inf:
                    self._arm(then)
                return
            self._fail(TimeoutError("the upstream sent no answer within its first-byte timeout"))
        else:
            self._fail(TimeoutError("the upstream exchange exceeded its total timeout"))
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()

    def _stop_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        elif self._when is not None and self._deadlines is not None:
            self._deadlines.disarm(self)
        self._when = None

    # -- UpstreamBody -------------------------------------------------------------------

    async def readany(self) -> bytes:
        while True:
            if self._chunks:
                return self.read_nowait()
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            waiter = self._waiter = self._head.get_loop().create_future()  # no getpid call
            try:
                await waiter
            finally:
                self._waiter = None

    def read_nowait(self) -> bytes:
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        return data

    def iter_any(self) -> LeanResponse:
        return self

    def __aiter__(self) -> LeanResponse:
        return self

    async def __anext__(self) -> bytes:
        data = await self.readany()
        if not data:
            raise StopAsyncIteration
        return data

    def at_eof(self) -> bool:
        return self._complete and not self._chunks

    # -- UpstreamResponse ---------------------------------------------------------------

    def release(self) -> None:
        """Pool the connection if the parser saw the whole answer, else close it."""
        self._stop_timer()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.done(reusable=self._complete and self._error is None)

    def close(self) -> None:
        self._stop_timer()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.done(reusable=False)


_EMPTY: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


class _Connection(asyncio.Protocol):
    """One keep-alive connection; answers one request at a time."""

    __slots__ = (
        "_eof_body",
        "_extra",
        "_fed",
        "_fields",
        "_head_done",
        "_interim",
        "_keep_alive",
        "_origin",
        "_parser",
        "closed",
        "idle_since",
        "paused",
        "response",
        "reused",
        "transport",
    )

    def __init__(self, origin: _Origin) -> None:
        self._origin = origin
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.response: LeanResponse | None = None
        self._fields: list[tuple[bytes, bytes]] = []
        self._fed = 0
        self._head_done = False
        self._interim = False
        self._eof_body = False
        self._extra = False
        self._keep_alive = True  # until an answer says otherwise: a fresh connection may pool
        self.closed = False
        self.paused = False
        self.reused = False
        self.idle_since = 0.0

    # -- driven by the transport --------------------------------------------------------

    def send(self, response: LeanResponse, request: list[bytes]) -> None:
        transport = self.transport
        assert transport is not None
        self.response = response
        response._conn = self
        self._fields = []
        self._fed = 0
        self._head_done = False
        self._interim = False
        self._eof_body = False
        self._keep_alive = False
        transport.writelines(request)

    def done(self, reusable: bool) -> None:
        """The response let go of its connection: back to the pool or closed."""
        self.response = None
        transport = self.transport
        if (
            not reusable
            or self._extra
            or self.closed
            or transport is None
            or transport.is_closing()
            or not self._keep_alive
        ):
            self.abort()
            return
        if self.paused:
            self.resume()
        self.reused = True
        self.idle_since = self._origin.loop.time()
        self._origin.idle.append(self)

    def abort(self) -> None:
        self.closed = True
        transport = self.transport
        if transport is not None:
            transport.abort()

    def resume(self) -> None:
        self.paused = False
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.resume_reading()

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._origin.open.add(self)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None or response._complete or response._error is not None:
            self.abort()  # bytes nobody asked for: this connection's framing is not to be trusted
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # 101 Switching Protocols: what follows is not HTTP; the head was handed over.
            self._extra = True
            response._finish()
            self.abort()
            return
        except httptools.HttpParserError as exc:
            self._broken(UpstreamMalformed(f"the replica's answer is not valid HTTP/1.1: {exc}"))
            return
        if self._extra:
            self.abort()
        elif not self._head_done:  # also when llhttp has not reached the end of the head
            self._fed += len(data)
            if self._fed > MAX_HEAD_BYTES:
                self._broken(
                    UpstreamMalformed(f"the replica's answer head is over {MAX_HEAD_BYTES} bytes")
                )

    def eof_received(self) -> bool:
        return False  # close; connection_lost settles a close-delimited body

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        origin = self._origin
        origin.open.discard(self)
        try:
            origin.idle.remove(self)
        except ValueError:
            pass
        response = self.response
        if response is None or response._complete:
            return
        if self._head_done:
            if exc is None and self._eof_body:
                response._finish()  # a close-delimited body ends here
                return
            response._fail(UpstreamClosed("the replica closed the connection mid-answer"))
        elif self.reused and self._fed == 0:
            response._fail(_Stale("a kept-alive connection closed before the answer"))
        else:
            response._fail(UpstreamClosed("the replica closed the connection before answering"))

    def pause_writing(self) -> None:
        pass  # request bodies are bounded by the gateway's max_body_bytes

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        response = self.response
        if response is not None and response._complete:
            self._extra = True  # a second answer to one request

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._interim = True  # 100 Continue, 103 Early Hints: the answer follows
            self._fields = []
            return
        fields = self._fields
        if sum(len(name) + len(value) + 4 for name, value in fields) > MAX_HEAD_BYTES:
            self._fed = MAX_HEAD_BYTES + 1  # refused once feed_data returns
            return
        self._head_done = True
        response = self.response
        if response is None:
            return
        framed = status in _NO_BODY
        for name, _ in fields:
            lower = name.lower()
            if lower == b"content-length" or lower == b"transfer-encoding":
                framed = True
        self._eof_body = not framed
        response._on_head(status, fields)

    def on_body(self, body: bytes) -> None:
        response = self.response if self._head_done else None
        if response is not None and response._feed(body) > HIGH_WATER and not self.paused:
            transport = self.transport
            if transport is not None and not transport.is_closing():
                self.paused = True
                transport.pause_reading()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            self._fed = 0
            return
        self._keep_alive = self._parser.should_keep_alive()  # llhttp resets it after this
        response = self.response
        if response is not None and self._head_done:
            response._finish()

    def _broken(self, exc: BaseException) -> None:
        response = self.response
        if response is not None:
            response._fail(exc)
        self.abort()


class _Origin:
    """One scheme://host:port: its idle connections and its `Host` line."""

    __slots__ = ("host", "host_line", "idle", "loop", "open", "port", "server_hostname", "ssl")

    def __init__(self, loop: asyncio.AbstractEventLoop, scheme: str, authority: str) -> None:
        parts = urlsplit(f"{scheme}://{authority}")
        if parts.hostname is None:
            raise aiohttp.InvalidURL(f"{scheme}://{authority}")
        self.loop = loop
        self.host = parts.hostname
        self.port = parts.port or (443 if scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if scheme == "https" else None
        )
        self.server_hostname = self.host if self.ssl is not None else None
        self.host_line = f"Host: {authority}\r\n"
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()

    def idle_connection(self) -> _Connection | None:
        """The most recently used live one (LIFO: the rest may time out and go)."""
        idle = self.idle
        while idle:
            conn = idle.pop()
            transport = conn.transport
            if conn.closed or transport is None or transport.is_closing():
                continue
            if self.loop.time() - conn.idle_since > KEEPALIVE_S:
                conn.abort()
                continue
            return conn
        return None

    async def connect(self, timeout: float | None) -> _Connection:
        async with asyncio.timeout(timeout):
            _, conn = await self.loop.create_connection(
                lambda: _Connection(self),
                self.host,
                self.port,
                ssl=self.ssl,
                server_hostname=self.server_hostname,
            )
        return conn


class LeanTransport:
    """`UpstreamTransport` over pooled HTTP/1.1 connections (see the module docstring)."""

    def __init__(self, keepalive_s: float = KEEPALIVE_S) -> None:
        self._keepalive_s = keepalive_s
        self._sweeper: asyncio.TimerHandle | None = None
        self._side = AiohttpTransport()
        self.session: aiohttp.ClientSession | None = None
        """For the calls beside the request path; open between `open()` and `close()`."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deadlines: Deadlines | None = None
        self._origins: dict[str, _Origin] = {}

    def open(self) -> aiohttp.ClientSession:
        self._loop = asyncio.get_running_loop()
        self._deadlines = Deadlines(self._loop)
        self._sweep()
        self.session = self._side.open()
        return self.session

    def _sweep(self) -> None:
        """Close connections idle past `keepalive_s`, every `keepalive_s`: after a burst the
        pool would otherwise hold its peak of sockets (and file descriptors) for good."""
        loop = self._loop
        if loop is None:
            return
        limit = loop.time() - self._keepalive_s
        for origin in self._origins.values():
            idle = origin.idle  # oldest first: connections are appended as they go idle
            stale = 0
            while stale < len(idle) and idle[stale].idle_since < limit:
                stale += 1
            if stale:
                gone, origin.idle = idle[:stale], idle[stale:]
                for conn in gone:
                    conn.abort()
        self._sweeper = loop.call_later(self._keepalive_s, self._sweep)

    def adopt(self, session: aiohttp.ClientSession) -> None:
        """Use a session made elsewhere for the side calls (an embedding host's)."""
        self._loop = asyncio.get_running_loop()
        if self._deadlines is None:
            self._deadlines = Deadlines(self._loop)
        if self._sweeper is None:
            self._sweep()
        self._side.adopt(session)
        self.session = session

    async def close(self) -> None:
        self._loop = None
        if self._deadlines is not None:
            self._deadlines.close()
            self._deadlines = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        origins, self._origins = self._origins, {}
        for origin in origins.values():
            origin.idle.clear()
            for conn in list(origin.open):
                conn.abort()
        self.session = None
        await self._side.close()

    def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        total_s: float | None,
        connect_s: float | None,
        head_s: float | None = None,
    ) -> Coroutine[object, object, LeanResponse]:
        """The coroutine itself (no task per attempt); `head_s` shares the total's timer."""
        return self._post(url, body, headers, total_s, connect_s, head_s)

    async def _post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        total_s: float | None,
        connect_s: float | None,
        head_s: float | None,
    ) -> LeanResponse:
        loop = self._loop
        if loop is None:
            raise aiohttp.ClientConnectionError("the gateway is not running")
        origin, path = self._route(loop, url)
        request = _request(origin, path, body, headers)
        now = loop.time()
        total_at = math.inf if total_s is None else now + total_s
        deadline = total_at if head_s is None else min(total_at, now + head_s)
        deadlines = self._deadlines
        response = LeanResponse(loop, deadlines)
        if deadline != math.inf:
            response._arm(deadline)
            if deadline < total_at:
                response._then = total_at
        fresh = False
        try:
            while True:
                conn = None if fresh else origin.idle_connection()
                if conn is None:
                    timeout = connect_s
                    if deadline != math.inf:
                        left = deadline - loop.time()
                        timeout = left if timeout is None else min(timeout, left)
                    conn = await origin.connect(timeout)
                    if response._error is not None:
                        conn.done(reusable=True)  # never used: pooled as it is
                        raise response._error
                conn.send(response, request)
                try:
                    await response._head
                except _Stale:
                    if fresh:
                        raise
                    fresh = True
                    stale, response = response, LeanResponse(loop, deadlines)
                    when, response._then = stale._when, stale._then
                    stale._stop_timer()
                    if when is not None:
                        response._arm(when)  # the same deadlines, for the one retry
                    continue
                return response
        except BaseException:
            response.close()
            raise

    def _route(self, loop: asyncio.AbstractEventLoop, url: str) -> tuple[_Origin, str]:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in ("http", "https"):
            raise aiohttp.InvalidURL(url)
        slash = rest.find("/")
        authority, path = (rest, "/") if slash < 0 else (rest[:slash], rest[slash:])
        key = url[: len(url) - len(rest) + len(authority)]
        origin = self._origins.get(key)
        if origin is None:
            origin = self._origins[key] = _Origin(loop, scheme, authority)
        if _PLAIN_PATH.fullmatch(path) is None:
            path = URL(url).raw_path_qs  # quoted as aiohttp would
        return origin, path


def _request(origin: _Origin, path: str, body: bytes, headers: Mapping[str, str]) -> list[bytes]:
    """The request's bytes: one head (checked for smuggled line breaks), then the body."""
    lines = [f"POST {path} HTTP/1.1\r\n", origin.host_line]
    for name, value in headers.items():
        if name.lower() not in OWN_HEADERS:
            lines.append(f"{name}: {value}\r\n")
    lines.append(f"Content-Length: {len(body)}\r\n\r\n")
    head = "".join(lines)
    breaks = len(lines) + 1
    if head.count("\n") != breaks or head.count("\r") != breaks:
        raise ValueError("a line break in a request header or path")
    return [head.encode("utf-8"), body] if body else [head.encode("utf-8")]
