"""Carrying out a prefill/decode decision: the sidecar header, or both legs run by the gateway.

The scheduler (`scheduling/disagg.py`) picks a decode endpoint and, when the
decider wants one, a prefill endpoint. Two ways to use them (PROTOCOLS.md §6):

- **sidecar** (llm-d): the request goes to the decode endpoint unchanged, with
  `x-prefiller-host-port: ip:port`; the decode pod's routing sidecar runs the
  prefill leg. Nothing else differs from a plain request.
- **gateway** (vLLM's NIXL connector, no sidecar): the gateway first sends the
  request to the prefill endpoint with `kv_transfer_params` asking for a remote
  decode, `stream: false` and one output token; the prefill replica answers with
  the parameters that locate its KV blocks; the original request plus those
  parameters then goes to the decode endpoint, whose answer is relayed (with the
  proxy's retries and streaming). A prefill leg that fails in any way (no
  connection, timeout, an error status, no `kv_transfer_params`) is counted and
  the original request goes to the decode endpoint alone, which then prefills
  itself: the client never sees the failure.

Data parallelism behind a sidecar (`Decision.primary_port`): each attempt goes to
the target's host on the primary port, naming the rank in `x-data-parallel-host-port`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import orjson

from servegate.config import DisaggregationSettings, GatewaySettings
from servegate.control.context import RequestContext
from servegate.control.sink import ClientSink
from servegate.control.upstream import sidecar_headers as sidecar_headers
from servegate.datalayer.scraper import TOO_LARGE, FetchError
from servegate.gateway.access_log import AccessRecord
from servegate.gateway.errors import InternalError, describe
from servegate.gateway.metrics import GatewayMetrics
from servegate.gateway.proxy import Proxy, Route
from servegate.gateway.transport import UpstreamResponse, UpstreamTransport
from servegate.gateway.triton import TRITON_ENGINE
from servegate.pool.endpoint import EndpointState
from servegate.pool.pool import Pool
from servegate.scheduling.disagg import (
    DATA_PARALLEL_HEADER,
    DATA_PARALLEL_RANK_HEADER,
    ENCODERS_HEADER,
    PREFILLER_HEADER,
    least_loaded_rank,
)
from servegate.scheduling.framework import Decision, Plugin
from servegate.scheduling.request import LLMRequest

Mode = Literal["sidecar", "gateway"]

REMOTE_DECODE_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""The prefill leg's `kv_transfer_params` (vLLM's NIXL connector)."""
PREFILL_ANSWER_LIMIT = 1024 * 1024
"""The prefill leg's answer is one token and `kv_transfer_params`; a longer one is refused."""
ONE_TOKEN_FIELDS = ("max_completion_tokens", "min_tokens")
"""Set to 1 on the prefill leg when present; `max_tokens` is always set to 1."""


def resolve_mode(settings: DisaggregationSettings, plugins: Mapping[str, Plugin]) -> Mode:
    """`auto` → sidecar, llm-d's protocol: its current `disagg-profile-handler` sets
    `x-prefiller-host-port` itself, with or without the older `disagg-headers-handler`.
    The gateway-run NIXL legs only when `mode: gateway` says so."""
    if settings.mode == "gateway":
        return "gateway"
    return "sidecar"


def prefill_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: the request asking for a remote decode, one token, not streamed."""
    out = dict(body)
    out["kv_transfer_params"] = dict(REMOTE_DECODE_PARAMS)
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    for key in ONE_TOKEN_FIELDS:
        if key in out:
            out[key] = 1
    return out


def decode_request(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode leg's body: the original request plus the prefill leg's `kv_transfer_params`."""
    return {**body, "kv_transfer_params": dict(params)}


def data_parallel_route(primary_port: int) -> Route:
    """Send each attempt to its rank's host on `primary_port`, naming the rank in a header."""

    def route(state: EndpointState, headers: Mapping[str, str]) -> tuple[str, Mapping[str, str]]:
        parts = urlsplit(state.endpoint.url)
        host = parts.hostname or state.endpoint.host
        if ":" in host:
            host = f"[{host}]"
        base = f"{parts.scheme}://{host}:{primary_port}{parts.path}"
        return base, {**headers, DATA_PARALLEL_HEADER: state.address}

    return route


def rank_header_route(
    state: EndpointState, headers: Mapping[str, str]
) -> tuple[str, Mapping[str, str]]:
    """Each attempt to its endpoint's own URL, naming its least-loaded data-parallel rank."""
    rank = least_loaded_rank(state)
    if rank is None:
        return state.endpoint.url, headers
    return state.endpoint.url, {**headers, DATA_PARALLEL_RANK_HEADER: str(rank)}


class PrefillFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class Disaggregator:
    """Runs decisions of a P/D or data-parallel profile handler on top of the `Proxy`."""

    def __init__(
        self,
        mode: Mode,
        proxy: Proxy,
        transport: UpstreamTransport,
        pool: Pool,
        metrics: GatewayMetrics,
        gateway: GatewaySettings,
        settings: DisaggregationSettings,
    ) -> None:
        self.mode: Mode = mode
        self._proxy = proxy
        self._transport = transport
        self._pool = pool
        self._metrics = metrics
        self._timeout_s = settings.prefill_timeout_s or gateway.first_byte_timeout_s
        self._connect_s = gateway.connect_timeout_s

    @staticmethod
    def handles(decision: Decision) -> bool:
        return (
            decision.pd_decision is not None
            or decision.primary_port is not None
            or decision.rank_header
        )

    async def forward(
        self, sink: ClientSink, ctx: RequestContext, headers: Mapping[str, str]
    ) -> None:
        """Carry out `ctx.decision` (the Director counted its P/D decision): the sidecar's
        headers or the gateway-run prefill leg, then the decode leg through the proxy to
        `sink`."""
        decision, llm, record = ctx.decision, ctx.llm, ctx.record
        if decision is None or llm is None:
            raise InternalError("a request was forwarded before it was scheduled")
        path = record.path
        prefill = decision.prefill
        if prefill is not None and TRITON_ENGINE in (
            prefill.endpoint.engine,
            decision.endpoint.endpoint.engine,
        ):
            record.prefill_error = "P/D disaggregation does not support Triton endpoints"
            self._metrics.disagg_fallbacks.labels("unsupported_engine").inc()
            prefill = None
        if prefill is not None:
            record.prefill_endpoint = prefill.address
            if self.mode == "sidecar":
                headers = {**headers, PREFILLER_HEADER: prefill.address}
            else:
                try:
                    params = await self._prefill(prefill, path, llm, headers, record)
                except PrefillFailed as exc:
                    record.prefill_error = str(exc)
                    self._metrics.disagg_fallbacks.labels(exc.reason).inc()
                else:
                    ctx.body = orjson.dumps(decode_request(llm.body, params))
        if decision.encoders and self.mode == "sidecar":
            headers = {**headers, ENCODERS_HEADER: ",".join(s.address for s in decision.encoders)}
        route: Route | None = None
        if decision.primary_port is not None:
            route = data_parallel_route(decision.primary_port)
        elif decision.rank_header:
            route = rank_header_route
        await self._proxy.forward(sink, ctx, headers, route)

    async def _prefill(
        self,
        state: EndpointState,
        path: str,
        llm: LLMRequest,
        headers: Mapping[str, str],
        record: AccessRecord,
    ) -> dict[str, Any]:
        body = orjson.dumps(prefill_request(llm.body))
        tokens = llm.prompt_tokens + 1
        self._pool.acquire(state, tokens)
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self._timeout_s):
                response = await self._transport.post(
                    state.endpoint.url + path, body, headers, None, self._connect_s
                )
                try:
                    record.prefill_status = response.status
                    data = await _read_limited(response, PREFILL_ANSWER_LIMIT)
                finally:
                    response.release()
        except TimeoutError as exc:
            self._failed(state, "timeout")
            raise PrefillFailed(
                "timeout", f"prefill {state.address}: no answer in {self._timeout_s:g} s"
            ) from exc
        except FetchError as exc:
            self._failed(state, "too_large")
            raise PrefillFailed("bad-response", f"prefill {state.address}: {exc}") from exc
        except (aiohttp.ClientError, OSError) as exc:
            self._failed(state, "connect")
            raise PrefillFailed(
                "connect", f"prefill {state.address} failed: {describe(exc)}"
            ) from exc
        finally:
            self._pool.release(state, tokens)
            record.prefill_ms = (time.monotonic() - t0) * 1000.0
        status = response.status
        if status >= 500:
            self._failed(state, str(status))
        elif self._proxy.outlier is not None:
            self._proxy.outlier.success(state)
        if status != 200:
            raise PrefillFailed("status", f"prefill {state.address} answered {status}")
        try:
            answer = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise PrefillFailed("bad-response", f"prefill {state.address}: not JSON") from exc
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            raise PrefillFailed(
                "bad-response", f"prefill {state.address}: no kv_transfer_params in its answer"
            )
        return params

    def _failed(self, state: EndpointState, kind: str) -> None:
        self._metrics.upstream_errors.labels(state.address, kind).inc()
        if self._proxy.outlier is not None:
            self._proxy.outlier.failure(state, kind)


def build_disaggregator(
    gateway: GatewaySettings,
    settings: DisaggregationSettings,
    plugins: Mapping[str, Plugin],
    proxy: Proxy,
    transport: UpstreamTransport,
    pool: Pool,
    metrics: GatewayMetrics,
) -> Disaggregator:
    return Disaggregator(
        resolve_mode(settings, plugins), proxy, transport, pool, metrics, gateway, settings
    )


async def _read_limited(response: UpstreamResponse, limit: int) -> bytes:
    """The body, or `FetchError(too_large)` as soon as it exceeds `limit` bytes."""
    length = response.content_length
    if length is not None and length > limit:
        raise FetchError(TOO_LARGE, f"Content-Length {length} > {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise FetchError(TOO_LARGE, f"body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
