"""The picker's side of one ext_proc stream, fed the message sequences Envoy sends (no gRPC)."""

from __future__ import annotations

import io
import time
from typing import Any

import orjson
import pytest

from servegate.config import parse_config
from servegate.extproc import client as proxy
from servegate.extproc.client import RequestAnswer, decode_request_answer
from servegate.extproc.protocol import BODY_CHUNK_BYTES, Message
from servegate.extproc.stream import ExtProcStream
from servegate.gateway.app import Gateway, build_gateway
from servegate.pool.endpoint import EndpointMetrics

MODEL = "m"
ADDRESSES = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
CHAT_PATH = "/v1/chat/completions"


PICKER = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "active-request-scorer"},
        {"type": "max-score-picker"},
    ],
}
"""Pinned here (not the changing default profile) so the expected rankings stay arithmetic."""


def make_gateway(queues: tuple[float, ...] = (0.0, 0.0, 0.0), **extra: Any) -> Gateway:
    cfg: dict[str, Any] = {
        "gateway": {"seed": 7, "max_retries": 2},
        "pool": {
            "endpoints": [{"url": f"http://{a}", "model": MODEL} for a in ADDRESSES],
            "health": {"interval_s": 1.0},
        },
        "picker": PICKER,
        **extra,
    }
    gw = build_gateway(parse_config("", "<test>", environ={}, overrides=cfg), None, io.BytesIO())
    now = time.monotonic()
    for address, waiting in zip(ADDRESSES, queues, strict=False):
        gw.pool.set_health(address, True)
        gw.pool.set_metrics(address, EndpointMetrics(waiting=waiting, scraped_at=now))
    return gw


def chat_body(**extra: Any) -> bytes:
    return orjson.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    )


def headers(path: str = CHAT_PATH, method: str = "POST", **extra: str) -> list[tuple[str, str]]:
    return [(":method", method), (":path", path), (":authority", "gw"), *extra.items()]


async def feed(stream: ExtProcStream, messages: list[Message]) -> list[Message]:
    out: list[Message] = []
    for message in messages:
        out.extend(await stream.handle(message))
        if stream.finished:
            break
    return out


async def send_request(
    stream: ExtProcStream,
    body: bytes,
    chunk: int = 7,
    subset: list[str] | None = None,
    extra_headers: dict[str, str] | None = None,
) -> RequestAnswer:
    parts = proxy.chunks(body, chunk)
    messages = [proxy.request_headers(headers(**(extra_headers or {})), subset=subset)]
    messages += [proxy.request_body(p, i == len(parts) - 1) for i, p in enumerate(parts)]
    return decode_request_answer(await feed(stream, messages))


async def send_buffered(
    stream: ExtProcStream, body: bytes, subset: list[str] | None = None
) -> tuple[Message, RequestAnswer]:
    """deploy/extproc/envoy-buffered.yaml's modes: (the answer to the headers, the answer to the body)."""
    buffered = proxy.request_headers(headers(), subset=subset, body_mode=2, response_body_mode=0)
    (first,) = await feed(stream, [buffered])
    answers = await feed(stream, [proxy.request_body(body, True)])
    return first, decode_request_answer(answers, sent_body=body)


async def test_non_streaming_request_answers_headers_then_body_then_passes_the_response() -> None:
    gw = make_gateway(queues=(3.0, 0.0, 1.0))
    stream = ExtProcStream(gw)
    body = chat_body()
    answer = await send_request(stream, body)
    # queue-scorer: (maxQ − q)/(maxQ − minQ) → .2: 1, .3: 2/3, .1: 0; kv and active tie → .2, .3, .1
    assert answer.kinds == ["request_headers", "request_body"]
    assert answer.endpoints == ["10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.1:8000"]
    assert answer.metadata_destination == answer.destination
    assert answer.clear_route_cache
    assert answer.set_headers["content-length"] == str(len(body))
    assert (answer.body, answer.body_end_of_stream) == (body, True)
    assert "x-gateway-destination-endpoint-subset" in answer.removed_headers
    primary = gw.pool.get("10.0.0.2:8000")
    assert primary is not None
    assert primary.in_flight_requests == 1
    response = orjson.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 4}})
    out = await feed(
        stream,
        [
            proxy.response_headers([(":status", "200"), ("content-type", "application/json")]),
            proxy.response_body(response[:10], False),
            proxy.response_body(response[10:], True),
        ],
    )
    assert [m.WhichOneof("response") for m in out] == ["response_headers", *["response_body"] * 2]
    echoed = b"".join(
        m.response_body.response.body_mutation.streamed_response.body for m in out[1:]
    )
    assert echoed == response
    assert proxy.response_header_mutation(out[0])["x-gateway-destination-endpoint"] == (
        "10.0.0.2:8000"
    )
    assert primary.in_flight_requests == 0
    stream.close()
    assert stream.record is not None
    assert (stream.record.status, stream.record.prompt_tokens) == (200, 3)
    assert stream.record.completion_tokens == 4


async def test_streaming_response_chunks_pass_one_for_one_and_usage_is_read() -> None:
    gw = make_gateway()
    stream = ExtProcStream(gw)
    await send_request(stream, chat_body(stream=True))
    events = [
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n',
        b"data: [DONE]\n\n",
    ]
    sse = [("content-type", "text/event-stream"), (":status", "200")]
    messages = [proxy.response_headers(sse)]
    messages += [proxy.response_body(e, i == len(events) - 1) for i, e in enumerate(events)]
    messages.append(proxy.response_trailers([("grpc-status", "0")]))
    out = await feed(stream, messages)
    kinds = [m.WhichOneof("response") for m in out]
    assert kinds == ["response_headers", *["response_body"] * 3, "response_trailers"]
    streamed = [m.response_body.response.body_mutation.streamed_response for m in out[1:4]]
    assert [s.body for s in streamed] == events
    assert [s.end_of_stream for s in streamed] == [False, False, True]
    stream.close()
    assert stream.record is not None
    assert (stream.record.stream, stream.record.completion_tokens) == (True, 2)
    assert stream.record.ttft_ms is not None


async def test_body_larger_than_a_chunk_goes_back_in_62000_byte_pieces() -> None:
    gw = make_gateway()
    stream = ExtProcStream(gw)
    body = chat_body(padding="x" * 130_000)
    answer = await send_request(stream, body, chunk=16_384)
    # ceil(len/62000) pieces: the body is 130_000 + ~80 bytes → 3
    assert answer.body_chunks == -(-len(body) // BODY_CHUNK_BYTES) == 3
    assert answer.body == body


async def test_request_trailers_end_the_body_and_are_answered_last() -> None:
    gw = make_gateway()
    stream = ExtProcStream(gw)
    body = chat_body()
    messages = [
        proxy.request_headers(headers()),
        proxy.request_body(body, False),
        proxy.request_trailers([("x-trailer", "1")]),
    ]
    answer = decode_request_answer(await feed(stream, messages))
    assert answer.kinds == ["request_headers", "request_body", "request_trailers"]
    assert (answer.body, answer.body_end_of_stream) == (body, False)


@pytest.mark.parametrize("body_mode", [4, 2], ids=["full-duplex", "buffered"])
async def test_headers_only_request_goes_to_any_endpoint_without_a_body_answer(
    body_mode: int,
) -> None:
    gw = make_gateway()
    stream = ExtProcStream(gw)
    message = proxy.request_headers(
        headers("/v1/models", "GET"), end_of_stream=True, body_mode=body_mode
    )
    answer = decode_request_answer(await feed(stream, [message]))
    assert answer.kinds == ["request_headers"]
    assert answer.destination in ADDRESSES
    assert "content-length" not in answer.set_headers


@pytest.mark.parametrize(
    ("subset", "expected"),
    [
        pytest.param(["10.0.0.3:8000"], ["10.0.0.3:8000"], id="one-allowed"),
        pytest.param(
            ["10.0.0.3:8000", "10.0.0.1:8000"],
            ["10.0.0.1:8000", "10.0.0.3:8000"],
            id="two-allowed-ranked-by-queue",
        ),
        pytest.param(["10.0.0.2"], ["10.0.0.2:8000"], id="bare-ip-matches-its-ports"),
    ],
)
async def test_subset_hint_limits_the_candidates(subset: list[str], expected: list[str]) -> None:
    gw = make_gateway(queues=(0.0, 0.0, 5.0))
    answer = await send_request(ExtProcStream(gw), chat_body(), subset=subset)
    assert answer.endpoints == expected


@pytest.mark.parametrize(
    ("case", "status", "reason"),
    [
        pytest.param("empty-subset", 503, "rejected-no-endpoints", id="empty-subset"),
        pytest.param("subset-outside-pool", 503, "rejected-no-endpoints", id="subset-outside"),
        pytest.param("empty-pool", 503, "rejected-no-endpoints", id="empty-pool"),
        pytest.param("unknown-model", 404, None, id="unknown-model"),
        pytest.param("bad-json", 400, None, id="bad-json"),
        pytest.param("too-large", 413, None, id="too-large"),
        pytest.param("no-api-key", 401, None, id="no-api-key"),
    ],
)
@pytest.mark.parametrize("buffered", [False, True], ids=["full-duplex", "buffered"])
async def test_unroutable_requests_get_an_immediate_response(
    case: str, status: int, reason: str | None, buffered: bool
) -> None:
    extra: dict[str, Any] = {}
    if case == "no-api-key":
        extra = {"gateway": {"seed": 7, "api_keys": ["k"]}}
    if case == "too-large":
        extra = {"gateway": {"seed": 7, "max_body_bytes": 64}}
    gw = make_gateway(**extra)
    if case == "empty-pool":
        for address in ADDRESSES:
            gw.pool.set_health(address, False)
    body = {"unknown-model": chat_body(model="nope"), "bad-json": b"{not json"}.get(
        case, chat_body(pad="x" * 100) if case == "too-large" else chat_body()
    )
    subset = {"empty-subset": [], "subset-outside-pool": ["10.9.9.9:8000"]}.get(case)
    stream = ExtProcStream(gw)
    if buffered:
        _, answer = await send_buffered(stream, body, subset=subset)
    else:
        answer = await send_request(stream, body, subset=subset)
    assert stream.finished
    assert answer.kinds == ["immediate_response"]
    assert answer.immediate_status == status
    assert answer.immediate_headers.get("x-llm-d-request-dropped-reason") == reason
    assert orjson.loads(answer.immediate_body)["error"]["message"]
    stream.close()
    assert stream.record is not None
    assert stream.record.status == status
    assert all(s.in_flight_requests == 0 for s in gw.pool)


async def test_a_fallback_that_served_takes_over_the_in_flight_count() -> None:
    gw = make_gateway(queues=(0.0, 1.0, 2.0))
    stream = ExtProcStream(gw)
    answer = await send_request(stream, chat_body())
    primary, fallback = (gw.pool.get(a) for a in answer.endpoints[:2])
    assert primary is not None and fallback is not None
    assert (primary.in_flight_requests, fallback.in_flight_requests) == (1, 0)
    served = proxy.response_headers([(":status", "200")], served=fallback.address)
    out = await feed(stream, [served])
    assert (primary.in_flight_requests, fallback.in_flight_requests) == (0, 1)
    assert proxy.response_header_mutation(out[0])["x-gateway-destination-endpoint"] == (
        fallback.address
    )
    stream.close()
    assert fallback.in_flight_requests == 0
    assert stream.record is not None
    assert (stream.record.retries, stream.record.status) == (1, 200)
    assert stream.record.error == "stream ended before the response did"


async def test_a_stream_that_breaks_off_releases_its_endpoint() -> None:
    gw = make_gateway()
    stream = ExtProcStream(gw)
    answer = await send_request(stream, chat_body())
    state = gw.pool.get(answer.endpoints[0])
    assert state is not None
    assert (state.in_flight_requests, state.in_flight_tokens) > (0, 0)
    stream.close()
    assert (state.in_flight_requests, state.in_flight_tokens) == (0, 0)
    assert stream.record is not None
    assert stream.record.status == 499


async def test_an_upstream_5xx_counts_against_the_endpoint() -> None:
    gw = make_gateway()
    stream = ExtProcStream(gw)
    answer = await send_request(stream, chat_body())
    await feed(stream, [proxy.response_headers([(":status", "503")], end_of_stream=True)])
    sample = gw.metrics.registry.get_sample_value(
        "servegate_upstream_errors_total", {"endpoint": answer.endpoints[0], "kind": "503"}
    )
    assert sample == 1.0


async def test_a_streamed_mode_proxy_is_refused_with_a_clear_message() -> None:
    from servegate.extproc.protocol import ProtocolMismatch

    gw = make_gateway()
    message = proxy.request_headers(headers(), body_mode=1)  # STREAMED
    with pytest.raises(ProtocolMismatch, match="request_body_mode is STREAMED"):
        await ExtProcStream(gw).handle(message)


async def test_sheddable_request_is_429_when_the_pool_is_saturated() -> None:
    flow = {
        "enabled": True,
        "saturation_detector": {
            "type": "concurrency-detector",
            "parameters": {"maxConcurrency": 1},
        },
        "objectives": [{"name": "batch", "priority": -1}],
    }
    gw = make_gateway(flow_control=flow)
    held = [ExtProcStream(gw) for _ in ADDRESSES]
    for stream in held:
        answer = await send_request(stream, chat_body())
        assert answer.destination is not None
    # concurrency-detector: 3 in flight / (3 endpoints · 1) = 1.0 → saturated; priority −1 sheds
    shed = ExtProcStream(gw)
    answer = await send_request(
        shed, chat_body(), extra_headers={"x-llm-d-inference-objective": "batch"}
    )
    assert answer.immediate_status == 429
    assert answer.immediate_headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    for stream in [*held, shed]:
        stream.close()


async def test_a_body_before_any_headers_is_a_protocol_error() -> None:
    from servegate.extproc.protocol import ProtocolMismatch

    with pytest.raises(ProtocolMismatch, match="before the request headers"):
        await ExtProcStream(make_gateway()).handle(proxy.request_body(b"{}", True))


async def test_other_paths_go_to_any_endpoint_with_the_body_unchanged() -> None:
    gw = make_gateway()
    stream = ExtProcStream(gw)
    body = b'{"prompt": "tokenize me"}'
    messages = [proxy.request_headers(headers("/custom")), proxy.request_body(body, True)]
    answer = decode_request_answer(await feed(stream, messages))
    assert answer.kinds == ["request_headers", "request_body"]
    assert answer.destination in ADDRESSES
    assert (answer.body, answer.set_headers["content-length"]) == (body, str(len(body)))


async def test_vllm_routes_without_a_model_are_scheduled_over_the_whole_pool() -> None:
    """`/tokenize` without `model` (vLLM defaults it): scheduled, primary and fallbacks."""
    gw = make_gateway()
    stream = ExtProcStream(gw)
    body = b'{"prompt": "tokenize me"}'
    messages = [proxy.request_headers(headers("/tokenize")), proxy.request_body(body, True)]
    answer = decode_request_answer(await feed(stream, messages))
    assert answer.kinds == ["request_headers", "request_body"]
    assert set(answer.destination.split(",")) <= set(ADDRESSES)
    assert answer.body == body


@pytest.mark.parametrize(
    ("authorization", "status"),
    [pytest.param(None, 401, id="missing"), pytest.param("Bearer k", None, id="right-key")],
)
async def test_api_keys_guard_requests_without_a_body_too(
    authorization: str | None, status: int | None
) -> None:
    gw = make_gateway(gateway={"seed": 7, "api_keys": ["k"]})
    extra = {"authorization": authorization} if authorization else {}
    message = proxy.request_headers(headers("/v1/models", "GET", **extra), end_of_stream=True)
    answer = decode_request_answer(await feed(ExtProcStream(gw), [message]))
    assert answer.immediate_status == status
    if status is None:
        assert "authorization" in answer.removed_headers


# -- BUFFERED request body, response body NONE (deploy/extproc/envoy-buffered.yaml) --------------


async def test_buffered_mode_routes_on_the_whole_body_and_ends_at_the_response_headers() -> None:
    gw = make_gateway(queues=(3.0, 0.0, 1.0))
    stream = ExtProcStream(gw)
    body = chat_body()
    first, answer = await send_buffered(stream, body)
    # the headers are answered at once, with nothing in it: the destination needs the body
    assert first.WhichOneof("response") == "request_headers"
    assert first.request_headers == type(first.request_headers)()
    assert first.dynamic_metadata.fields == {}
    # one answer to the body carries the routing (same ranking as in full-duplex mode above)
    assert answer.kinds == ["request_body"]
    assert answer.endpoints == ["10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.1:8000"]
    assert answer.metadata_destination == answer.destination
    assert answer.clear_route_cache
    assert "x-gateway-destination-endpoint-subset" in answer.removed_headers
    # the body was not rewritten: the proxy keeps its own, and its content-length
    assert answer.body == body
    assert "content-length" not in answer.set_headers
    primary = gw.pool.get("10.0.0.2:8000")
    assert primary is not None
    assert primary.in_flight_requests == 1
    out = await feed(
        stream,
        [proxy.response_headers([(":status", "200"), ("content-type", "text/event-stream")])],
    )
    assert [m.WhichOneof("response") for m in out] == ["response_headers"]
    assert proxy.response_header_mutation(out[0])["x-gateway-destination-endpoint"] == (
        "10.0.0.2:8000"
    )
    # no response body follows in this mode: the response headers complete the request
    assert primary.in_flight_requests == 0
    stream.close()
    assert stream.record is not None
    assert (stream.record.status, stream.record.error) == (200, None)
    assert stream.record.completion_tokens is None


async def test_buffered_mode_returns_the_body_with_the_rewritten_model_and_its_length() -> None:
    rewrite = {"rules": [{"matches": [{"model": "public"}], "targets": [{"modelRewrite": MODEL}]}]}
    gw = make_gateway(model_rewrites=[rewrite])
    stream = ExtProcStream(gw)
    _, answer = await send_buffered(stream, chat_body(model="public"))
    assert orjson.loads(answer.body)["model"] == MODEL
    assert answer.set_headers["content-length"] == str(len(answer.body))
    assert answer.endpoints


async def test_buffered_mode_answers_request_trailers_after_the_routing_answer() -> None:
    gw = make_gateway()
    stream = ExtProcStream(gw)
    buffered = proxy.request_headers(headers(), body_mode=2, response_body_mode=0)
    await feed(stream, [buffered])
    # with trailers to come, the one body message does not carry end_of_stream
    routed = await feed(stream, [proxy.request_body(chat_body(), False)])
    assert [m.WhichOneof("response") for m in routed] == ["request_body"]
    trailers = await feed(stream, [proxy.request_trailers([("x-t", "1")])])
    assert [m.WhichOneof("response") for m in trailers] == ["request_trailers"]
