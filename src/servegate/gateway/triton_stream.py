"""Triton's `generate_stream` events re-framed as an OpenAI stream.

Triton sends `data: {"text_output": ...}` events and simply ends the body: no
`[DONE]`, no finish reason. An error after the 200 status arrives as an event
`data: {"error": "..."}`. The TensorRT-LLM ensemble (and the BLS model without
`accumulate_tokens`) puts each step's new text in `text_output`; the BLS model
with `accumulate_tokens` puts the whole text so far, which `accumulate` undoes.

Out go OpenAI chunks with one id, `created` and model; then a chunk with the
finish reason, a usage chunk when the client asked for
`stream_options.include_usage`, and `data: [DONE]`. A Triton error event becomes
`data: {"error": {...}}` followed by `data: [DONE]`.
"""

from __future__ import annotations

import orjson

from servegate.gateway.errors import GatewayError, UpstreamFailed
from servegate.gateway.triton import TritonRequest, Usage, chunk, render_error, usage_chunk

DONE = b"data: [DONE]\n\n"


class TritonStream:
    """Feed Triton's body bytes in any slicing; write back what each call returns."""

    def __init__(self, request: TritonRequest, max_tokens: int, accumulate: bool = False) -> None:
        self.request = request
        self.max_tokens = max_tokens
        self.accumulate = accumulate
        self.text = ""
        self.error: str | None = None
        """Triton's error message, once an error event arrived (the stream is then over)."""
        self.usage: Usage | None = None
        self.events = 0
        self._buffer = b""
        self._started = False
        self._ended = False

    @property
    def ended(self) -> bool:
        return self._ended

    def feed(self, data: bytes) -> bytes:
        if self._ended:
            return b""
        self._buffer += data
        out = []
        while not self._ended:
            end = self._buffer.find(b"\n")
            if end < 0:
                break
            line = self._buffer[:end].rstrip(b"\r")
            self._buffer = self._buffer[end + 1 :]
            if line.startswith(b"data:"):
                out.append(self._event(line[5:].strip()))
        return b"".join(out)

    def _event(self, payload: bytes) -> bytes:
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return self._fail(f"Triton sent an event that is not JSON: {payload[:200]!r}")
        if not isinstance(doc, dict):
            return self._fail("Triton sent an event that is not a JSON object")
        if "error" in doc:
            message = doc["error"]
            return self._fail(message if isinstance(message, str) else str(message))
        text = doc.get("text_output")
        if isinstance(text, list) and len(text) == 1:
            text = text[0]
        if not isinstance(text, str):
            return self._fail("Triton sent an event without 'text_output'")
        self.events += 1
        if self.accumulate:
            delta = text[len(self.text) :] if text.startswith(self.text) else text
            self.text = text
        else:
            delta = text
            self.text += text
        if not delta:
            return b""
        first = not self._started
        self._started = True
        return chunk(self.request, delta, role=first)

    def _fail(self, message: str) -> bytes:
        self.error = message
        self._ended = True
        exc = UpstreamFailed(f"Triton failed while streaming: {message}")
        return b"data: " + render_error(exc) + b"\n\n" + DONE

    def finish(self) -> bytes:
        """At the end of Triton's body: the finish reason, usage and `[DONE]`."""
        if self._ended:
            return b""
        out = []
        if self._buffer.strip():
            out.append(self.feed(b"\n"))
            if self._ended:
                return b"".join(out)
        self._ended = True
        usage = self.usage = self.request.usage(self.text)
        finish = self.request.finish_reason(usage, self.max_tokens)
        out.append(
            chunk(self.request, None if self.request.chat else "", finish, not self._started)
        )
        if self.request.include_usage:
            out.append(usage_chunk(self.request, usage))
        out.append(DONE)
        return b"".join(out)

    def abort(self, exc: GatewayError) -> bytes:
        """The connection broke: an error event and `[DONE]`."""
        if self._ended:
            return b""
        self._ended = True
        return b"data: " + render_error(exc) + b"\n\n" + DONE
