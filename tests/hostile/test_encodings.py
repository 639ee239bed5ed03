"""Issue 18 item 10: compressed request bodies and the encodings the gateway asks for."""

from __future__ import annotations

import gzip

import aiohttp
import orjson
import pytest

from servegate.testing.gateway import GatewayRunner
from tests.hostile.replica import MODEL, Replica, gateway_config, ready

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
async def replica() -> Replica:  # type: ignore[misc]
    r = await Replica().start()
    yield r
    await r.stop()


async def test_a_gzip_body_is_forwarded_decompressed_without_content_encoding(
    replica: Replica, http: aiohttp.ClientSession
) -> None:
    async with GatewayRunner(gateway_config([replica.url])) as gw:
        await ready(gw, 1)
        async with http.post(
            gw.url + "/v1/chat/completions",
            data=gzip.compress(orjson.dumps(CHAT)),
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        ) as resp:
            assert resp.status == 200, await resp.text()
    (call,) = replica.calls
    assert "content-encoding" not in call.headers
    assert call.body == CHAT
    assert int(call.headers["content-length"]) == len(call.raw)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"\x1f\x8b\x08\x00garbage-not-deflate", id="corrupt"),
        pytest.param(gzip.compress(orjson.dumps(CHAT))[:-12], id="truncated"),
        pytest.param(orjson.dumps(CHAT), id="not-gzip-at-all"),
    ],
)
async def test_a_bad_gzip_body_is_an_openai_400(
    replica: Replica, http: aiohttp.ClientSession, data: bytes
) -> None:
    async with GatewayRunner(gateway_config([replica.url])) as gw:
        await ready(gw, 1)
        async with http.post(
            gw.url + "/v1/chat/completions",
            data=data,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        ) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert error["type"] == "invalid_request_error"
        (line,) = gw.access_lines()
        assert line["status"] == 400
    assert replica.calls == []


async def test_a_gzip_bomb_is_413(replica: Replica, http: aiohttp.ClientSession) -> None:
    bomb = gzip.compress(b'{"model": "m", "pad": "' + b" " * (8 * 1024 * 1024) + b'"}')
    async with GatewayRunner(gateway_config([replica.url], max_body_bytes=1024 * 1024)) as gw:
        await ready(gw, 1)
        assert len(bomb) < 1024 * 1024
        async with http.post(
            gw.url + "/v1/chat/completions",
            data=bomb,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        ) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["code"] == "request_too_large"
    assert replica.calls == []


async def test_no_accept_encoding_or_user_agent_the_client_did_not_send(
    replica: Replica,
) -> None:
    async with GatewayRunner(gateway_config([replica.url])) as gw:
        await ready(gw, 1)
        async with aiohttp.ClientSession(
            skip_auto_headers=("Accept-Encoding", "User-Agent")
        ) as bare:
            async with bare.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
            async with bare.post(
                gw.url + "/v1/chat/completions", json=CHAT, headers={"Accept-Encoding": "br"}
            ) as resp:
                assert resp.status == 200
    first, second = replica.calls
    assert "accept-encoding" not in first.headers
    assert "user-agent" not in first.headers
    assert second.headers["accept-encoding"] == "br"
