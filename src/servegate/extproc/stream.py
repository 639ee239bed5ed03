"""One HTTP request as Envoy streams it to the picker, from its headers to its last response byte.

Request path, FULL_DUPLEX_STREAMED: the headers and body chunks are held until
the body is complete (its `end_of_stream`, or the request trailers), then the
picker answers in order — the headers response (destination header, `envoy.lb`
metadata, route cache cleared), the body in chunks, the trailers response when
trailers came. BUFFERED: the headers are answered at once with `CONTINUE`; the
one body message is answered with the destination (and the body, only when the
model was rewritten in it). A request that cannot be routed gets an
`ImmediateResponse` instead and the stream ends.

Routing is the `Director`'s (`control/director.py`), exactly as in HTTP mode: this
module is the adapter that reads Envoy's messages and writes the Director's answer
back as header mutations.

Response path: headers, body chunks and trailers are answered one for one and
at once (bodies unchanged); usage is read on the side for the token metrics.
With response body mode NONE the response headers are the last message: the
request is complete once they are answered (no usage, no time to first byte).
The request's lease (its in-flight count, taken on the primary endpoint) moves to
the endpoint the proxy reports as the server, and is released at the end of the
response or when the stream breaks off, whichever comes first.
"""

from __future__ import annotations

import time
import uuid
from enum import Enum

from servegate.control.context import RequestContext
from servegate.extproc.picker import Routed, envoy_route, pick_any
from servegate.extproc.protocol import (
    CONTINUE_REQUEST_HEADERS,
    DESTINATION_KEY,
    FULL_DUPLEX_MODES,
    REQUEST_TRAILERS_ANSWER,
    RESPONSE_TRAILERS_ANSWER,
    Message,
    ProtocolMismatch,
    buffered_body_response,
    headers_of,
    immediate_response,
    kind_of,
    read_modes,
    request_body_responses,
    request_headers_response,
    response_body_response,
    response_headers_response,
    served_endpoint,
    subset_hint,
)
from servegate.extproc.usage import UsageTap
from servegate.gateway.access_log import AccessRecord
from servegate.gateway.app import Gateway
from servegate.gateway.errors import BodyTooLarge, GatewayError, error_body
from servegate.gateway.headers import SERVED_HEADER
from servegate.gateway.openapi import PASSTHROUGH
from servegate.gateway.proxy import ROUTING_HEADERS
from servegate.scheduling.request import LLMRequest, RequestKind

INFERENCE_PATHS = {
    "/v1/chat/completions": RequestKind.CHAT,
    "/v1/completions": RequestKind.COMPLETION,
    "/v1/embeddings": RequestKind.EMBEDDING,
    "/v1/responses": RequestKind.RESPONSES,
    "/v1/messages": RequestKind.MESSAGES,
    **{path: RequestKind.OTHER for path in PASSTHROUGH},
}
"""Paths whose body is scheduled (as in HTTP mode, so is any other `/v1/…` request with a
body); a request without a body goes to any available endpoint."""


def kind_for(path: str, has_body: bool) -> RequestKind | None:
    kind = INFERENCE_PATHS.get(path)
    if kind is None and has_body and path.startswith("/v1/"):
        return RequestKind.OTHER
    return kind


class Phase(Enum):
    REQUEST = "request"
    UPSTREAM = "upstream"
    DONE = "done"


REMOVED_HEADERS = tuple(sorted(ROUTING_HEADERS))


def request_id(headers: dict[str, str]) -> str:
    rid = headers.get("x-request-id")
    if rid and len(rid) <= 128 and rid.isprintable():
        return rid
    return uuid.uuid4().hex


class ExtProcStream:
    """The picker's side of one `Process` stream; `handle` answers each message in turn.

    `finished` turns true once an `ImmediateResponse` went out (the stream is
    over for the proxy); `close()` must run when the stream ends, however it ends.
    """

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.director = gw.director
        self.started = time.monotonic()
        self.phase = Phase.REQUEST
        self.finished = False
        self.ctx: RequestContext | None = None
        self.routed: Routed | None = None
        self.modes = FULL_DUPLEX_MODES
        self._path = ""
        self._subset: tuple[str, ...] | None = None
        self._body = bytearray()
        self._body_seen = False
        self._tap: UsageTap | None = None
        self._closed = False

    @property
    def record(self) -> AccessRecord | None:
        return self.ctx.record if self.ctx is not None else None

    @property
    def llm(self) -> LLMRequest | None:
        return self.ctx.llm if self.ctx is not None else None

    async def handle(self, request: Message) -> list[Message]:
        kind = kind_of(request)
        if kind == "request_headers":
            return self._on_request_headers(request)
        if kind == "request_body":
            return await self._on_request_body(request)
        if kind == "request_trailers":
            return await self._on_request_trailers()
        if kind == "response_headers":
            return self._on_response_headers(request)
        if kind == "response_body":
            return self._on_response_body(request)
        if kind == "response_trailers":
            self._finish()
            return [RESPONSE_TRAILERS_ANSWER]
        return []

    # -- request path --------------------------------------------------------------------

    def _on_request_headers(self, request: Message) -> list[Message]:
        self.modes = read_modes(request)
        message = request.request_headers
        all_headers = headers_of(message.headers)
        self._path = all_headers.get(":path", "").split("?", 1)[0]
        headers = {k: v for k, v in all_headers.items() if not k.startswith(":")}
        self._subset = subset_hint(request)
        self.ctx = self.director.begin(
            request_id(headers), all_headers.get(":method", ""), self._path, headers, self.started
        )
        if message.end_of_stream:
            return self._route_any(b"", body_sent=False, end_of_stream=True)
        if self.modes.buffered_request:
            return [CONTINUE_REQUEST_HEADERS]
        return []

    async def _on_request_body(self, request: Message) -> list[Message]:
        if self.phase is not Phase.REQUEST:
            return []
        if self.ctx is None:
            raise ProtocolMismatch("a request body arrived before the request headers")
        chunk = request.request_body
        self._body_seen = True
        whole = chunk.end_of_stream or self.modes.buffered_request
        if whole and not self._body:
            body: bytes = chunk.body  # the usual case: no copy
        else:
            self._body += chunk.body
            body = bytes(self._body) if whole else b""
        limit = self.ctx.snapshot.config.gateway.max_body_bytes
        if max(len(body), len(self._body)) > limit:
            return [self._reject(BodyTooLarge(f"request body exceeds the limit of {limit} bytes"))]
        if not whole:
            return []
        self._body = bytearray()
        return await self._route(body, body_sent=True, end_of_stream=chunk.end_of_stream)

    async def _on_request_trailers(self) -> list[Message]:
        if self.phase is not Phase.REQUEST:
            return [REQUEST_TRAILERS_ANSWER]
        body = bytes(self._body)
        self._body = bytearray()
        out = await self._route(body, body_sent=self._body_seen, end_of_stream=False)
        if not self.finished:
            out.append(REQUEST_TRAILERS_ANSWER)
        return out

    async def _route(self, body: bytes, body_sent: bool, end_of_stream: bool) -> list[Message]:
        ctx = self.ctx
        if ctx is None:
            raise ProtocolMismatch("the request ended before its headers arrived")
        kind = kind_for(self._path, bool(body))
        if kind is None:
            return self._route_any(body, body_sent, end_of_stream)
        director = self.director
        try:
            director.authorise(ctx)
            _, decision = await director.route(ctx, body, kind, self._subset)
        except GatewayError as exc:
            return [self._reject(exc)]
        routed = self.routed = envoy_route(ctx.snapshot, decision)
        record = ctx.record
        record.endpoint = decision.endpoint.address
        if decision.prefill is not None:
            record.prefill_endpoint = decision.prefill.address
        if ctx.llm is not None:
            record.stream = ctx.llm.stream
        set_headers = {
            **routed.headers,
            DESTINATION_KEY: routed.destinations,
            "x-request-id": ctx.request_id,
        }
        changed = ctx.body is not body
        return self._forward(
            routed.destinations, set_headers, ctx.body, body_sent, end_of_stream, changed
        )

    def _route_any(self, body: bytes, body_sent: bool, end_of_stream: bool) -> list[Message]:
        ctx = self.ctx
        if ctx is None:
            raise ProtocolMismatch("the request ended before its headers arrived")
        try:
            self.director.authorise(ctx)
            state = pick_any(ctx.snapshot, self.director.rng, self._subset, time.monotonic())
        except GatewayError as exc:
            return [self._reject(exc)]
        ctx.record.endpoint = state.address
        set_headers = {DESTINATION_KEY: state.address, "x-request-id": ctx.request_id}
        return self._forward(state.address, set_headers, body, body_sent, end_of_stream, False)

    def _forward(
        self,
        destinations: str,
        set_headers: dict[str, str],
        body: bytes,
        body_sent: bool,
        end_of_stream: bool,
        changed: bool,
    ) -> list[Message]:
        """The routing answer; in BUFFERED mode the body goes back only when `changed`."""
        buffered = body_sent and self.modes.buffered_request
        if body and (changed or not buffered):
            set_headers["content-length"] = str(len(body))
        remove = [h for h in REMOVED_HEADERS if h not in set_headers]
        ctx = self.ctx
        if ctx is not None and ctx.snapshot.tenants.enabled:
            remove.append("authorization")
        self.phase = Phase.UPSTREAM
        if buffered:
            return [
                buffered_body_response(set_headers, remove, destinations, body if changed else None)
            ]
        out: list[Message] = [request_headers_response(set_headers, remove, destinations)]
        if body_sent:
            out.extend(request_body_responses(body, end_of_stream))
        return out

    def _reject(self, exc: GatewayError) -> Message:
        ctx = self.ctx
        headers = {"content-type": "application/json", **exc.headers, **exc.extra_headers}
        if ctx is not None:
            self.director.fail(ctx, exc)
            headers["x-request-id"] = ctx.request_id
        self.finished = True
        self.phase = Phase.DONE
        return immediate_response(
            exc.status, headers, error_body(exc.message, exc.type, exc.code, exc.param)
        )

    # -- response path -------------------------------------------------------------------

    def _on_response_headers(self, request: Message) -> list[Message]:
        message = request.response_headers
        headers = headers_of(message.headers)
        try:
            status = int(headers.get(":status", "0"))
        except ValueError:
            status = 0
        self._settle(served_endpoint(request))
        self._passive_health(status)
        if self.modes.response_body:
            self._tap = UsageTap("text/event-stream" in headers.get("content-type", ""))
        out_headers = self._response_headers()
        if self.ctx is not None:
            self.ctx.record.status = status
        if message.end_of_stream or not self.modes.response_body:
            self._finish()
        return [response_headers_response(out_headers)]

    def _response_headers(self) -> dict[str, str]:
        ctx = self.ctx
        if ctx is None:
            return {}
        out = {"x-request-id": ctx.request_id}
        endpoint = ctx.record.endpoint
        if endpoint:
            out[DESTINATION_KEY] = endpoint
            out[SERVED_HEADER] = endpoint
        if self.routed is not None:
            for name, value in ctx.response_headers.items():
                out[name.lower()] = value
        return out

    def _on_response_body(self, request: Message) -> list[Message]:
        chunk = request.response_body
        body: bytes = chunk.body
        record = self.record
        if body and record is not None and record.ttft_ms is None:
            record.ttft_ms = (time.monotonic() - self.started) * 1000.0
        if record is not None:
            record.response_bytes += len(body)
        if self._tap is not None:
            self._tap.feed(body)
        if chunk.end_of_stream:
            self._finish()
        return [response_body_response(body, chunk.end_of_stream)]

    def _settle(self, served: str | None) -> None:
        """Move the lease to the endpoint that served, when the proxy fell back."""
        ctx = self.ctx
        if served is None or ctx is None or served == ctx.record.endpoint:
            return
        record = ctx.record
        record.endpoint = served
        if self.routed is not None:
            addresses = [s.address for s in self.routed.targets]
            record.retries = addresses.index(served) if served in addresses else len(addresses)
        lease = ctx.lease
        if lease is not None and lease.state is not None:
            state = lease.runtime.pool.get(served)
            if state is not None:
                lease.move(state)

    def _passive_health(self, status: int) -> None:
        ctx = self.ctx
        lease = ctx.lease if ctx is not None else None
        if lease is None or lease.state is None or status == 0:
            return
        state = lease.state
        outlier = lease.runtime.state.outlier
        if status >= 500:
            self.director.metrics.upstream_errors.labels(state.address, str(status)).inc()
            outlier.failure(state, str(status))
        else:
            outlier.success(state)

    def _finish(self) -> None:
        if self.phase is Phase.DONE:
            return
        self.phase = Phase.DONE
        ctx = self.ctx
        if ctx is None:
            return
        record = ctx.record
        if self._tap is not None:
            usage = self._tap.usage()
            if usage is not None:
                record.prompt_tokens = usage.prompt_tokens
                record.completion_tokens = usage.completion_tokens
                record.cached_tokens = usage.cached_tokens
        self.director.complete(ctx)
        if ctx.lease is not None:
            ctx.lease.release()  # at the response's end, not when Envoy closes the stream

    # -- the end -------------------------------------------------------------------------

    def close(self) -> None:
        """Release whatever the request still holds, then count and log it once."""
        if self._closed:
            return
        self._closed = True
        ctx = self.ctx
        if ctx is None:
            return
        if self.phase is not Phase.DONE and not ctx.record.error:
            ctx.record.error = "stream ended before the response did"
        self.director.finish(ctx)
