"""Client connections: a cap (total and per client address), and a header-read timeout.

aiohttp alone keeps any connection open for as long as the client likes (its keep-alive
default is 3,630 s) and accepts until the process runs out of file descriptors, after
which `/health`, chat and the gateway's own health probes fail together. Here every
accepted connection goes through a thin `asyncio.Protocol` in front of aiohttp's:

- **Cap.** `max_connections` open client connections in all (default: three quarters of
  the process's file-descriptor limit, leaving the rest for upstream connections,
  probes and logs) and `max_connections_per_client` per client address (default: off;
  behind a load balancer every client shares its address). A connection over a cap
  first takes the place of the longest-idle connection that has no request in the
  handler and has been idle for `IDLE_GRACE_S` (closed, as a keep-alive timeout would);
  when there is none it gets a `503` with an OpenAI error body and is closed.
- **Header read.** A request head (request line and headers) must arrive completely
  within `header_timeout_s` of its first byte, or the connection is closed.

The idle keep-alive timeout is aiohttp's own (`keepalive_timeout`, `idle_timeout_s` here);
it also closes a connection that never sends anything. The body-read timeout is applied
where the body is read (app.py).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import cast

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from servegate.config import GatewaySettings
from servegate.gateway.errors import error_body

log = logging.getLogger("servegate.connections")

IDLE_GRACE_S = 1.0
"""An idle connection younger than this is never displaced by a newcomer."""
REJECT_LINGER_S = 0.5
"""A refused connection stays half-open this long, so the client reads the 503 before the
close (closing at once with unread request bytes would reset the connection)."""
FD_SHARE = 0.75
"""The default cap: this share of the file-descriptor limit."""
MIN_AUTO_CAP = 16

_IDLE, _HEAD, _BUSY = 0, 1, 2


def default_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return 65536
    return max(MIN_AUTO_CAP, int(soft * FD_SHARE))


def _overloaded_response() -> bytes:
    body = error_body(
        "the gateway has too many open connections; retry later",
        "service_unavailable_error",
        "too_many_connections",
        None,
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


OVERLOADED = _overloaded_response()


class _Guarded(asyncio.Protocol):
    """One client connection: its state for the cap, then aiohttp's protocol behind it."""

    __slots__ = ("_factory", "guard", "inner", "peer", "since", "state", "timer", "transport")

    def __init__(self, guard: ConnectionGuard, factory: Callable[[], asyncio.Protocol]) -> None:
        self.guard = guard
        self._factory = factory
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.state = _IDLE
        self.since = time.monotonic()
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self.guard.admit(self):
            self.guard.refuse(transport)
            return
        inner = self.inner = self._factory()
        inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        inner = self.inner
        if inner is None:
            return
        if self.state == _IDLE:
            self.state = _HEAD
            self.since = time.monotonic()
            if self.timer is None:  # else the one armed earlier re-arms for this head
                self.timer = asyncio.get_running_loop().call_later(
                    self.guard.header_timeout_s, self._head_timeout
                )
        inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.guard.forget(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _head_timeout(self) -> None:
        """One timer per connection, not one per request: a head that began after the
        timer was armed gets the rest of its own time; none in progress, no timer."""
        self.timer = None
        if self.state != _HEAD or self.transport is None:
            return
        left = self.since + self.guard.header_timeout_s - time.monotonic()
        if left > 0:
            self.timer = asyncio.get_running_loop().call_later(left, self._head_timeout)
            return
        self.guard.header_timeouts += 1
        self.transport.close()

    def enter(self) -> None:
        self.state = _BUSY

    def leave(self) -> None:
        self.state = _IDLE
        self.since = time.monotonic()

    def displaceable(self, now: float) -> bool:
        if self.state == _BUSY or now - self.since < IDLE_GRACE_S:
            return False
        transport = self.transport
        return transport is not None and transport.get_write_buffer_size() == 0


class ConnectionGuard:
    """The open client connections, by transport; see the module docstring."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.max_connections = settings.max_connections or default_max_connections()
        self.max_per_client = settings.max_connections_per_client or self.max_connections
        self.header_timeout_s = settings.header_timeout_s
        self._open: dict[asyncio.BaseTransport, _Guarded] = {}
        self._per_client: Counter[str] = Counter()
        self.refused = 0
        self.displaced = 0
        self.header_timeouts = 0

    def __len__(self) -> int:
        return len(self._open)

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory to listen with, in front of aiohttp's (`runner.server`)."""
        return lambda: _Guarded(self, inner)

    def admit(self, conn: _Guarded) -> bool:
        peer = conn.peer
        if self._per_client[peer] >= self.max_per_client:
            if not self._displace(peer):
                return False
        elif len(self._open) >= self.max_connections and not self._displace(None):
            return False
        assert conn.transport is not None
        self._open[conn.transport] = conn
        self._per_client[peer] += 1
        return True

    def _displace(self, peer: str | None) -> bool:
        now = time.monotonic()
        victim: _Guarded | None = None
        for conn in self._open.values():
            if peer is not None and conn.peer != peer:
                continue
            if conn.displaceable(now) and (victim is None or conn.since < victim.since):
                victim = conn
        if victim is None:
            return False
        self.displaced += 1
        self.forget(victim)
        assert victim.transport is not None
        victim.transport.close()
        return True

    def refuse(self, transport: asyncio.Transport) -> None:
        self.refused += 1
        if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
            log.warning(
                "connection cap reached: refused %d connections so far", self.refused,
                extra={"fields": {"open": len(self._open), "cap": self.max_connections}},
            )  # fmt: skip
        try:
            transport.write(OVERLOADED)
            if transport.can_write_eof():
                transport.write_eof()
        except (OSError, RuntimeError):
            transport.abort()
            return
        asyncio.get_running_loop().call_later(REJECT_LINGER_S, transport.close)

    def forget(self, conn: _Guarded) -> None:
        if conn.transport is None or self._open.pop(conn.transport, None) is None:
            return
        left = self._per_client[conn.peer] - 1
        if left > 0:
            self._per_client[conn.peer] = left
        else:
            del self._per_client[conn.peer]

    def lookup(self, transport: asyncio.BaseTransport | None) -> _Guarded | None:
        return self._open.get(transport) if transport is not None else None


class ConnectionCollector(Collector):
    """`servegate_client_connections` and the guard's counters, read at scrape time."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard

    def collect(self) -> Iterable[Metric]:
        guard = self._guard
        open_ = GaugeMetricFamily(
            "servegate_client_connections", "Open client connections (the guard's count)."
        )
        open_.add_metric([], len(guard))
        cap = GaugeMetricFamily(
            "servegate_client_connections_max", "The cap on open client connections."
        )
        cap.add_metric([], guard.max_connections)
        closed = CounterMetricFamily(
            "servegate_client_connections_closed",
            "Client connections the guard closed: refused over the cap (503), displaced "
            "(the longest idle, for a newcomer), or a request head that came too slowly.",
            labels=["reason"],
        )
        closed.add_metric(["refused"], guard.refused)
        closed.add_metric(["displaced"], guard.displaced)
        closed.add_metric(["header_timeout"], guard.header_timeouts)
        yield from (open_, cap, closed)


CONNECTIONS = web.AppKey("connections", ConnectionGuard)
Factory = Callable[[], asyncio.Protocol]
FRONT: web.AppKey[Callable[[Factory], Factory]] = web.AppKey("front")
"""Optional: a protocol factory to put in front of aiohttp's, behind the guard (the lean
server, `gateway.http_server: lean`)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def connection_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Marks the connection busy while its request is in the handler (never displaced)."""
    conn = request.app[CONNECTIONS].lookup(request.transport)
    if conn is None:
        return await handler(request)
    conn.enter()
    try:
        return await handler(request)
    finally:
        conn.leave()


class GuardedSite(web.TCPSite):
    """A TCP site whose connections go through a `ConnectionGuard` first."""

    def __init__(
        self,
        runner: web.BaseRunner,
        guard: ConnectionGuard,
        host: str,
        port: int,
        backlog: int = 128,
        reuse_address: bool | None = None,
        reuse_port: bool | None = None,
    ) -> None:
        super().__init__(runner, host, port, backlog=backlog)
        self.guard = guard
        self._listen = (host, port, backlog, reuse_address, reuse_port)

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server: Factory | None = self._runner.server
        assert server is not None
        if isinstance(self._runner, web.AppRunner) and FRONT in self._runner.app:
            server = self._runner.app[FRONT](server)
        host, port, backlog, reuse_address, reuse_port = self._listen
        self._server = await asyncio.get_running_loop().create_server(
            self.guard.factory(server),
            host,
            port,
            backlog=backlog,
            reuse_address=reuse_address,
            reuse_port=reuse_port,
        )
