"""`AiohttpSink`: the `ClientSink` of aiohttp's server, over one `web.Request`.

A whole answer (`respond`) becomes the `web.Response` the handler returns, so that
aiohttp's middlewares and `on_response_prepare` see it as before; a streamed one is a
`web.StreamResponse` prepared at `start`, which the handler returns once it has ended.
"""

from __future__ import annotations

from aiohttp import web

from servegate.control.sink import Headers


class AiohttpSink:
    __slots__ = ("_request", "response")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None
        """What the handler returns: the answer, once `respond` or `start` made it."""

    @property
    def started(self) -> bool:
        return self.response is not None and self.response.prepared

    @property
    def remote(self) -> str | None:
        return self._request.remote

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self.response = web.Response(status=status, body=body, headers=headers)

    async def start(self, status: int, headers: Headers, content_length: int | None) -> None:
        response = self.response = web.StreamResponse(status=status, headers=headers)
        if content_length is not None:
            response.content_length = content_length
        await response.prepare(self._request)

    def answer(self) -> web.StreamResponse:
        """The response for the handler to return."""
        if self.response is None:
            raise RuntimeError("the request path ended without answering")
        return self.response

    async def write(self, data: bytes) -> None:
        await self.answer().write(data)

    async def end(self, last: bytes) -> None:
        await self.answer().write_eof(last)

    def abort(self) -> None:
        transport = self._request.transport
        if transport is not None:
            transport.abort()
