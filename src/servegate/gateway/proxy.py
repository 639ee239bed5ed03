"""Forwarding: send the original bytes to the chosen endpoint, relay the answer as it comes.

Retries happen only before the first byte reaches the client: a connect error, no
response headers within `first_byte_timeout_s`, a 502/503, a redirect, or a stream
that breaks or ends before its first `data:` line (vLLM sends a stream's headers at
once, so a replica dying mid-prefill fails there) moves the request to the next
fallback, after a
jittered backoff and only while the retry budget lasts (`retry.py`). Once a
stream has started, a failure ends it with an OpenAI-style error event and is
counted (`servegate_upstream_errors{kind="midstream"}`). Every attempt's result
feeds passive health (`datalayer/outlier.py`).
Foreign exceptions are translated to `errors.py` types here and nowhere else.

The answer reaches the client through a `ClientSink` (`control/sink.py`): aiohttp's
server (`sink.py`) and ASGI hosts (`integrations/asgi_gateway.py`) relay through this one
proxy.

An engine whose `EngineSpec` names a request adapter speaks no OpenAI: for it each
attempt translates the request and the answer (Triton's `triton-generate`: `triton.py`,
`triton_stream.py`); every other engine gets the original bytes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from servegate.config import GatewaySettings
from servegate.control.context import RequestContext
from servegate.control.sink import ClientSink, send_error
from servegate.datalayer.outlier import OutlierDetector
from servegate.engines.registry import EngineRegistry, UnknownEngineError
from servegate.gateway.access_log import AccessRecord
from servegate.gateway.errors import (
    GatewayError,
    InternalError,
    NotFound,
    UpstreamFailed,
    UpstreamTimeout,
    clip,
    describe,
    error_body,
    for_status,
    sse_error_event,
)
from servegate.gateway.headers import DESTINATION_HEADER, SERVED_HEADER
from servegate.gateway.metrics import GatewayMetrics
from servegate.gateway.retry import RetryBudget
from servegate.gateway.transport import UpstreamResponse, UpstreamTransport
from servegate.gateway.triton import (
    TRITON_ADAPTER,
    TritonRequest,
    TritonTranslator,
    accumulates,
    completion_response,
    render_error,
    triton_error,
)
from servegate.gateway.triton_stream import TritonStream
from servegate.pool.endpoint import EndpointState

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
ROUTING_HEADERS = frozenset(
    {
        "x-gateway-destination-endpoint",
        "x-gateway-destination-endpoint-subset",
        "x-gateway-destination-endpoint-served",
        "x-prefiller-host-port",
        "x-encoder-hosts-ports",
        "x-data-parallel-host-port",
        "x-data-parallel-rank",
        "x-kv-cache-source-host-port",
    }
)
"""Headers only the gateway may set: a client must not choose an address itself."""
Route = Callable[[EndpointState, Mapping[str, str]], tuple[str, Mapping[str, str]]]
"""Per attempt: the base URL and headers for one target (data-parallel ranks behind a sidecar)."""
REQUEST_DROP = frozenset({"content-encoding"})
"""The gateway reads (and so decompresses) every request body; it forwards the plain bytes."""
RESPONSE_DROP = HOP_BY_HOP | {"date", "server"}
FORWARDING_HEADERS = frozenset({"x-forwarded-for", "forwarded"})
"""Rebuilt by the gateway with the client's address appended."""
NOT_FORWARDED = HOP_BY_HOP | ROUTING_HEADERS | REQUEST_DROP | FORWARDING_HEADERS
"""Never copied as they came (the forwarding pair is rebuilt): one lookup per header."""
UPSTREAM_DROP = frozenset(
    {
        "set-cookie",
        "set-cookie2",
        "location",
        "content-location",
        "refresh",
        "strict-transport-security",
        "public-key-pins",
        "alt-svc",
        "x-session-token",
        "x-gateway-destination-endpoint",
        "x-gateway-destination-endpoint-served",
        "x-llm-d-request-dropped-reason",
        "x-llm-d-flow-queue-duration-ms",
        "x-servegate-scores",
        "x-servegate-served-model",
    }
)
"""Replica response headers never relayed: cookies, redirects and policies (HSTS, CORS
`access-control-*`, Alt-Svc) for the gateway's origin are the gateway's to set, not a
replica's; nor the headers the gateway itself sets (routing, flow control, the session
token), which a replica could otherwise forge."""
NOT_RELAYED = RESPONSE_DROP | UPSTREAM_DROP

RETRY_STATUSES = frozenset({502, 503})


def refused_status(status: int) -> bool:
    """Informational (101 switching protocols…) and redirect answers are never relayed."""
    return status < 200 or 300 <= status < 400


USAGE_MARK = b'"usage"'
DATA_MARK = b"data:"
FIRST_CONTENT_LIMIT = 64 * 1024
"""Past this much of a stream without a `data:` line, relaying starts anyway."""
TAIL_BYTES = 8192


@dataclass(slots=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


def usage_from(obj: Any) -> Usage | None:
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if usage is None and isinstance(obj.get("response"), dict):
        usage = obj["response"].get("usage")  # the Responses API's `response.completed` event
    if not isinstance(usage, dict):
        return None
    if "input_tokens" in usage or "output_tokens" in usage:
        # Anthropic's Messages API (and OpenAI's Responses API) name them so.
        details = usage.get("input_tokens_details")
        cached = usage.get("cache_read_input_tokens")
        if cached is None and isinstance(details, dict):
            cached = details.get("cached_tokens")
        return Usage(
            prompt_tokens=_int(usage.get("input_tokens")),
            completion_tokens=_int(usage.get("output_tokens")),
            cached_tokens=_int(cached),
        )
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=_int(usage.get("prompt_tokens")),
        completion_tokens=_int(usage.get("completion_tokens")),
        cached_tokens=_int(cached),
    )


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def usage_from_sse_tail(tail: bytes) -> Usage | None:
    """The usage of the last `data: {…}` line that names one (found from the end, without
    splitting the whole tail into lines)."""
    mark = tail.rfind(USAGE_MARK)
    while mark != -1:
        start = tail.rfind(b"\n", 0, mark) + 1
        if tail.startswith(b"data: {", start):
            end = tail.find(b"\n", mark)
            try:
                return usage_from(orjson.loads(tail[start + 6 : end if end != -1 else len(tail)]))
            except orjson.JSONDecodeError:
                return None
        mark = tail.rfind(USAGE_MARK, 0, start)
    return None


NO_TOKENS: frozenset[str] = frozenset()


def connection_tokens(headers: Mapping[str, str]) -> frozenset[str]:
    """The header names a `Connection` header lists: hop-by-hop too (RFC 9110 §7.6.1)."""
    value = headers.get("Connection") or headers.get("connection")
    if not value:
        return NO_TOKENS
    return frozenset(t.strip().lower() for t in value.split(",") if t.strip())


def forward_headers(
    incoming: Mapping[str, str],
    request_id: str,
    strip_authorization: bool,
    client: str | None = None,
) -> dict[str, str]:
    """The request headers for the replica. `client`: the peer address, appended to
    `X-Forwarded-For` (and to `Forwarded` when the client sent one); the entries before it
    are the client's own word."""
    out = {}
    named = connection_tokens(incoming)
    chain: list[str] = []
    forwarded: list[str] = []
    for name, value in incoming.items():
        lower = name.lower()
        if lower in NOT_FORWARDED or lower in named:
            if lower == "x-forwarded-for":
                chain.append(value)
            elif lower == "forwarded":
                forwarded.append(value)
            continue
        if strip_authorization and lower == "authorization":
            continue
        out[name] = value
    if client:
        chain.append(client)
        out["X-Forwarded-For"] = ", ".join(chain)
        if forwarded:
            node = f'"[{client}]"' if ":" in client else client
            forwarded.append(f"for={node}")
            out["Forwarded"] = ", ".join(forwarded)
    out["X-Request-ID"] = request_id
    return out


def response_headers(upstream: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """The replica's headers the client sees: not hop-by-hop, and none that speak for the
    gateway's origin or that only the gateway may set (see `UPSTREAM_DROP`)."""
    named = connection_tokens(upstream)
    return CIMultiDict(
        [
            (name, value)
            for name, value in upstream.items()
            if not (
                (lower := name.lower()) in NOT_RELAYED
                or lower in named
                or lower.startswith("access-control-")
            )
        ]
    )


class Proxy:
    """Relays one routed request (a `RequestContext`) to its targets through a transport."""

    def __init__(
        self,
        transport: UpstreamTransport,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        outlier: OutlierDetector | None = None,
        budget: RetryBudget | None = None,
        triton: TritonTranslator | None = None,
        engines: EngineRegistry | None = None,
    ) -> None:
        self._transport = transport
        self._triton = triton
        self._engines = engines or EngineRegistry()
        self._adapted: dict[str, bool] = {}
        """Per engine name: whether its spec names the Triton adapter (looked up once)."""
        self._settings = settings
        self._metrics = metrics
        self.outlier = outlier
        self.budget = budget

    @property
    def triton(self) -> TritonTranslator:
        """How requests for Triton endpoints are translated (ChatML and estimates by default)."""
        if self._triton is None:
            self._triton = TritonTranslator()
        return self._triton

    @triton.setter
    def triton(self, translator: TritonTranslator) -> None:
        self._triton = translator

    def _adapts(self, engine: str) -> bool:
        """Whether requests to `engine` go through the Triton adapter (its spec says so)."""
        adapted = self._adapted.get(engine)
        if adapted is None:
            try:
                adapter = self._engines.get(engine).request_adapter
            except UnknownEngineError:
                adapter = None  # an endpoint's own engine label: OpenAI, as before
            if adapter not in (None, TRITON_ADAPTER):
                raise InternalError(f"engine {engine!r} names an unknown adapter {adapter!r}")
            adapted = self._adapted[engine] = adapter == TRITON_ADAPTER
        return adapted

    async def _open(
        self,
        state: EndpointState,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        base_url: str | None = None,
    ) -> UpstreamResponse:
        url = (base_url or state.endpoint.url) + path
        settings = self._settings
        try:
            return await self._transport.post(
                url,
                body,
                headers,
                settings.total_timeout_s,
                settings.connect_timeout_s,
                settings.first_byte_timeout_s,
            )
        except TimeoutError as exc:
            self._failed(state, "timeout")
            raise UpstreamTimeout(f"endpoint {state.address} did not answer in time") from exc
        except (aiohttp.ClientError, OSError) as exc:
            self._failed(state, "connect")
            raise UpstreamFailed(f"endpoint {state.address} failed: {describe(exc)}") from exc

    def _failed(self, state: EndpointState, kind: str) -> None:
        self._metrics.upstream_errors.labels(state.address, kind).inc()
        if self.outlier is not None:
            self.outlier.failure(state, kind)

    async def _may_retry(self, retry: int) -> bool:
        budget = self.budget
        if budget is None:
            return True
        if not budget.try_retry():
            self._metrics.retries.labels("budget_exhausted").inc()
            return False
        delay = budget.backoff(retry)
        if delay > 0:
            await asyncio.sleep(delay)
        return True

    async def forward(
        self,
        sink: ClientSink,
        ctx: RequestContext,
        headers: Mapping[str, str],
        route: Route | None = None,
    ) -> None:
        """Send `ctx.body` with `headers` to the decision's targets in turn (its lease follows
        the attempt), and relay the first answer that can be relayed to `sink`. Raises the
        last attempt's `GatewayError` when none could be, before `sink` has answered."""
        decision = ctx.decision
        lease = ctx.lease
        if decision is None or lease is None:
            raise InternalError("a request was forwarded before it was scheduled")
        path = ctx.record.path
        body = ctx.body
        record = ctx.record
        started = ctx.started
        extra_response_headers = ctx.response_headers
        last_error: GatewayError | None = None
        attempts = decision.targets[: self._settings.max_retries + 1]
        translated: TritonRequest | None = None
        if self.budget is not None:
            self.budget.request()
        for attempt, state in enumerate(attempts):
            if attempt and not await self._may_retry(attempt):
                break
            is_last = attempt == len(attempts) - 1
            triton: TritonRequest | None = None
            if self._adapts(state.endpoint.engine):
                if translated is None:
                    translated = self.triton.prepare(
                        path, body, headers.get("X-Request-ID", ""), state.endpoint
                    )
                triton = translated
            record.retries = attempt
            record.endpoint = state.address
            lease.move(state)
            try:
                if triton is not None:
                    triton_path, triton_body = triton.call(state.endpoint)
                    upstream = await self._open(
                        state, triton_path, _identity_encoding(headers), triton_body
                    )
                elif route is None:
                    upstream = await self._open(state, path, headers, body)
                else:
                    base_url, routed = route(state, headers)
                    upstream = await self._open(state, path, routed, body, base_url)
            except GatewayError as exc:
                last_error = exc
                if not is_last:
                    kind = "timeout" if isinstance(exc, UpstreamTimeout) else "connect"
                    self._metrics.retries.labels(kind).inc()
                continue
            try:
                failure = await self._answer(
                    sink, upstream, state, record, started, extra_response_headers, triton, is_last
                )
            except BaseException:
                upstream.close()
                raise
            if failure is None:
                upstream.release()
                return
            upstream.close()
            last_error = failure
        raise last_error or UpstreamFailed("no endpoint could be tried")

    async def _answer(
        self,
        sink: ClientSink,
        upstream: UpstreamResponse,
        state: EndpointState,
        record: AccessRecord,
        started: float,
        extra_response_headers: Mapping[str, str],
        triton: TritonRequest | None,
        is_last: bool,
    ) -> GatewayError | None:
        """Relay `upstream` to `sink`, or say why the next target should be tried (a
        try/finally around a loop's `continue` is what mypyc cannot compile)."""
        if refused_status(upstream.status):
            # Never followed (the prompt would be re-POSTed wherever the replica
            # points) nor relayed (its Location names addresses behind the gateway).
            self._failed(state, "redirect")
            return UpstreamFailed(
                f"endpoint {state.address} answered {upstream.status}; the gateway "
                "follows no redirects or protocol switches"
            )
        if upstream.status >= 500:
            self._failed(state, str(upstream.status))
        elif self.outlier is not None:
            self.outlier.success(state)
        if upstream.status in RETRY_STATUSES and not is_last:
            self._metrics.retries.labels(str(upstream.status)).inc()
            return UpstreamFailed(f"endpoint {state.address} answered {upstream.status}")
        first = b""
        if triton is None and _opens_a_stream(upstream):
            try:
                first = await self._first_content(upstream, state)
            except GatewayError as exc:
                if not is_last:
                    self._metrics.retries.labels("before_content").inc()
                return exc
        if triton is not None:
            await self._relay_triton(
                sink, upstream, state, record, started, extra_response_headers, triton
            )
        else:
            await self._relay(sink, upstream, state, record, started, extra_response_headers, first)
        return None

    async def _relay(
        self,
        sink: ClientSink,
        upstream: UpstreamResponse,
        state: EndpointState,
        record: AccessRecord,
        started: float,
        extra_headers: Mapping[str, str],
        first: bytes = b"",
    ) -> None:
        headers = response_headers(upstream.headers)
        headers[DESTINATION_HEADER] = state.address
        headers[SERVED_HEADER] = state.address
        headers.update(extra_headers)
        record.status = upstream.status
        if upstream.content_type == "text/event-stream":
            await self._relay_stream(sink, upstream, state, record, started, headers, first)
            return
        data, complete = await self._read_some(upstream, state, self._settings.max_buffered_bytes)
        record.ttft_ms = (time.monotonic() - started) * 1000.0
        if not complete:
            await self._relay_large(sink, upstream, state, record, headers, data)
            return
        if upstream.status == 404 and not _is_error_object(data):
            data = _missing_route(record, state, headers)
            record.error = "the endpoint does not serve this route"
        elif upstream.status >= 400 and not _openai_like_error(upstream, data):
            await _wrapped_error(sink, upstream, state, record, headers, data)
            return
        record.response_bytes = len(data)
        if USAGE_MARK in data:
            try:
                self._note_usage(record, usage_from(orjson.loads(data)))
            except orjson.JSONDecodeError:
                pass
        await sink.respond(upstream.status, headers.items(), data)

    async def _relay_stream(
        self,
        sink: ClientSink,
        upstream: UpstreamResponse,
        state: EndpointState,
        record: AccessRecord,
        started: float,
        headers: CIMultiDict[str],
        first: bytes = b"",
    ) -> None:
        record.stream = True
        await sink.start(upstream.status, headers.items(), None)
        stream = _Passthrough()
        last = await self._pump(upstream, state, record, started, sink, stream, first)
        if last is None:
            return
        if USAGE_MARK in stream.tail:
            self._note_usage(record, usage_from_sse_tail(stream.tail))
        await _end(sink, record, last)

    async def _pump(
        self,
        upstream: UpstreamResponse,
        state: EndpointState,
        record: AccessRecord,
        started: float,
        sink: ClientSink,
        stream: _Reframer,
        first: bytes = b"",
    ) -> bytes | None:
        """Relays the upstream body through `stream` (`first`: what was already read of it);
        None when the client left, else the bytes left to send with the end of the response
        (the upstream's last read, when it ended the body, so that both go out in one write)."""
        content = upstream.content
        try:
            if first:
                out = stream.feed(first)
                record.ttft_ms = (time.monotonic() - started) * 1000.0
                record.relayed(time.monotonic())
                if content.at_eof():
                    return out + stream.finish()
                await sink.write(out)
            async for data in content.iter_any():
                out = stream.feed(data)
                if out:
                    record.relayed(time.monotonic())
                    if record.ttft_ms is None:
                        record.ttft_ms = (time.monotonic() - started) * 1000.0
                    if content.at_eof():
                        last = out + stream.finish()
                        record.response_bytes += len(last)
                        return last
                    record.response_bytes += len(out)
                    await sink.write(out)
                if stream.ended:
                    break
            last = stream.finish()
            record.response_bytes += len(last)
            return last
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            self._midstream(state, record, exc)
            return stream.abort(UpstreamFailed(_midstream_message(state)))
        except TimeoutError as exc:
            self._midstream(state, record, exc)
            return stream.abort(UpstreamTimeout(_midstream_message(state)))
        except ConnectionResetError:
            # The client left mid-stream: stop the upstream request, no traceback.
            upstream.close()
            _client_left(record)
            return None

    async def _first_content(self, upstream: UpstreamResponse, state: EndpointState) -> bytes:
        """A stream's body up to its first `data:` line, before anything reaches the client:
        vLLM sends a stream's headers at once, so a replica that dies while prefilling fails
        here, where the request can still move to a fallback without the client seeing a
        byte twice. EOF with nothing, a cut connection or `first_byte_timeout_s` raise."""
        content = upstream.content
        try:
            ready = content.read_nowait()
            if DATA_MARK in ready:
                return ready  # the first event came with the head: no wait, no timer
            buffer = bytearray(ready)
            async with asyncio.timeout(self._settings.first_byte_timeout_s):
                while DATA_MARK not in buffer and len(buffer) < FIRST_CONTENT_LIMIT:
                    chunk = await content.readany()
                    if not chunk:
                        break
                    buffer += chunk
        except TimeoutError as exc:
            self._failed(state, "timeout")
            raise UpstreamTimeout(
                f"endpoint {state.address} sent no stream content in time"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            self._failed(state, "before_content")
            raise UpstreamFailed(
                f"endpoint {state.address} failed before its stream began: {describe(exc)}"
            ) from exc
        if not buffer:
            self._failed(state, "before_content")
            raise UpstreamFailed(f"endpoint {state.address} ended its stream empty")
        return bytes(buffer)

    async def _read_some(
        self, upstream: UpstreamResponse, state: EndpointState, limit: int
    ) -> tuple[bytes, bool]:
        """The body up to just over `limit` bytes, and whether that was all of it."""
        chunks: list[bytes] = []
        size = 0
        content = upstream.content
        try:
            data = content.read_nowait()
            if data:
                if content.at_eof() and len(data) <= limit:
                    return data, True  # the whole body came with the head: no reads to await
                chunks.append(data)
                size = len(data)
                if size > limit:
                    return data, False
            while True:
                chunk = await content.readany()
                if not chunk:
                    return b"".join(chunks), True
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    return b"".join(chunks), False
        except (aiohttp.ClientError, OSError) as exc:
            self._failed(state, "body")
            raise UpstreamFailed(f"endpoint {state.address} broke off its answer") from exc
        except TimeoutError as exc:
            self._failed(state, "timeout")
            raise UpstreamTimeout(f"endpoint {state.address} did not finish in time") from exc

    async def _relay_large(
        self,
        sink: ClientSink,
        upstream: UpstreamResponse,
        state: EndpointState,
        record: AccessRecord,
        headers: CIMultiDict[str],
        head: bytes,
    ) -> None:
        """A body over `max_buffered_bytes`: what was read, then the rest as it comes, so the
        gateway never holds more than one chunk of it (its usage is not read)."""
        await sink.start(upstream.status, headers.items(), upstream.content_length)
        try:
            await sink.write(head)
            async for data in upstream.content.iter_any():
                await sink.write(data)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, TimeoutError) as exc:
            # Headers are gone: the only honest signal left is a cut connection.
            self._midstream(state, record, exc)
            sink.abort()
            return
        except ConnectionResetError:
            upstream.close()
            _client_left(record)
            return
        await _end(sink, record, b"")

    async def _read(self, upstream: UpstreamResponse, state: EndpointState) -> bytes:
        limit = self._settings.max_buffered_bytes
        data, complete = await self._read_some(upstream, state, limit)
        if not complete:
            self._failed(state, "too_large")
            raise UpstreamFailed(
                f"endpoint {state.address} answered with more than {limit} bytes, "
                "which this answer would have to hold in memory"
            )
        return data

    async def _relay_triton(
        self,
        sink: ClientSink,
        upstream: UpstreamResponse,
        state: EndpointState,
        record: AccessRecord,
        started: float,
        extra_headers: Mapping[str, str],
        request: TritonRequest,
    ) -> None:
        headers: CIMultiDict[str] = CIMultiDict()
        headers[DESTINATION_HEADER] = state.address
        headers[SERVED_HEADER] = state.address
        headers.update(extra_headers)
        endpoint = state.endpoint
        if upstream.status != 200:
            error = triton_error(upstream.status, await self._read(upstream, state), endpoint)
            record.status = error.status
            record.error = error.message
            headers["Content-Type"] = "application/json"
            await sink.respond(error.status, headers.items(), render_error(error))
            return
        if upstream.content_type == "text/event-stream":
            await self._relay_triton_stream(
                sink, upstream, state, record, started, headers, request
            )
            return
        data = await self._read(upstream, state)
        record.ttft_ms = (time.monotonic() - started) * 1000.0
        try:
            body, usage = completion_response(request, endpoint, data)
        except GatewayError:
            self._failed(state, "invalid")
            raise
        record.status = 200
        record.prompt_tokens = usage.prompt_tokens
        record.completion_tokens = usage.completion_tokens
        record.response_bytes = len(body)
        headers["Content-Type"] = "application/json"
        await sink.respond(200, headers.items(), body)

    async def _relay_triton_stream(
        self,
        sink: ClientSink,
        upstream: UpstreamResponse,
        state: EndpointState,
        record: AccessRecord,
        started: float,
        headers: CIMultiDict[str],
        request: TritonRequest,
    ) -> None:
        record.stream = True
        record.status = 200
        headers["Content-Type"] = "text/event-stream"
        headers["Cache-Control"] = "no-cache"
        await sink.start(200, headers.items(), None)
        endpoint = state.endpoint
        stream = TritonStream(request, request.max_tokens_for(endpoint), accumulates(endpoint))
        last = await self._pump(upstream, state, record, started, sink, stream)
        if last is None:
            return
        if stream.error is not None:
            self._failed(state, "midstream")
            record.error = f"midstream: {stream.error}"
        if stream.usage is not None:
            record.prompt_tokens = stream.usage.prompt_tokens
            record.completion_tokens = stream.usage.completion_tokens
        await _end(sink, record, last)

    def _midstream(self, state: EndpointState, record: AccessRecord, exc: BaseException) -> None:
        self._failed(state, "midstream")
        record.error = f"midstream: {describe(exc)}"

    @staticmethod
    def _note_usage(record: AccessRecord, usage: Usage | None) -> None:
        if usage is None:
            return
        record.prompt_tokens = usage.prompt_tokens
        record.completion_tokens = usage.completion_tokens
        record.cached_tokens = usage.cached_tokens


class _Reframer(Protocol):
    """What the relay writes for the upstream body: re-framed (Triton) or as it is."""

    @property
    def ended(self) -> bool: ...

    def feed(self, data: bytes) -> bytes: ...

    def finish(self) -> bytes: ...

    def abort(self, exc: GatewayError) -> bytes: ...


class _Passthrough:
    """The bytes as they come; the last `TAIL_BYTES` or more kept for the usage chunk."""

    __slots__ = ("tail",)
    ended = False

    def __init__(self) -> None:
        self.tail = b""

    def feed(self, data: bytes) -> bytes:
        self.tail = data if len(data) >= TAIL_BYTES else self.tail[-TAIL_BYTES:] + data
        return data

    def finish(self) -> bytes:
        return b""

    def abort(self, exc: GatewayError) -> bytes:
        return sse_error_event(exc)


async def _end(sink: ClientSink, record: AccessRecord, last: bytes) -> None:
    try:
        await sink.end(last)
    except ConnectionResetError:
        if last:
            _client_left(record)
        else:
            record.error = "client disconnected before the end of the stream"


def _client_left(record: AccessRecord) -> None:
    record.status = 499
    record.error = "client disconnected"


def _opens_a_stream(upstream: UpstreamResponse) -> bool:
    return upstream.status < 300 and upstream.content_type == "text/event-stream"


def _openai_like_error(upstream: UpstreamResponse, data: bytes) -> bool:
    """A JSON object (vLLM's `{"error": …}` or its flat `{"object": "error", …}`), or a
    compressed body the gateway cannot look into: relayed as it is."""
    encoding = upstream.headers.get("Content-Encoding", "identity").lower()
    if encoding not in ("", "identity"):
        return True
    try:
        return isinstance(orjson.loads(data), dict)
    except orjson.JSONDecodeError:
        return False


async def _wrapped_error(
    sink: ClientSink,
    upstream: UpstreamResponse,
    state: EndpointState,
    record: AccessRecord,
    headers: CIMultiDict[str],
    data: bytes,
) -> None:
    """A replica's error that is not JSON (a `text/plain` 500, an HTML page from a proxy in
    front of it) as an OpenAI error body with the same status."""
    text = " ".join(data.decode("utf-8", errors="replace").split())
    message = f"endpoint {state.address} answered {upstream.status}"
    if text:
        message += f": {clip(text)}"
    error = for_status(upstream.status, message, "upstream_error")
    record.error = message
    for name in ("Content-Type", "Content-Encoding", "Content-Length"):
        headers.popall(name, None)
    await send_error(sink, error, headers)


def _identity_encoding(headers: Mapping[str, str]) -> dict[str, str]:
    """Translated answers must be read, so they must not come compressed."""
    return {k: v for k, v in headers.items() if k.lower() != "accept-encoding"}


def _is_error_object(data: bytes) -> bool:
    """The body is an error the client can read as one (`{"error": {...}}`, OpenAI's and
    Anthropic's shape), rather than a web framework's bare 404 for a route it lacks."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(obj, dict):
        return False
    return isinstance(obj.get("error"), dict) or obj.get("object") == "error"


def _missing_route(record: AccessRecord, state: EndpointState, headers: CIMultiDict[str]) -> bytes:
    """An OpenAI 404 in place of the replica's own: the route exists at the gateway, not there."""
    error = NotFound(f"endpoint {state.address} does not serve {record.method} {record.path}")
    headers.popall("Content-Encoding", None)
    headers["Content-Type"] = "application/json"
    return error_body(error.message, error.type, error.code, error.param)


def _midstream_message(state: EndpointState) -> str:
    return f"endpoint {state.address} failed while streaming; the response is incomplete"
