"""The seam between the proxy and the network: an `UpstreamTransport` sends one request to a
replica and hands back its answer as an `UpstreamResponse` to read.

`AiohttpTransport` is the real one (one aiohttp session for the whole request path,
opened when the gateway starts); `servegate.testing.transport.InMemoryTransport` answers
from scripted replies, so retries, the first-byte timeout and mid-stream failures are
tested without sockets; `servegate.gateway.lean_transport.LeanTransport` is the lean one
(`gateway.upstream_client: lean`). A transport raises what aiohttp raises
(`aiohttp.ClientError`, `OSError`, `TimeoutError`; mid-body: `aiohttp.ClientPayloadError`,
`aiohttp.ServerDisconnectedError`, never `ConnectionResetError`, which means the client
left); the proxy translates those into `errors.py` types.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Protocol

import aiohttp
from multidict import CIMultiDictProxy

NO_AUTO_HEADERS = ("Accept-Encoding", "User-Agent")
"""aiohttp adds these when absent; the replica sees only what the client sent."""


class UpstreamBody(Protocol):
    """The answer's body as it arrives."""

    async def readany(self) -> bytes:
        """The next bytes available (waiting for some); b"" at the end."""
        ...

    def read_nowait(self) -> bytes:
        """What has arrived and not been read, without waiting (b"" when nothing has): lets
        a caller skip a wait, and its timer, when the bytes are already here."""
        ...

    def iter_any(self) -> AsyncIterator[bytes]: ...

    def at_eof(self) -> bool: ...


class UpstreamResponse(Protocol):
    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> CIMultiDictProxy[str]: ...

    @property
    def content_type(self) -> str: ...

    @property
    def content_length(self) -> int | None: ...

    @property
    def content(self) -> UpstreamBody: ...

    def release(self) -> object:
        """The body was read to its end: the connection may serve another request."""
        ...

    def close(self) -> None:
        """Abandon the answer (and its connection)."""
        ...


class UpstreamTransport(Protocol):
    session: aiohttp.ClientSession | None
    """The aiohttp session behind it, for the few calls beside the request path (routing
    tokenizers' `/tokenize`); None for a transport without one."""

    def open(self) -> object:
        """Get ready to send (called inside the running event loop, when the gateway starts)."""
        ...

    async def close(self) -> None: ...

    def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        total_s: float | None,
        connect_s: float | None,
        head_s: float | None = None,
    ) -> Awaitable[UpstreamResponse]:
        """Send `body` to `url`; the answer once its status line and headers arrived.
        Never follows redirects. `head_s`: the head's deadline (a `TimeoutError` after it),
        the first-byte timeout, which a transport can keep on the timer it has anyway."""
        ...


class AiohttpTransport:
    """The request path's aiohttp client: no cookie jar (a replica's Set-Cookie is never
    replayed on other clients' requests), no automatic decompression (bodies are relayed
    as they come), no connection limit."""

    def __init__(self) -> None:
        self.session: aiohttp.ClientSession | None = None
        """Open between `open()` and `close()`."""
        self._timeouts: dict[tuple[float | None, float | None], aiohttp.ClientTimeout] = {}

    def open(self) -> aiohttp.ClientSession:
        """Create the session (inside the running event loop, as aiohttp requires)."""
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        return self.session

    def adopt(self, session: aiohttp.ClientSession) -> None:
        """Use a session made elsewhere (an embedding host's, the ext_proc server's)."""
        self.session = session

    async def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            await session.close()

    def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        total_s: float | None,
        connect_s: float | None,
        head_s: float | None = None,
    ) -> Awaitable[UpstreamResponse]:
        """aiohttp's own awaitable (no coroutine of ours around it without `head_s`)."""
        session = self.session
        if session is None:
            raise aiohttp.ClientConnectionError("the gateway is not running")
        timeout = self._timeouts.get((total_s, connect_s))
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=total_s, sock_connect=connect_s)
            self._timeouts[(total_s, connect_s)] = timeout
        request = session.post(
            url,
            data=body,
            headers=headers,
            timeout=timeout,
            allow_redirects=False,
            skip_auto_headers=NO_AUTO_HEADERS,
        )
        return request if head_s is None else _within(head_s, request)


async def _within(seconds: float, answer: Awaitable[UpstreamResponse]) -> UpstreamResponse:
    async with asyncio.timeout(seconds):
        return await answer
