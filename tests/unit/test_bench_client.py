"""TTFT, inter-token latency and error kinds, measured against a scripted SSE server.

The server on 127.0.0.1 waits FIRST_DELAY_S before the first output chunk and GAP_S
between chunks. Bounds are wide enough for a loaded 2-core machine: a measured time
can only be later than scripted, and at most ~0.5 s later.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from servegate.bench.client import RequestResult, has_output, send_request
from servegate.bench.workloads import BenchRequest, ChatMessage

FIRST_DELAY_S = 0.2
GAP_S = 0.1
CHUNKS = 4
SLACK_S = 0.5
ServerFactory = Callable[[web.Application], Awaitable[TestServer]]


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def chat_chunk(content: str | None, role: str | None = None) -> bytes:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return sse({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]})


async def scripted_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(chat_chunk("", role="assistant"))  # role only: not a token
    await asyncio.sleep(FIRST_DELAY_S)
    for index in range(CHUNKS):
        if index:
            await asyncio.sleep(GAP_S)
        await response.write(chat_chunk(f"t{index} "))
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    await response.write(sse({"choices": [], "usage": usage}))
    await response.write(b"data: [DONE]\n\n")
    return response


async def stream_without_usage(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for index in range(3):
        await response.write(sse({"choices": [{"index": 0, "text": f"w{index}"}]}))
    await response.write(b"data: [DONE]\n\n")
    return response


async def stream_with_error(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(chat_chunk("a"))
    await response.write(sse({"error": {"message": "replica died", "code": 502}}))
    return response


async def whole(request: web.Request) -> web.Response:
    usage = {"prompt_tokens": 3, "completion_tokens": 5}
    return web.json_response({"choices": [{"message": {"content": "x"}}], "usage": usage})


async def shed(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "queue full"}}, status=429)


async def not_json(request: web.Request) -> web.Response:
    return web.Response(text="<html>oops</html>")


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(2.0)
    return web.Response(text="{}")


async def served_by(request: web.Request) -> web.Response:
    return web.json_response({}, headers={"x-gateway-destination-endpoint": "10.0.0.1:8000"})


@pytest.fixture
async def base_url(aiohttp_server: ServerFactory) -> str:
    app = web.Application()
    routes = {
        "/scripted": scripted_stream,
        "/no-usage": stream_without_usage,
        "/stream-error": stream_with_error,
        "/whole": whole,
        "/shed": shed,
        "/not-json": not_json,
        "/slow": slow,
        "/served-by": served_by,
    }
    for prefix, handler in routes.items():
        app.router.add_post(prefix + "/v1/chat/completions", handler)
    server = await aiohttp_server(app)
    assert server.host == "127.0.0.1"
    return f"http://127.0.0.1:{server.port}"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


CHAT = BenchRequest("m", 8, messages=(ChatMessage("user", "hi"),))


async def send(
    session: aiohttp.ClientSession, url: str, *, stream: bool, timeout_s: float = 10.0
) -> RequestResult:
    return await send_request(session, url, CHAT, stream=stream, timeout_s=timeout_s)


async def test_ttft_and_itl_follow_the_scripted_delays(
    session: aiohttp.ClientSession, base_url: str
) -> None:
    result = await send(session, base_url + "/scripted", stream=True)
    assert result.ok
    assert result.status == 200
    assert result.ttft_s is not None
    assert FIRST_DELAY_S <= result.ttft_s < FIRST_DELAY_S + SLACK_S
    assert len(result.itl_s) == CHUNKS - 1
    for gap in result.itl_s:
        # a chunk read late shortens the next gap, so allow half a gap below
        assert GAP_S / 2 <= gap < GAP_S + SLACK_S
    # 3 gaps of 0.1 s
    assert sum(result.itl_s) >= (CHUNKS - 1) * GAP_S - 0.02
    # first delay + 3 gaps = 0.5 s
    assert FIRST_DELAY_S + (CHUNKS - 1) * GAP_S - 0.02 <= result.e2e_s < 0.5 + 2 * SLACK_S
    assert (result.output_tokens, result.prompt_tokens, result.cached_tokens) == (7, 10, 4)


async def test_streams_read_to_their_end_reuse_one_connection(
    aiohttp_server: ServerFactory,
) -> None:
    peers: list[object] = []

    async def remember_peer(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        response = await stream_without_usage(request)
        await asyncio.sleep(0.05)  # the stream's end comes a moment after [DONE]
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", remember_peer)
    server = await aiohttp_server(app)
    async with aiohttp.ClientSession() as client:
        for _ in range(3):
            result = await send(client, f"http://127.0.0.1:{server.port}", stream=True)
            assert result.ok
    # one keep-alive connection for all three: nothing was left unread after [DONE]
    assert len(peers) == 3 and len(set(peers)) == 1


async def test_output_tokens_fall_back_to_chunk_count(
    session: aiohttp.ClientSession, base_url: str
) -> None:
    result = await send(session, base_url + "/no-usage", stream=True)
    assert result.ok
    assert result.output_tokens == 3
    assert result.prompt_tokens is None
    assert result.cached_tokens is None


async def test_non_streaming_reads_usage_and_has_no_ttft(
    session: aiohttp.ClientSession, base_url: str
) -> None:
    result = await send(session, base_url + "/whole", stream=False)
    assert result.ok
    assert result.ttft_s is None
    assert result.itl_s == ()
    assert (result.output_tokens, result.prompt_tokens) == (5, 3)


async def test_served_by_header_is_recorded(session: aiohttp.ClientSession, base_url: str) -> None:
    result = await send(session, base_url + "/served-by", stream=False)
    assert result.served_by == "10.0.0.1:8000"


@pytest.mark.parametrize(
    ("path", "stream", "status", "kind", "message"),
    [
        pytest.param("/shed", True, 429, "429", "queue full", id="http-429"),
        pytest.param("/stream-error", True, 200, "stream-error", "replica died", id="sse-error"),
        pytest.param("/not-json", False, 200, "bad-response", "unparseable", id="bad-json"),
        pytest.param("/missing", False, 404, "404", "", id="http-404"),
    ],
)
async def test_failures_become_results(
    session: aiohttp.ClientSession,
    base_url: str,
    path: str,
    stream: bool,
    status: int,
    kind: str,
    message: str,
) -> None:
    result = await send(session, base_url + path, stream=stream)
    assert not result.ok
    assert (result.status, result.error_kind) == (status, kind)
    assert message in (result.error or "")


async def test_timeout_is_its_own_kind(session: aiohttp.ClientSession, base_url: str) -> None:
    result = await send(session, base_url + "/slow", stream=False, timeout_s=0.2)
    assert (result.status, result.error_kind) == (0, "timeout")


async def test_refused_connection_is_a_connection_error(session: aiohttp.ClientSession) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = await send(session, f"http://127.0.0.1:{port}", stream=True)
    assert (result.status, result.error_kind) == (0, "connection")


@pytest.mark.parametrize(
    ("chunk", "expected"),
    [
        pytest.param(
            {"choices": [{"delta": {"role": "assistant", "content": ""}}]}, False, id="role"
        ),
        pytest.param({"choices": [{"delta": {"content": "a"}}]}, True, id="content"),
        pytest.param({"choices": [{"delta": {"reasoning_content": "r"}}]}, True, id="reasoning"),
        pytest.param({"choices": [{"text": "a"}]}, True, id="completion-text"),
        pytest.param({"choices": [{"text": "", "finish_reason": "stop"}]}, False, id="finish"),
        pytest.param({"choices": [], "usage": {}}, False, id="usage-only"),
        pytest.param({"choices": "junk"}, False, id="junk"),
    ],
)
def test_has_output(chunk: dict[str, Any], expected: bool) -> None:
    assert has_output(chunk) is expected
