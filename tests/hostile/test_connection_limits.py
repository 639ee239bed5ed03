"""Issue 18 item 2: idle sockets and header or body trickles cannot hold the gateway's
connections (or its file descriptors) indefinitely; over the cap a newcomer displaces the
longest-idle connection, else gets an OpenAI-format 503."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from servegate.gateway.connections import CONNECTIONS, IDLE_GRACE_S
from servegate.testing.gateway import GatewayRunner
from tests.hostile.replica import MODEL, Replica, gateway_config, ready, wait_until
from tests.integration.subprocess_gateway import SubprocessGateway

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BOUND_S = 5.0
"""The longest any wait here may take; the timeouts under test are far shorter."""


@pytest.fixture
async def replica() -> AsyncIterator[Replica]:
    r = await Replica().start()
    yield r
    await r.stop()


async def closed_by_peer(reader: asyncio.StreamReader) -> bytes:
    """Everything the gateway sends until it closes the connection (bounded in time)."""
    return await asyncio.wait_for(reader.read(), BOUND_S)


async def test_a_connection_that_sends_nothing_is_closed(replica: Replica) -> None:
    async with GatewayRunner(gateway_config([replica.url], idle_timeout_s=0.2)) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            assert await closed_by_peer(reader) == b""
        finally:
            writer.close()


async def test_an_idle_keep_alive_connection_is_closed(replica: Replica) -> None:
    async with GatewayRunner(gateway_config([replica.url], idle_timeout_s=0.2)) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
            answer = await closed_by_peer(reader)
            assert answer.startswith(b"HTTP/1.1 200")
        finally:
            writer.close()


async def test_a_trickled_request_head_is_cut_off(replica: Replica) -> None:
    cfg = gateway_config([replica.url], header_timeout_s=0.2, idle_timeout_s=60)
    async with GatewayRunner(cfg) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n")
            assert await closed_by_peer(reader) == b""
            assert gw.app[CONNECTIONS].header_timeouts == 1
        finally:
            writer.close()


async def test_a_later_head_on_a_kept_connection_gets_its_own_full_time(
    replica: Replica,
) -> None:
    """The header deadline is one timer per connection, re-armed for a head that began
    after it was set: the second head is cut off at its own deadline, not the first's."""
    timeout_s = 0.4
    cfg = gateway_config([replica.url], header_timeout_s=timeout_s, idle_timeout_s=60)
    async with GatewayRunner(cfg) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}"
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)
            assert head.startswith(b"HTTP/1.1 400")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await asyncio.wait_for(reader.readexactly(length), BOUND_S)
            await asyncio.sleep(timeout_s / 2)
            writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n")  # a head left unfinished
            begun = asyncio.get_running_loop().time()
            assert await closed_by_peer(reader) == b""
            assert asyncio.get_running_loop().time() - begun >= timeout_s * 0.9
            assert gw.app[CONNECTIONS].header_timeouts == 1
        finally:
            writer.close()


async def test_a_trickled_body_gets_408(replica: Replica) -> None:
    async with GatewayRunner(gateway_config([replica.url], body_timeout_s=0.2)) as gw:
        await ready(gw, 1)
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'
            )
            answer = await closed_by_peer(reader)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408")
            error = orjson.loads(body)["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "request_timeout")
        finally:
            writer.close()
        assert replica.calls == []


async def open_idle(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port))
        socks.append(sock)
    return socks


async def test_over_the_cap_a_newcomer_gets_503_then_displaces_an_idle_connection(
    replica: Replica, http: aiohttp.ClientSession
) -> None:
    async with GatewayRunner(gateway_config([replica.url], max_connections=4)) as gw:
        await ready(gw, 1)
        guard = gw.app[CONNECTIONS]
        socks = await open_idle(gw.port, 4)
        try:
            await wait_until(lambda: len(guard) == 4, "4 open connections")
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            answer = await closed_by_peer(reader)
            writer.close()
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503")
            assert b"Retry-After: 1" in head
            assert orjson.loads(body)["error"]["type"] == "service_unavailable_error"
            await asyncio.sleep(IDLE_GRACE_S + 0.1)  # the idle ones become displaceable
            async with http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
            assert guard.displaced >= 1
            assert len(guard) <= 4
            registry = gw.gateway.metrics.registry
            closed = "servegate_client_connections_closed_total"
            assert registry.get_sample_value(closed, {"reason": "refused"}) == 1
            assert registry.get_sample_value("servegate_client_connections_max") == 4
        finally:
            for sock in socks:
                sock.close()


async def test_per_client_cap(replica: Replica) -> None:
    cfg = gateway_config([replica.url], max_connections_per_client=2)
    async with GatewayRunner(cfg) as gw:
        socks = await open_idle(gw.port, 2)
        try:
            await wait_until(lambda: len(gw.app[CONNECTIONS]) == 2, "2 open connections")
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            answer = await closed_by_peer(reader)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 503")
        finally:
            for sock in socks:
                sock.close()


async def test_190_idle_sockets_under_ulimit_200_leave_the_gateway_serving(
    replica: Replica, http: aiohttp.ClientSession
) -> None:
    """The reproduction from issue 18: the gateway child runs with 200 file descriptors."""
    cfg = gateway_config([replica.url])
    cfg["pool"]["health"] = {"interval_s": 0.1, "timeout_s": 1.0, "failure_threshold": 2}
    async with SubprocessGateway(cfg, ready_endpoints=1, nofile=200) as gw:
        socks = await open_idle(gw.port, 190)
        try:
            await asyncio.sleep(IDLE_GRACE_S + 0.2)
            timeout = aiohttp.ClientTimeout(total=BOUND_S)
            async with http.get(gw.url + "/health", timeout=timeout) as resp:
                assert resp.status == 200
            async with http.post(
                gw.url + "/v1/chat/completions", json=CHAT, timeout=timeout
            ) as resp:
                assert resp.status == 200, await resp.text()
            # Health probes every 0.1 s, two failures eject: still ready after five rounds
            # with the sockets open means the gateway's own probes kept working.
            await asyncio.sleep(0.5)
            async with http.get(gw.url + "/ready", timeout=timeout) as resp:
                assert (await resp.json())["ready_endpoints"] == 1
            assert "Too many open files" not in gw.log_tail(20000)
        finally:
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.close()
