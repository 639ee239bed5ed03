"""A `ClientSink` that keeps the answer, for driving the proxy without a server.

    sink = RecordingSink()
    await runtime.proxy.forward(sink, ctx, headers)
    assert (sink.status, sink.body) == (200, b"...")

`leave_after` makes the client go away after that many writes (the next write raises
`ConnectionResetError`, as a server's does once its peer has closed).
"""

from __future__ import annotations

from multidict import CIMultiDict

from servegate.control.sink import Headers


class RecordingSink:
    def __init__(self, remote: str | None = "127.0.0.1", leave_after: int | None = None) -> None:
        self._remote = remote
        self.leave_after = leave_after
        self.status: int | None = None
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.content_length: int | None = None
        self.chunks: list[bytes] = []
        """Every write, and the last bytes given to `end`, in order."""
        self.streamed = False
        """Whether the answer went out as `start` + writes (rather than `respond`)."""
        self.ended = False
        self.aborted = False

    @property
    def started(self) -> bool:
        return self.streamed

    @property
    def remote(self) -> str | None:
        return self._remote

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        self._head(status, headers)
        self.chunks.append(body)
        self.ended = True

    async def start(self, status: int, headers: Headers, content_length: int | None) -> None:
        self._head(status, headers)
        self.content_length = content_length
        self.streamed = True

    async def write(self, data: bytes) -> None:
        if self.leave_after is not None and len(self.chunks) >= self.leave_after:
            raise ConnectionResetError("the client left")
        self.chunks.append(data)

    async def end(self, last: bytes) -> None:
        await self.write(last)
        self.ended = True

    def abort(self) -> None:
        self.aborted = True

    def _head(self, status: int, headers: Headers) -> None:
        if self.status is not None:
            raise RuntimeError("a sink answers once")
        self.status = status
        self.headers = CIMultiDict(headers)
