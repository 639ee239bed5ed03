"""`LeanTransport` against real loopback servers: an aiohttp server for well-formed HTTP,
raw asyncio servers for the answers no framework would send."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from servegate.gateway.lean_transport import (
    HIGH_WATER,
    MAX_HEAD_BYTES,
    LeanResponse,
    LeanTransport,
    UpstreamClosed,
    UpstreamMalformed,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def lean() -> AsyncIterator[LeanTransport]:
    transport = LeanTransport()
    transport.open()
    try:
        yield transport
    finally:
        await transport.close()


@asynccontextmanager
async def app_server(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[str]:
    writers: list[asyncio.StreamWriter] = []

    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await handler(reader, writer)

    server = await asyncio.start_server(tracked, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for writer in writers:  # Python 3.11's Server has no close_clients()
            writer.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


def answering(*answers: bytes, close: bool = True) -> Handler:
    """Reads one request per answer and writes it; then closes (or lingers)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for answer in answers:
                await read_request(reader)
                writer.write(answer)
                await writer.drain()
            if not close:
                await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handle


async def post(transport: LeanTransport, url: str, **kw: float | None) -> LeanResponse:
    return await transport.post(
        url, b'{"x": 1}', {"Content-Type": "application/json"},
        kw.get("total_s", 10.0), kw.get("connect_s", 5.0), kw.get("head_s"),
    )  # fmt: skip


async def read_all(response: LeanResponse) -> bytes:
    return b"".join([chunk async for chunk in response.content.iter_any()])


def peers_app(peers: list[object]) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        body = await request.read()
        return web.Response(body=body, headers={"X-Seen": request.headers.get("Host", "")})

    app = web.Application()
    app.router.add_post("/echo", handle)
    return app


async def test_keep_alive_connections_are_reused_after_a_full_body() -> None:
    peers: list[object] = []
    async with app_server(peers_app(peers)) as base, lean() as transport:
        for _ in range(3):
            response = await post(transport, base + "/echo")
            assert response.status == 200
            assert response.content_length == 8
            assert await read_all(response) == b'{"x": 1}'
            assert response.headers["X-Seen"] == base.removeprefix("http://")
            response.release()
    assert len(peers) == 3 and len(set(peers)) == 1


async def test_a_connection_abandoned_mid_body_is_closed_not_reused() -> None:
    peers: list[object] = []
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        await release.wait()
        return response

    app = peers_app(peers)
    app.router.add_post("/slow", slow)
    async with app_server(app) as base, lean() as transport:
        response = await post(transport, base + "/slow")
        assert await response.content.readany() == b"data: 1\n\n"
        response.release()  # not at its end: closed
        release.set()
        again = await post(transport, base + "/echo")
        await read_all(again)
        again.release()
    assert len(set(peers)) == 2


async def test_chunked_answers_are_read_whole() -> None:
    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for part in (b"abc", b"defg", b"h" * 70000):
            await response.write(part)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/c", chunked)
    async with app_server(app) as base, lean() as transport:
        for _ in range(2):  # and the connection is reused after it
            response = await post(transport, base + "/c")
            assert response.content_length is None
            assert await read_all(response) == b"abcdefg" + b"h" * 70000
            assert response.content.at_eof()
            response.release()


async def test_a_close_delimited_body_ends_at_eof() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n\r\nuntil the end"
    async with raw_server(answering(answer)) as base, lean() as transport:
        response = await post(transport, base + "/")
        assert response.content_type == "text/plain"
        assert await read_all(response) == b"until the end"
        response.release()


async def test_sse_chunks_arrive_one_by_one() -> None:
    step = asyncio.Event()

    async def sse(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(3):
            await response.write(f"data: {i}\n\n".encode())
            await step.wait()
            step.clear()
        await response.write_eof(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/sse", sse)
    async with app_server(app) as base, lean() as transport:
        response = await post(transport, base + "/sse")
        assert response.content_type == "text/event-stream"
        seen = []
        for i in range(3):
            chunk = await response.content.readany()
            seen.append(chunk)
            assert chunk == f"data: {i}\n\n".encode()  # before the next is even written
            step.set()
        assert await response.content.readany() == b"data: [DONE]\n\n"
        assert await response.content.readany() == b""
        assert response.content.at_eof()
        response.release()


async def test_an_unread_body_stops_being_read_past_the_bound() -> None:
    size = 16 * 1024 * 1024
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n".encode()

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(head)
        block = b"x" * 65536
        try:
            for _ in range(size // len(block)):
                writer.write(block)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    async with raw_server(flood) as base, lean() as transport:
        response = await post(transport, base + "/")
        await asyncio.sleep(0.5)  # the replica writes as fast as it can; nobody reads
        buffered = sum(len(c) for c in response._chunks)
        assert buffered <= HIGH_WATER + 1024 * 1024  # the bound, plus one socket read
        assert response._conn is not None and response._conn.paused
        total = 0
        async for chunk in response.content.iter_any():
            total += len(chunk)
            assert len(chunk) <= HIGH_WATER + 1024 * 1024
        assert total == size
        response.release()


async def test_no_answer_within_total_s_is_a_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    async with raw_server(silent) as base, lean() as transport:
        with pytest.raises(TimeoutError):
            await post(transport, base + "/", total_s=0.2)


async def test_total_s_bounds_the_body_too() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly some"
    async with raw_server(answering(answer, close=False)) as base, lean() as transport:
        response = await post(transport, base + "/", total_s=0.3)
        assert await response.content.readany() == b"only some"
        with pytest.raises(TimeoutError):
            await response.content.readany()
        response.close()


async def test_no_head_within_head_s_is_a_timeout_before_total_s() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    async with raw_server(silent) as base, lean() as transport:
        with pytest.raises(TimeoutError, match="first-byte"):
            await post(transport, base + "/", head_s=0.1, total_s=30.0)


async def test_a_body_may_outlast_head_s_once_the_head_came() -> None:
    async def slow_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nfirst")
        await writer.drain()
        await asyncio.sleep(0.4)
        writer.write(b"end")
        await writer.drain()
        await reader.read()
        writer.close()

    async with raw_server(slow_body) as base, lean() as transport:
        response = await post(transport, base + "/", head_s=0.1, total_s=30.0)
        assert await read_all(response) == b"firstend"
        response.release()


async def test_total_s_still_bounds_the_body_after_head_s() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly some"
    async with raw_server(answering(answer, close=False)) as base, lean() as transport:
        response = await post(transport, base + "/", head_s=0.1, total_s=0.4)
        assert await response.content.readany() == b"only some"
        with pytest.raises(TimeoutError, match="total"):
            await response.content.readany()
        response.close()


async def test_connect_s_bounds_opening_a_connection() -> None:
    # A listener whose backlog is full: the kernel drops further SYNs, so connect hangs.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        async with lean() as transport:
            with pytest.raises(TimeoutError):
                await post(transport, f"http://127.0.0.1:{port}/", connect_s=0.2)
    finally:
        for s in fillers:
            s.close()
        listener.close()


async def test_a_refused_connection_is_an_oserror() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    async with lean() as transport:
        with pytest.raises(ConnectionRefusedError):
            await post(transport, f"http://127.0.0.1:{port}/")


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\ncut short",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    ],
    ids=["content-length", "chunked"],
)
async def test_a_replica_closing_mid_body_fails_the_read(answer: bytes) -> None:
    async with raw_server(answering(answer)) as base, lean() as transport:
        response = await post(transport, base + "/")
        with pytest.raises(UpstreamClosed) as caught:
            await read_all(response)
        assert isinstance(caught.value, aiohttp.ServerDisconnectedError)
        assert not isinstance(caught.value, ConnectionResetError)  # that means the client left
        response.close()


async def test_a_replica_closing_before_answering_fails_the_request() -> None:
    async with raw_server(answering(b"")) as base, lean() as transport:
        with pytest.raises(aiohttp.ClientError):
            await post(transport, base + "/")


@pytest.mark.parametrize(
    "answer",
    [
        b"garbage garbage\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
    ids=["status-line", "status-code", "oversized-head", "chunk-size"],
)
async def test_malformed_answers_are_a_clean_error(answer: bytes) -> None:
    async with raw_server(answering(answer, close=False)) as base, lean() as transport:
        with pytest.raises(UpstreamMalformed) as caught:
            await read_all(await post(transport, base + "/"))
        assert isinstance(caught.value, aiohttp.ClientPayloadError)


async def test_redirects_are_handed_back_not_followed() -> None:
    called: list[str] = []

    async def target(request: web.Request) -> web.Response:
        called.append(request.path)
        return web.Response(text="followed")

    async def moved(request: web.Request) -> web.Response:
        return web.Response(status=307, headers={"Location": "/target"}, text="moved")

    app = web.Application()
    app.router.add_post("/moved", moved)
    app.router.add_post("/target", target)
    async with app_server(app) as base, lean() as transport:
        response = await post(transport, base + "/moved")
        assert response.status == 307
        assert response.headers["Location"] == "/target"
        assert await read_all(response) == b"moved"
        response.release()
    assert called == []


async def test_interim_answers_are_skipped() -> None:
    answer = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
        b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"
    )
    async with raw_server(answering(answer)) as base, lean() as transport:
        response = await post(transport, base + "/")
        assert response.status == 201
        assert "Link" not in response.headers
        assert await read_all(response) == b"ok"
        response.release()


async def test_a_protocol_switch_is_handed_back_and_its_connection_closed() -> None:
    answer = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    replica = raw_server(answering(answer + b"\x81\x00", close=False))
    async with replica as base, lean() as transport:
        response = await post(transport, base + "/")
        assert response.status == 101
        conn = response._conn
        response.release()
        assert conn is not None and conn.closed


async def test_repeated_headers_are_kept() -> None:
    answer = b"HTTP/1.1 200 OK\r\nX-A: 1\r\nx-a: 2\r\nContent-Length: 0\r\n\r\n"
    async with raw_server(answering(answer)) as base, lean() as transport:
        response = await post(transport, base + "/")
        assert response.headers.getall("X-A") == ["1", "2"]
        assert await read_all(response) == b""
        response.release()


async def test_an_idle_connection_the_replica_closed_is_replaced() -> None:
    # Answers one request per connection without saying so (as a replica whose keep-alive
    # timer fires just as the next request is sent): the next request goes out fresh.
    peers: list[object] = []

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername"))
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async with raw_server(once) as base, lean() as transport:
        for _ in range(3):
            response = await post(transport, base + "/")
            assert await read_all(response) == b"ok"
            response.release()
    assert len(set(peers)) == 3


async def test_a_stale_pooled_connection_is_retried_once_on_a_fresh_one() -> None:
    replica = raw_server(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))
    async with replica as base, lean() as transport:
        response = await post(transport, base + "/")
        assert await read_all(response) == b"ok"
        conn = response._conn
        response.release()
        assert conn is not None
        conn.closed = False  # pretend its close has not been seen yet
        origin = next(iter(transport._origins.values()))
        origin.idle.append(conn)
        again = await post(transport, base + "/")
        assert await read_all(again) == b"ok"
        again.release()


async def test_header_injection_is_refused() -> None:
    async with lean() as transport:
        with pytest.raises(ValueError, match="line break"):
            await transport.post("http://127.0.0.1:9/", b"", {"X-A": "1\r\nX-B: 2"}, 1.0, 1.0)


async def test_a_transport_that_is_not_open_refuses() -> None:
    with pytest.raises(aiohttp.ClientConnectionError):
        await LeanTransport().post("http://127.0.0.1:9/", b"", {}, 1.0, 1.0)


@pytest.mark.parametrize(("client", "kind"), [("lean", LeanTransport), ("aiohttp", None)])
def test_the_config_names_the_request_path_client(client: str, kind: type | None) -> None:
    from servegate.config import ServegateConfig
    from servegate.gateway.app import build_gateway
    from servegate.gateway.transport import AiohttpTransport

    config = ServegateConfig.model_validate(
        {"gateway": {"upstream_client": client}, "pool": {"endpoints": []}}
    )
    transport = build_gateway(config).transport
    assert isinstance(transport, kind or AiohttpTransport)


async def test_idle_connections_are_closed_after_keepalive_s() -> None:
    peers: list[object] = []
    async with app_server(peers_app(peers)) as base:
        transport = LeanTransport(keepalive_s=0.2)
        transport.open()
        try:
            response = await post(transport, base + "/echo")
            await read_all(response)
            conn = response._conn
            response.release()
            assert conn is not None and not conn.closed
            await asyncio.sleep(0.6)
            assert conn.closed
            assert next(iter(transport._origins.values())).idle == []
        finally:
            await transport.close()
