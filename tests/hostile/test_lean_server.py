"""The lean server (`gateway.http_server: lean`) applies aiohttp's request limits and
framing rules to the inference routes: each case runs against both servers and expects
the same answer, and the lean-only cases cover what aiohttp never sees (hand-over,
pipelining, disconnects)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import cast

import orjson
import pytest

from servegate.gateway.connections import FRONT
from servegate.gateway.lean_server import LeanServer
from servegate.testing.gateway import GatewayRunner
from tests.hostile.replica import MODEL, Replica, gateway_config, ready, wait_until

SERVERS = ("aiohttp", "lean")
BOUND_S = 5.0
CHAT = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
STREAM = orjson.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
)


@pytest.fixture
async def replica() -> AsyncIterator[Replica]:
    r = await Replica().start()
    yield r
    await r.stop()


def post(body: bytes, *headers: str, path: str = "/v1/chat/completions") -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: gw", "Content-Type: application/json", *headers]
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def chunked(body: bytes, size: int) -> bytes:
    parts = [
        b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size])
        for i in range(0, len(body), size)
    ]
    return b"".join(parts) + b"0\r\n\r\n"


async def exchange(port: int, *writes: bytes, pause_s: float = 0.0) -> bytes:
    """Everything the gateway sends until it closes the connection (the last request asks
    for the close, or the gateway closes on its own)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for data in writes:
            writer.write(data)
            await writer.drain()
            if pause_s:
                await asyncio.sleep(pause_s)
        return await asyncio.wait_for(reader.read(), BOUND_S)
    finally:
        writer.close()


def statuses(answer: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.[01] (\d{3}) ", answer)]


def error_of(answer: bytes) -> dict[str, object]:
    body = answer.partition(b"\r\n\r\n")[2]
    return orjson.loads(body)["error"]  # type: ignore[no-any-return]


@pytest.fixture(params=SERVERS)
async def gateway(request: pytest.FixtureRequest, replica: Replica) -> AsyncIterator[GatewayRunner]:
    cfg = gateway_config(
        [replica.url], http_server=request.param, max_body_bytes=4096, body_timeout_s=0.3
    )
    async with GatewayRunner(cfg) as gw:
        await ready(gw, 1)
        yield gw


async def test_a_request_and_a_stream_on_one_keep_alive_connection(
    gateway: GatewayRunner, replica: Replica
) -> None:
    answer = await exchange(gateway.port, post(CHAT) + post(STREAM, "Connection: close"))
    assert statuses(answer) == [200, 200]
    assert b"Transfer-Encoding: chunked" in answer
    assert answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert len(replica.calls) == 2


async def test_a_request_line_over_the_limit_is_400(
    gateway: GatewayRunner, replica: Replica
) -> None:
    path = "/v1/chat/completions?" + "a" * 9000
    answer = await exchange(gateway.port, post(CHAT, path=path))
    assert statuses(answer) == [400]
    assert replica.calls == []


async def test_a_header_field_over_the_limit_is_400(
    gateway: GatewayRunner, replica: Replica
) -> None:
    answer = await exchange(gateway.port, post(CHAT, "X-Big: " + "b" * 9000))
    assert statuses(answer) == [400]
    assert replica.calls == []


async def test_too_many_header_fields_is_400(gateway: GatewayRunner, replica: Replica) -> None:
    answer = await exchange(gateway.port, post(CHAT, *(f"X-H{i}: v" for i in range(200))))
    assert statuses(answer) == [400]
    assert replica.calls == []


async def test_a_declared_body_over_the_limit_is_413(
    gateway: GatewayRunner, replica: Replica
) -> None:
    answer = await exchange(gateway.port, post(b"x" * 5000, "Connection: close"))
    assert statuses(answer) == [413]
    assert error_of(answer)["code"] == "request_too_large"
    assert replica.calls == []


async def test_a_chunked_body_is_read_and_one_growing_past_the_limit_is_413(
    gateway: GatewayRunner, replica: Replica
) -> None:
    ok = await exchange(
        gateway.port, post(chunked(CHAT, 7), "Transfer-Encoding: chunked", "Connection: close")
    )
    assert statuses(ok) == [200]
    assert orjson.loads(replica.calls[0].raw)["model"] == MODEL
    big = b'{"model": "' + b"x" * 5000 + b'"}'
    answer = await exchange(
        gateway.port, post(chunked(big, 1000), "Transfer-Encoding: chunked", "Connection: close")
    )
    assert statuses(answer) == [413]
    assert len(replica.calls) == 1


async def test_expect_100_continue_is_answered_before_the_body(gateway: GatewayRunner) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    try:
        request = post(CHAT, "Expect: 100-continue", "Connection: close")
        head, _, body = request.partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)
        assert interim.startswith(b"HTTP/1.1 100 Continue")
        writer.write(body)
        answer = await asyncio.wait_for(reader.read(), BOUND_S)
        assert statuses(answer) == [200]
    finally:
        writer.close()


async def test_a_body_that_does_not_arrive_in_time_is_408_and_closes(
    gateway: GatewayRunner, replica: Replica
) -> None:
    answer = await exchange(gateway.port, post(CHAT[:10], f"Content-Length: {len(CHAT)}"))
    assert statuses(answer) == [408]
    assert b"Connection: close" in answer
    assert error_of(answer)["code"] == "request_timeout"
    assert replica.calls == []


async def test_bad_framing_is_400(gateway: GatewayRunner, replica: Replica) -> None:
    answer = await exchange(
        gateway.port, post(b"zz\r\n{}\r\n0\r\n\r\n", "Transfer-Encoding: chunked")
    )
    assert statuses(answer) == [400]
    assert replica.calls == []


async def test_http_1_0_gets_a_close_delimited_stream(gateway: GatewayRunner) -> None:
    request = post(STREAM).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    answer = await exchange(gateway.port, request)
    assert statuses(answer) == [200]
    assert b"Transfer-Encoding: chunked" not in answer
    assert answer.endswith(b"data: [DONE]\n\n")


# -- the lean server's own ---------------------------------------------------------------


@pytest.fixture
async def lean(replica: Replica) -> AsyncIterator[GatewayRunner]:
    async with GatewayRunner(gateway_config([replica.url], http_server="lean")) as gw:
        await ready(gw, 1)
        yield gw


async def test_other_routes_hand_the_connection_to_aiohttp(lean: GatewayRunner) -> None:
    get = b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"
    # an inference request first, then a hand-over (new read), then more on aiohttp's side
    answer = await exchange(
        lean.port, post(CHAT), get, post(CHAT, "Connection: close"), pause_s=0.2
    )
    assert statuses(answer) == [200, 200, 200]
    assert answer.count(b"Server: Python") == 2  # aiohttp's answers after the hand-over


def lean_server(gw: GatewayRunner) -> LeanServer:
    return cast(LeanServer, gw.app[FRONT].__self__)


async def answer_to(reader: asyncio.StreamReader) -> bytes:
    """One whole answer with a Content-Length body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)
    length = int(re.search(rb"Content-Length: (\d+)", head, re.IGNORECASE)[1])  # type: ignore[index]
    return head + await asyncio.wait_for(reader.readexactly(length), BOUND_S)


async def test_a_keep_alive_connection_is_served_by_one_task(lean: GatewayRunner) -> None:
    server = lean_server(lean)
    reader, writer = await asyncio.open_connection("127.0.0.1", lean.port)
    try:
        seen = []
        for _ in range(3):
            writer.write(post(CHAT))
            assert statuses(await answer_to(reader)) == [200]
            seen.append(set(server.tasks))
        assert len(seen[0]) == 1 and seen[0] == seen[1] == seen[2]  # one worker, reused
    finally:
        writer.close()
    await wait_until(lambda: not server.tasks, "the worker to end with its connection")


async def test_a_hand_over_after_an_inference_request_leaves_no_task(lean: GatewayRunner) -> None:
    server = lean_server(lean)
    reader, writer = await asyncio.open_connection("127.0.0.1", lean.port)
    try:
        writer.write(post(CHAT))
        assert statuses(await answer_to(reader)) == [200]
        writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert statuses(await answer_to(reader)) == [200]
        # the connection is aiohttp's now and still open: the idle worker must not wait on
        await wait_until(lambda: not server.tasks, "the lean worker to end at the hand-over")
    finally:
        writer.close()


async def test_pipelined_inference_requests_are_answered_in_order(
    lean: GatewayRunner, replica: Replica
) -> None:
    bodies = [
        orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": str(i)}]})
        for i in range(3)
    ]
    burst = post(bodies[0]) + post(bodies[1]) + post(bodies[2], "Connection: close")
    answer = await exchange(lean.port, burst)
    assert statuses(answer) == [200, 200, 200]
    assert [orjson.loads(c.raw)["messages"][0]["content"] for c in replica.calls] == ["0", "1", "2"]


async def test_a_pipelined_request_for_aiohttp_is_refused_after_the_ones_before_it(
    lean: GatewayRunner,
) -> None:
    answer = await exchange(lean.port, post(CHAT) + b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert statuses(answer) == [200, 400]
    assert "own connection" in str(error_of(answer[answer.rindex(b"HTTP/1.1 400") :])["message"])


async def test_a_client_that_leaves_mid_stream_is_accounted_499(
    replica: Replica,
) -> None:
    async def slow(request: object, raw: bytes) -> object:
        from aiohttp import web

        assert isinstance(request, web.Request)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(100):
            await response.write(b'data: {"choices": []}\n\n')
            await asyncio.sleep(0.05)
        return response

    replica.answer = slow  # type: ignore[assignment]
    async with GatewayRunner(gateway_config([replica.url], http_server="lean")) as gw:
        await ready(gw, 1)
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(post(STREAM))
        await asyncio.wait_for(reader.readuntil(b"data: "), BOUND_S)
        writer.close()
        await wait_until(lambda: any(r["status"] == 499 for r in gw.access_lines()), "a 499")
        gw.gateway.access_log.flush()
        assert [r["status"] for r in gw.access_lines()] == [499]
