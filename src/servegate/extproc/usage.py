"""Token usage read beside a response that is passed on untouched.

Chunks go back to the proxy as they arrive; the tap only keeps what it needs to
read `usage` at the end: the last `TAIL_BYTES` of an event stream (the usage
chunk comes last), or a JSON body up to `JSON_LIMIT` bytes (beyond it, nothing).
"""

from __future__ import annotations

import orjson

from servegate.gateway.proxy import TAIL_BYTES, USAGE_MARK, Usage, usage_from, usage_from_sse_tail

JSON_LIMIT = 4 * 1024 * 1024


class UsageTap:
    __slots__ = ("_buffer", "_overflow", "_streaming")

    def __init__(self, streaming: bool) -> None:
        self._streaming = streaming
        self._buffer = b""
        self._overflow = False

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self._streaming:
            buffer = self._buffer
            self._buffer = chunk if len(chunk) >= TAIL_BYTES else buffer[-TAIL_BYTES:] + chunk
            return
        if self._overflow:
            return
        if len(self._buffer) + len(chunk) > JSON_LIMIT:
            self._overflow = True
            self._buffer = b""
            return
        self._buffer += chunk

    def usage(self) -> Usage | None:
        data = self._buffer
        if USAGE_MARK not in data:
            return None
        if self._streaming:
            return usage_from_sse_tail(data)
        try:
            return usage_from(orjson.loads(data))
        except orjson.JSONDecodeError:
            return None
