"""One HTTP request as Envoy streams it to the picker, from its headers to its last response byte.

Request path (FULL_DUPLEX_STREAMED): the headers and body chunks are held until
the body is complete (its `end_of_stream`, or the request trailers), then the
picker answers in order — the headers response (destination header, `envoy.lb`
metadata, route cache cleared), the body in chunks, the trailers response when
trailers came. A request that cannot be routed gets an `ImmediateResponse`
instead and the stream ends.

Response path: headers, body chunks and trailers are answered one for one and
at once (bodies unchanged); usage is read on the side for the token metrics.
The in-flight count taken on the primary endpoint moves to the endpoint the
proxy reports as the server, and is released at the end of the response or
when the stream breaks off, whichever comes first.
"""

from __future__ import annotations

import time
import uuid
from enum import Enum

import orjson

from servegate.extproc.picker import Routed, admit, pick, pick_any, resolve_model
from servegate.extproc.protocol import (
    DESTINATION_KEY,
    Message,
    ProtocolMismatch,
    check_mode,
    headers_of,
    immediate_response,
    kind_of,
    request_body_responses,
    request_headers_response,
    request_trailers_response,
    response_body_response,
    response_headers_response,
    response_trailers_response,
    served_endpoint,
    subset_hint,
)
from servegate.extproc.usage import UsageTap
from servegate.gateway.access_log import AccessRecord
from servegate.gateway.admission import QUEUE_DURATION_HEADER, queue_ms
from servegate.gateway.app import Gateway
from servegate.gateway.errors import BodyTooLarge, GatewayError, error_body
from servegate.gateway.headers import SERVED_HEADER
from servegate.gateway.metrics import RequestSeries
from servegate.gateway.openapi import PASSTHROUGH
from servegate.gateway.parse import parse_request, strip_gateway_fields, with_model
from servegate.gateway.proxy import ROUTING_HEADERS
from servegate.gateway.tenants import Tenant
from servegate.pool.endpoint import EndpointState
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.scheduler import result_as_dict

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
        self.started = time.monotonic()
        self.phase = Phase.REQUEST
        self.finished = False
        self.record: AccessRecord | None = None
        self.routed: Routed | None = None
        self.llm: LLMRequest | None = None
        self._headers: dict[str, str] = {}
        self._path = ""
        self._rid = ""
        self._subset: tuple[str, ...] | None = None
        self._body = bytearray()
        self._body_seen = False
        self._held: EndpointState | None = None
        self._tokens = 0
        self._admitted = False
        self._queued_s = 0.0
        self._series: RequestSeries | None = None
        self._error_code: str | None = None
        self._request_bytes = 0
        self._tap: UsageTap | None = None
        self._closed = False

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
            return [response_trailers_response()]
        return []

    # -- request path --------------------------------------------------------------------

    def _on_request_headers(self, request: Message) -> list[Message]:
        check_mode(request)
        message = request.request_headers
        all_headers = headers_of(message.headers)
        self._path = all_headers.get(":path", "").split("?", 1)[0]
        self._headers = {k: v for k, v in all_headers.items() if not k.startswith(":")}
        self._rid = request_id(self._headers)
        self._subset = subset_hint(request)
        self.record = AccessRecord(
            request_id=self._rid, method=all_headers.get(":method", ""), path=self._path
        )
        if message.end_of_stream:
            return self._route_any(b"", body_sent=False, end_of_stream=True)
        return []

    async def _on_request_body(self, request: Message) -> list[Message]:
        if self.phase is not Phase.REQUEST:
            return []
        if self.record is None:
            raise ProtocolMismatch("a request body arrived before the request headers")
        chunk = request.request_body
        self._body_seen = True
        self._body += chunk.body
        limit = self.gw.config.gateway.max_body_bytes
        if len(self._body) > limit:
            return [self._reject(BodyTooLarge(f"request body exceeds the limit of {limit} bytes"))]
        if not chunk.end_of_stream:
            return []
        return await self._route(body_sent=True, end_of_stream=True)

    async def _on_request_trailers(self) -> list[Message]:
        if self.phase is not Phase.REQUEST:
            return [request_trailers_response()]
        out = await self._route(body_sent=self._body_seen, end_of_stream=False)
        if not self.finished:
            out.append(request_trailers_response())
        return out

    async def _route(self, body_sent: bool, end_of_stream: bool) -> list[Message]:
        record = self.record
        if record is None:
            raise ProtocolMismatch("the request ended before its headers arrived")
        body = bytes(self._body)
        self._body = bytearray()
        kind = kind_for(self._path, bool(body))
        if kind is None:
            return self._route_any(body, body_sent, end_of_stream)
        gw = self.gw
        try:
            tenant = self._authorise()
            llm = parse_request(body, kind, self._headers, self._rid)
            if strip_gateway_fields(llm.body):
                body = orjson.dumps(llm.body)
            record.model = llm.model
            if tenant is not None:
                record.tenant = tenant.name
                llm.fairness_id = tenant.fairness_id
                tenant.admit(llm.prompt_tokens + (llm.max_tokens or 0))
            resolve_model(gw, llm)
            record.target_model = llm.target_model
            self.llm = llm
            self._request_bytes = len(body)
            max_priority = tenant.max_priority if tenant is not None else None
            if gw.admission is not None:
                llm.priority = gw.admission.priority_of(llm.headers)
                if max_priority is not None and llm.priority > max_priority:
                    llm.priority = max_priority
            self._series = gw.metrics.start(
                llm.model, llm.target_model, llm.fairness_id, llm.priority
            )
            self._queued_s = await admit(gw, llm, len(body), max_priority)
            self._admitted = True
            routed = await pick(gw, llm, self._subset)
        except GatewayError as exc:
            return [self._reject(exc)]
        self.routed = routed
        self._tokens = llm.prompt_tokens + (llm.max_tokens or 0)
        self._hold(routed.targets[0])
        record.stream = llm.stream
        if llm.target_model != llm.model:
            body = with_model(llm, body)
        set_headers = {DESTINATION_KEY: routed.destinations, "x-request-id": self._rid}
        return self._forward(routed.destinations, set_headers, body, body_sent, end_of_stream)

    def _route_any(self, body: bytes, body_sent: bool, end_of_stream: bool) -> list[Message]:
        try:
            self._authorise()
            state = pick_any(self.gw, self._subset)
        except GatewayError as exc:
            return [self._reject(exc)]
        if self.record is not None:
            self.record.endpoint = state.address
        set_headers = {DESTINATION_KEY: state.address, "x-request-id": self._rid}
        return self._forward(state.address, set_headers, body, body_sent, end_of_stream)

    def _forward(
        self,
        destinations: str,
        set_headers: dict[str, str],
        body: bytes,
        body_sent: bool,
        end_of_stream: bool,
    ) -> list[Message]:
        if body:
            set_headers["content-length"] = str(len(body))
        remove = [h for h in sorted(ROUTING_HEADERS) if h not in set_headers]
        if self.gw.tenants.enabled:
            remove.append("authorization")
        self.phase = Phase.UPSTREAM
        out = [request_headers_response(set_headers, remove, destinations)]
        if body_sent:
            out.extend(request_body_responses(body, end_of_stream))
        return out

    def _authorise(self) -> Tenant | None:
        return self.gw.tenants.authenticate(self._headers.get("authorization", ""))

    def _reject(self, exc: GatewayError) -> Message:
        if self.record is not None:
            self.record.status = exc.status
            self.record.error = exc.message
        self._error_code = exc.canonical
        if self._series is None:
            model = self.record.model if self.record is not None else None
            self.gw.metrics.error(exc.canonical, model=model or "")
        headers = {"content-type": "application/json", **exc.headers, **exc.extra_headers}
        headers["x-request-id"] = self._rid
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
        self._tap = UsageTap("text/event-stream" in headers.get("content-type", ""))
        out_headers = self._response_headers()
        if self.record is not None:
            self.record.status = status
        if message.end_of_stream:
            self._finish()
        return [response_headers_response(out_headers)]

    def _response_headers(self) -> dict[str, str]:
        out = {"x-request-id": self._rid}
        if self.record is not None and self.record.endpoint:
            out[DESTINATION_KEY] = self.record.endpoint
            out[SERVED_HEADER] = self.record.endpoint
        if self.routed is None or self.llm is None:
            return out
        out[QUEUE_DURATION_HEADER] = queue_ms(self._queued_s)
        decision = self.routed.decision
        self.gw.cache_routing.headers(self.llm, decision, out)
        if self.gw.config.gateway.debug_headers:
            result = decision.results.get(decision.profile)
            if result is not None:
                out["x-servegate-scores"] = orjson.dumps(result_as_dict(result)).decode()
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
        """Move the in-flight count to the endpoint that served, when the proxy fell back."""
        record = self.record
        if served is None or record is None or served == record.endpoint:
            return
        record.endpoint = served
        if self.routed is not None:
            addresses = [s.address for s in self.routed.targets]
            record.retries = addresses.index(served) if served in addresses else len(addresses)
        if self._held is not None:
            self.gw.pool.release(self._held, self._tokens)
            self._held = None
            state = self.gw.pool.get(served)
            if state is not None:
                self._hold(state)

    def _hold(self, state: EndpointState) -> None:
        self.gw.pool.acquire(state, self._tokens)
        self._held = state
        if self.record is not None:
            self.record.endpoint = state.address

    def _passive_health(self, status: int) -> None:
        state = self._held
        outlier = self.gw.outlier
        if state is None or status == 0:
            return
        if status >= 500:
            self.gw.metrics.upstream_errors.labels(state.address, str(status)).inc()
            if outlier is not None:
                outlier.failure(state, str(status))
        elif outlier is not None:
            outlier.success(state)

    def _finish(self) -> None:
        if self.phase is Phase.DONE:
            return
        self.phase = Phase.DONE
        record = self.record
        if self._tap is not None and record is not None:
            usage = self._tap.usage()
            if usage is not None:
                record.prompt_tokens = usage.prompt_tokens
                record.completion_tokens = usage.completion_tokens
                record.cached_tokens = usage.cached_tokens
        if self._held is not None and self.llm is not None:
            self.gw.scheduler.response_complete(self.llm, self._held, time.monotonic())
        self._release()

    def _release(self) -> None:
        if self._held is not None:
            self.gw.pool.release(self._held, self._tokens)
            self._held = None
        if self._admitted:
            self._admitted = False
            if self.gw.admission is not None:
                self.gw.admission.completed()

    # -- the end -------------------------------------------------------------------------

    def close(self) -> None:
        """Release whatever the request still holds, then count and log it once."""
        if self._closed:
            return
        self._closed = True
        self._release()
        record = self.record
        if record is None:
            return
        elapsed = time.monotonic() - self.started
        record.latency_ms = elapsed * 1000.0
        if self.phase is not Phase.DONE and not record.error:
            record.error = "stream ended before the response did"
        if record.status == 0:
            record.status = 499
        metrics = self.gw.metrics
        series = self._series
        if series is not None:
            metrics.finish(series, record, elapsed, self._request_bytes, self._error_code)
        metrics.response(record.status).inc()
        self.gw.access_log.write(record)
