"""The proxy's retry policy, first-byte timeout and mid-stream handling, through the
in-memory transport (`servegate.testing.transport`): no sockets on either side."""

from __future__ import annotations

import io
import time
from typing import Any

import orjson
import pytest

from servegate.config import parse_config
from servegate.control.context import RequestContext
from servegate.gateway.app import Gateway, build_gateway
from servegate.gateway.errors import GatewayError
from servegate.pool.endpoint import EndpointMetrics
from servegate.scheduling.request import RequestKind
from servegate.testing.sink import RecordingSink
from servegate.testing.transport import JSON, SSE, InMemoryTransport, Reply

PRIMARY, FALLBACK = "10.0.0.1:8000", "10.0.0.2:8000"
CHAT = "/v1/chat/completions"
PICKER = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
}
"""The queue scorer alone: PRIMARY (nothing waiting) ranks before FALLBACK (5 waiting)."""
ANSWER = b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}'
EVENT = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'


def gateway(transport: InMemoryTransport) -> Gateway:
    cfg: dict[str, Any] = {
        "gateway": {"seed": 1, "max_retries": 1, "first_byte_timeout_s": 0.2},
        "retries": {"backoff_base_s": 0.0, "backoff_max_s": 0.0},
        "outlier_detection": {"enabled": False},
        "pool": {"endpoints": [{"url": f"http://{a}", "model": "m"} for a in (PRIMARY, FALLBACK)]},
        "picker": PICKER,
    }
    config = parse_config("", "<test>", environ={}, overrides=cfg)
    gw = build_gateway(config, None, io.BytesIO(), transport)
    now = time.monotonic()
    for address, waiting in ((PRIMARY, 0.0), (FALLBACK, 5.0)):
        gw.pool.set_health(address, True)
        gw.pool.set_metrics(address, EndpointMetrics(waiting=waiting, scraped_at=now))
    return gw


async def send(
    gw: Gateway, stream: bool = False, sink: RecordingSink | None = None
) -> tuple[RequestContext, RecordingSink | GatewayError]:
    """One chat request through the Director and the proxy, finished like the HTTP adapter."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    director, sink = gw.director, sink or RecordingSink()
    ctx = director.begin("r-1", "POST", CHAT, {}, time.monotonic())
    runtime, _ = await director.route(ctx, orjson.dumps(body), RequestKind.CHAT, None)
    answer: RecordingSink | GatewayError
    try:
        await runtime.proxy.forward(sink, ctx, {"X-Request-ID": "r-1"})
        director.complete(ctx)
        answer = sink
    except GatewayError as exc:
        director.fail(ctx, exc)
        answer = exc
    director.finish(ctx)
    return ctx, answer


def retries(gw: Gateway, kind: str) -> float:
    value = gw.metrics.registry.get_sample_value(
        "servegate_upstream_retries_total", {"reason": kind}
    )
    return value or 0.0


def idle(gw: Gateway) -> bool:
    return all(s.in_flight_requests == 0 and s.in_flight_tokens == 0 for s in gw.pool)


@pytest.mark.parametrize(
    ("primary", "reason"),
    [
        pytest.param(Reply(status=503), "503", id="503"),
        pytest.param(Reply(status=502), "502", id="502"),
        pytest.param(Reply(refuse=True), "connect", id="refused"),
        pytest.param(Reply(delay_s=1.0), "timeout", id="first-byte-timeout"),
        pytest.param(Reply(headers=SSE, chunks=(), cut_after=0), "before_content", id="cut-before-data"),
        pytest.param(Reply(status=302), None, id="redirect-is-not-followed"),
    ],
)  # fmt: skip
async def test_a_failure_before_the_first_byte_moves_to_the_fallback(
    primary: Reply, reason: str | None
) -> None:
    transport = InMemoryTransport({PRIMARY: primary, FALLBACK: Reply(chunks=(ANSWER,))})
    gw = gateway(transport)
    ctx, answer = await send(gw)
    assert isinstance(answer, RecordingSink) and not answer.streamed
    assert (answer.status, answer.body) == (200, ANSWER)
    assert [s.address for s in transport.sent] == [PRIMARY, FALLBACK]
    assert (ctx.record.endpoint, ctx.record.retries, ctx.record.status) == (FALLBACK, 1, 200)
    assert answer.headers["x-gateway-destination-endpoint-served"] == FALLBACK
    if reason is not None:
        assert retries(gw, reason) == 1
    assert all(r.closed for r in transport.responses[:-1])  # the failed answers were dropped
    assert transport.responses[-1].released
    assert idle(gw)


async def test_the_last_attempt_failing_is_the_clients_error() -> None:
    transport = InMemoryTransport({PRIMARY: Reply(refuse=True), FALLBACK: Reply(delay_s=1.0)})
    gw = gateway(transport)
    ctx, answer = await send(gw)
    assert isinstance(answer, GatewayError)
    assert (answer.status, answer.code) == (504, "upstream_timeout")
    assert ctx.record.status == 504
    assert len(transport.sent) == 2
    assert idle(gw)


async def test_a_503_on_the_last_attempt_is_relayed() -> None:
    error = b'{"error": {"message": "overloaded"}}'
    transport = InMemoryTransport({PRIMARY: Reply(status=503), FALLBACK: Reply(503, (error,))})
    gw = gateway(transport)
    _, answer = await send(gw)
    assert isinstance(answer, RecordingSink) and not answer.streamed
    assert (answer.status, answer.body) == (503, error)


async def test_a_midstream_failure_ends_the_stream_with_an_error_event_and_no_retry() -> None:
    primary = Reply(headers=SSE, chunks=(EVENT, EVENT, EVENT), cut_after=2)
    transport = InMemoryTransport({PRIMARY: primary, FALLBACK: Reply(chunks=(ANSWER,))})
    gw = gateway(transport)
    ctx, answer = await send(gw, stream=True)
    assert isinstance(answer, RecordingSink) and answer.streamed and answer.status == 200
    assert [s.address for s in transport.sent] == [PRIMARY]  # bytes reached the client
    written = answer.body
    assert written.startswith(EVENT + EVENT)
    (last,) = [line for line in written.split(b"\n\n") if b'"error"' in line]
    assert orjson.loads(last[len(b"data: ") :])["error"]["code"] == "upstream_failed"
    assert (ctx.record.error or "").startswith("midstream: ")
    errors = {"endpoint": PRIMARY, "kind": "midstream"}
    assert gw.metrics.registry.get_sample_value("servegate_upstream_errors_total", errors) == 1
    assert idle(gw)


async def test_a_stream_relays_every_event_and_counts_on_the_serving_endpoint() -> None:
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
    chunks = (EVENT, usage, b"data: [DONE]\n\n")
    transport = InMemoryTransport({PRIMARY: Reply(headers=SSE, chunks=chunks)})
    gw = gateway(transport)
    state = gw.pool.get(PRIMARY)
    assert state is not None
    picks = state.picks
    ctx, answer = await send(gw, stream=True)
    assert isinstance(answer, RecordingSink) and answer.streamed and answer.ended
    assert answer.body == b"".join(chunks)
    assert (ctx.record.prompt_tokens, ctx.record.completion_tokens) == (3, 2)
    assert state.picks == picks + 1  # one count for the pick, none added by the attempt
    assert idle(gw)


async def test_the_json_content_type_reaches_the_client() -> None:
    transport = InMemoryTransport({PRIMARY: Reply(headers=JSON, chunks=(ANSWER,))})
    _, answer = await send(gateway(transport))
    assert isinstance(answer, RecordingSink) and not answer.streamed
    assert answer.headers["Content-Type"] == "application/json"


async def test_a_client_leaving_mid_stream_stops_the_upstream_request() -> None:
    chunks = (EVENT, EVENT, EVENT, b"data: [DONE]\n\n")
    transport = InMemoryTransport({PRIMARY: Reply(headers=SSE, chunks=chunks)})
    gw = gateway(transport)
    ctx, answer = await send(gw, stream=True, sink=RecordingSink(leave_after=1))
    assert isinstance(answer, RecordingSink) and not answer.ended
    assert answer.body == EVENT
    assert (ctx.record.status, ctx.record.error) == (499, "client disconnected")
    assert transport.responses[-1].closed
    assert idle(gw)
