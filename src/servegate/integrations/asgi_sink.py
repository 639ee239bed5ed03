"""`AsgiSink`: the `ClientSink` of an ASGI host (Ray Serve's proxy, BentoML, uvicorn).

An answer is `http.response.start` then `http.response.body` messages, the last with
`more_body: False`; the host frames them (Content-Length when the headers carry it,
chunked otherwise). ASGI has no message that cuts a connection, so `abort` only marks
the answer: the application then raises `AnswerAborted`, and the host closes the
connection without ending the body, as it does for any failing application.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from servegate.control.sink import Headers

Message = MutableMapping[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class AnswerAborted(Exception):
    """Raised to the ASGI host so that it cuts the connection of an answer that began but
    could not be finished honestly."""


class AsgiSink:
    __slots__ = ("_remote", "_send", "_started", "aborted", "ended", "gone")

    def __init__(self, send: Send, remote: str | None) -> None:
        self._send = send
        self._remote = remote
        self._started = False
        self.gone = False
        """The client left (`http.disconnect`, or the host refused a message)."""
        self.aborted = False
        self.ended = False
        """The last message of the answer has been handed to the host."""

    @property
    def started(self) -> bool:
        return self._started

    @property
    def remote(self) -> str | None:
        return self._remote

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        await self.start(status, headers, len(body))
        await self.end(body)

    async def start(self, status: int, headers: Headers, content_length: int | None) -> None:
        raw = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in headers
            if name.lower() != "content-length"
        ]
        if content_length is not None:
            raw.append((b"content-length", str(content_length).encode()))
        self._started = True
        await self._message({"type": "http.response.start", "status": status, "headers": raw})

    async def write(self, data: bytes) -> None:
        await self._message({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, last: bytes) -> None:
        self.ended = True
        await self._message({"type": "http.response.body", "body": last, "more_body": False})

    def abort(self) -> None:
        self.aborted = True

    async def _message(self, message: Message) -> None:
        if self.gone:
            raise ConnectionResetError("the client left")
        try:
            await self._send(message)
        except OSError as exc:  # uvicorn's ClientDisconnected, a closed transport
            self.gone = True
            raise ConnectionResetError("the client left") from exc
