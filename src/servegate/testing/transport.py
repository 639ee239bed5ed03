"""An `UpstreamTransport` that answers from scripted replies, without sockets.

    transport = InMemoryTransport({"10.0.0.1:8000": [Reply(status=503), Reply(body=b"{}")]})
    gw = build_gateway(config, transport=transport)

Each address answers with its replies in turn (the last one repeats). A reply can be
late (`delay_s`: the proxy's first-byte timeout), refused (`refuse`), cut in the middle
of its body (`cut_after` chunks), or slow between chunks. What the proxy sent is kept
in `sent`, and whether each answer was released or closed, so tests can check the
retry policy, the timeouts and mid-stream handling exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy

JSON = {"Content-Type": "application/json"}
SSE = {"Content-Type": "text/event-stream"}


@dataclass(frozen=True)
class Reply:
    status: int = 200
    chunks: Sequence[bytes] = (b"{}",)
    """The body, in the pieces the proxy reads it in."""
    headers: Mapping[str, str] = field(default_factory=lambda: dict(JSON))
    delay_s: float = 0.0
    """Before the status line: longer than `first_byte_timeout_s` is a timeout."""
    chunk_delay_s: float = 0.0
    """Before every chunk of the body."""
    refuse: bool = False
    """The connection is refused (`aiohttp.ClientConnectorError`-like)."""
    cut_after: int | None = None
    """The connection breaks after this many chunks (`aiohttp.ClientPayloadError`)."""


@dataclass(frozen=True)
class Sent:
    url: str
    body: bytes
    headers: Mapping[str, str]

    @property
    def address(self) -> str:
        return urlsplit(self.url).netloc


class InMemoryBody:
    def __init__(self, reply: Reply) -> None:
        self._reply = reply
        self._next = 0

    async def readany(self) -> bytes:
        reply = self._reply
        if reply.cut_after is not None and self._next >= reply.cut_after:
            raise aiohttp.ClientPayloadError("the replica closed the connection mid-body")
        if self._next >= len(reply.chunks):
            return b""
        if reply.chunk_delay_s:
            await asyncio.sleep(reply.chunk_delay_s)
        chunk = reply.chunks[self._next]
        self._next += 1
        return chunk

    def read_nowait(self) -> bytes:
        """The next chunk when it is due at once (no delay, no cut), else b""."""
        reply = self._reply
        if reply.chunk_delay_s or self._next >= len(reply.chunks):
            return b""
        if reply.cut_after is not None and self._next >= reply.cut_after:
            return b""
        chunk = reply.chunks[self._next]
        self._next += 1
        return chunk

    async def iter_any(self) -> AsyncIterator[bytes]:
        while True:
            chunk = await self.readany()
            if not chunk:
                return
            yield chunk

    def at_eof(self) -> bool:
        reply = self._reply
        if reply.cut_after is not None and self._next >= reply.cut_after:
            return False
        return self._next >= len(reply.chunks)


class InMemoryResponse:
    def __init__(self, reply: Reply) -> None:
        self._reply = reply
        self._headers = CIMultiDictProxy(CIMultiDict(reply.headers))
        self._content = InMemoryBody(reply)
        self.released = False
        self.closed = False

    @property
    def status(self) -> int:
        return self._reply.status

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return self._headers

    @property
    def content_type(self) -> str:
        return self._headers.get("Content-Type", "application/octet-stream").split(";")[0]

    @property
    def content_length(self) -> int | None:
        reply = self._reply
        if reply.cut_after is not None or self.content_type == "text/event-stream":
            return None
        return sum(len(c) for c in reply.chunks)

    @property
    def content(self) -> InMemoryBody:
        return self._content

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.closed = True


class InMemoryTransport:
    """Scripted replies per `host:port`; an address without a script refuses connections."""

    session: aiohttp.ClientSession | None = None

    def __init__(self, replies: Mapping[str, Reply | Sequence[Reply]]) -> None:
        self._replies = {
            address: [r] if isinstance(r, Reply) else list(r) for address, r in replies.items()
        }
        self.sent: list[Sent] = []
        self.responses: list[InMemoryResponse] = []

    def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        total_s: float | None,
        connect_s: float | None,
        head_s: float | None = None,
    ) -> InMemoryResponse:
        sent = Sent(url, body, dict(headers))
        self.sent.append(sent)
        script = self._replies.get(sent.address)
        if not script:
            raise aiohttp.ClientConnectionError(f"nothing listens on {sent.address}")
        reply = script.pop(0) if len(script) > 1 else script[0]
        if reply.delay_s:
            async with asyncio.timeout(head_s):
                await asyncio.sleep(reply.delay_s)
        if reply.refuse:
            raise aiohttp.ClientConnectionError(f"{sent.address} refused the connection")
        response = InMemoryResponse(reply)
        self.responses.append(response)
        return response
