"""Issue 18 item 8: the client's `Authorization` and `Cookie` never appear in error bodies
or in the access log, whatever the upstream does."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from servegate.testing.gateway import GatewayRunner
from tests.hostile.replica import MODEL, Replica, gateway_config, ready

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SECRETS = {"Authorization": "Bearer sk-SECRET-KEY-1234", "Cookie": "session=COOKIE-VALUE-5678"}


def raw_answer(data: bytes) -> Any:
    async def answer(request: web.Request, raw: bytes) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.write(data)
        await asyncio.sleep(0.05)
        request.transport.close()
        await asyncio.sleep(0.05)
        return web.Response()

    return answer


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"HTTP/1.1 abc Broken\r\n\r\n", id="bad-status-line"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", id="bad-content-length"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{", id="short-body"),
        pytest.param(b"", id="closed"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_credentials_stay_out_of_errors_and_logs(
    http: aiohttp.ClientSession, data: bytes, stream: bool
) -> None:
    replica = await Replica(raw_answer(data)).start()
    try:
        async with GatewayRunner(gateway_config([replica.url], max_retries=0)) as gw:
            await ready(gw, 1)
            async with http.post(
                gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, headers=SECRETS
            ) as resp:
                body = await resp.read()
                assert resp.status == 502, body
            log = gw.access_stream.getvalue()
            for value in ("sk-SECRET-KEY-1234", "COOKIE-VALUE-5678"):
                assert value.encode() not in body
                assert value.encode() not in log
        assert replica.calls[0].headers["authorization"] == SECRETS["Authorization"]
    finally:
        await replica.stop()
