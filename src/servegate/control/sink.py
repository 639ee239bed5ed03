"""Where a relayed answer goes: the client side of a data plane, as the proxy sees it.

The proxy (`gateway/proxy.py`) and the P/D forwarder read the replica through an
`UpstreamTransport` and write the client's answer through a `ClientSink`, so that one
relay serves every data plane that carries bodies: aiohttp's server (`AiohttpSink`,
`gateway/sink.py`) and ASGI hosts such as Ray Serve and BentoML (`AsgiSink`,
`integrations/asgi_sink.py`); `servegate.testing.sink.RecordingSink` keeps an answer for
tests. Envoy's ext_proc carries no body through the gateway and has no sink.

A sink raises `ConnectionResetError` from `write` or `end` once its client has left; the
relay then closes the replica's request and accounts a 499.

Headers are `(name, value)` pairs in the order they are to be sent; a sink adds only
what its framing needs (`Content-Length` or chunked transfer, `Connection`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from servegate.control.errors import GatewayError, error_answer, error_headers

Headers = Iterable[tuple[str, str]]


class ClientSink(Protocol):
    """One request's answer to its client. A sink answers once: `respond` alone, or `start`
    then any number of `write` then `end` (or `abort`)."""

    @property
    def started(self) -> bool:
        """Whether the status line has gone out: after that an error can only cut the
        connection (`abort`), not become an OpenAI error body."""
        ...

    @property
    def remote(self) -> str | None:
        """The client's address (for `X-Forwarded-For`); None when unknown."""
        ...

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        """The whole answer at once (`Content-Length` framed)."""
        ...

    async def start(self, status: int, headers: Headers, content_length: int | None) -> None:
        """The status line and headers of an answer whose body follows (chunked, or
        `content_length` bytes when known)."""
        ...

    async def write(self, data: bytes) -> None:
        """Part of the body. Raises `ConnectionResetError` when the client has left."""
        ...

    async def end(self, last: bytes) -> None:
        """The body's last bytes and its end. Raises `ConnectionResetError` when the client
        has left."""
        ...

    def abort(self) -> None:
        """Cut the connection: the answer has begun and cannot be finished honestly."""
        ...


async def send_error(
    sink: ClientSink, exc: GatewayError, extra_headers: Mapping[str, str] | None = None
) -> None:
    """`exc` as the whole answer, in OpenAI's error format."""
    await sink.respond(exc.status, error_headers(exc, extra_headers), error_answer(exc))
