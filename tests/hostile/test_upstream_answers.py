"""Issue 18 items 3, 7 and 11 (upstream side): replicas that redirect, switch protocols or
answer huge bodies; the gateway follows nothing, relays no redirect, and holds no huge body."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from servegate.testing.gateway import GatewayRunner
from tests.disagg_pickers import PD_HANDLER, disagg_picker
from tests.hostile.replica import (
    MODEL,
    Replica,
    gateway_config,
    json_answer,
    ready,
    wait_until,
)
from tests.integration.subprocess_gateway import SubprocessGateway, rss_kib

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def redirect_to(target: Replica, status: int = 307) -> Any:
    async def answer(request: web.Request, raw: bytes) -> web.StreamResponse:
        return web.Response(
            status=status, headers={"Location": target.url + request.path}, text="moved"
        )

    return answer


@pytest.mark.parametrize("status", [301, 302, 307, 308])
async def test_a_redirecting_replica_is_not_followed(
    http: aiohttp.ClientSession, status: int
) -> None:
    outside = await Replica().start()
    replica = await Replica().start()
    replica.answer = redirect_to(outside, status)
    try:
        async with GatewayRunner(gateway_config([replica.url])) as gw:
            await ready(gw, 1)
            async with http.post(
                gw.url + "/v1/chat/completions", json=CHAT, allow_redirects=False
            ) as resp:
                assert resp.status == 502
                assert "Location" not in resp.headers
                error = (await resp.json())["error"]
                assert error["type"] == "bad_gateway_error"
                assert str(status) in error["message"]
        assert len(replica.calls) == 1
        assert outside.calls == []
    finally:
        await replica.stop()
        await outside.stop()


async def test_a_redirect_moves_the_request_to_the_next_fallback(
    http: aiohttp.ClientSession,
) -> None:
    outside = await Replica().start()
    bad, good = await Replica().start(), await Replica().start()
    bad.answer = redirect_to(outside)
    try:
        async with GatewayRunner(gateway_config([bad.url, good.url], max_retries=1)) as gw:
            await ready(gw, 2)
            for _ in range(4):
                async with http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status == 200
        assert outside.calls == []
        assert len(good.calls) == 4
    finally:
        for r in (bad, good, outside):
            await r.stop()


async def test_the_prefill_leg_follows_no_redirect(http: aiohttp.ClientSession) -> None:
    outside = await Replica().start()

    async def prefill_answer(request: web.Request, raw: bytes) -> web.StreamResponse:
        return await redirect_to(outside)(request, raw)

    prefill, decode = await Replica(prefill_answer).start(), await Replica().start()
    endpoints = [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}]
    cfg = gateway_config(
        [], disagg_picker(PD_HANDLER), endpoints, top={"disaggregation": {"mode": "gateway"}}
    )
    try:
        async with GatewayRunner(cfg) as gw:
            await ready(gw, 2)
            async with http.post(gw.url + "/v1/completions", json=COMPLETION) as resp:
                assert resp.status == 200
            (line,) = gw.access_lines()
            assert line["prefill_status"] == 307
        assert outside.calls == []
        assert len(decode.calls) == 1
    finally:
        for r in (prefill, decode, outside):
            await r.stop()


async def test_an_upstream_101_is_refused(http: aiohttp.ClientSession) -> None:
    async def switch(request: web.Request, raw: bytes) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
        )
        await asyncio.sleep(30)
        return web.Response()

    replica = await Replica(switch).start()
    try:
        async with GatewayRunner(gateway_config([replica.url])) as gw:
            await ready(gw, 1)
            async with http.post(
                gw.url + "/v1/chat/completions",
                json=CHAT,
                timeout=aiohttp.ClientTimeout(total=5),
            ) as resp:
                assert resp.status == 502
                assert (await resp.json())["error"]["type"] == "bad_gateway_error"
    finally:
        await replica.stop()


def big_json(size: int) -> Any:
    async def answer(request: web.Request, raw: bytes) -> web.StreamResponse:
        body = orjson.loads(raw)
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            pass
        elif body.get("stream"):
            return await json_answer(request, raw)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = size
        await response.prepare(request)
        chunk = b" " * (1 << 20)
        sent = 0
        while sent < size:
            piece = chunk[: min(len(chunk), size - sent)]
            await response.write(piece)
            sent += len(piece)
        await response.write_eof()
        return response

    return answer


async def test_an_answer_over_the_buffer_limit_is_relayed_whole(
    http: aiohttp.ClientSession,
) -> None:
    size = 3 * 1024 * 1024 + 7
    replica = await Replica(big_json(size)).start()
    try:
        cfg = gateway_config([replica.url], max_buffered_bytes=64 * 1024)
        async with GatewayRunner(cfg) as gw:
            await ready(gw, 1)
            async with http.post(gw.url + "/v1/completions", json=COMPLETION) as resp:
                assert resp.status == 200
                assert resp.content_length == size
                assert len(await resp.read()) == size
    finally:
        await replica.stop()


async def test_a_huge_prefill_answer_falls_back_to_decode_only(
    http: aiohttp.ClientSession,
) -> None:
    prefill = await Replica(big_json(4 * 1024 * 1024)).start()
    decode = await Replica().start()
    endpoints = [{"url": prefill.url, "role": "prefill"}, {"url": decode.url, "role": "decode"}]
    cfg = gateway_config(
        [], disagg_picker(PD_HANDLER), endpoints, top={"disaggregation": {"mode": "gateway"}}
    )
    try:
        async with GatewayRunner(cfg) as gw:
            await ready(gw, 2)
            async with http.post(gw.url + "/v1/completions", json=COMPLETION) as resp:
                assert resp.status == 200
            (line,) = gw.access_lines()
            assert "too_large" in line["prefill_error"]
        assert len(decode.calls) == 1
    finally:
        await prefill.stop()
        await decode.stop()


async def test_a_400_mb_answer_does_not_balloon_the_gateway(http: aiohttp.ClientSession) -> None:
    """The issue's measurement: RSS 68 → 830 MB for one 400 MB answer before the fix."""
    size = 400 * 1024 * 1024
    replica = await Replica(big_json(size)).start()
    try:
        async with SubprocessGateway(gateway_config([replica.url]), ready_endpoints=1) as gw:
            before = rss_kib(gw.pid)
            received = 0
            async with http.post(
                gw.url + "/v1/completions",
                json=COMPLETION,
                timeout=aiohttp.ClientTimeout(total=120),
            ) as resp:
                assert resp.status == 200
                async for chunk in resp.content.iter_chunked(1 << 20):
                    received += len(chunk)
                    peak = rss_kib(gw.pid)
            assert received == size
            assert peak - before < 100 * 1024, (before, peak)
    finally:
        await replica.stop()


async def test_a_triton_answer_over_the_buffer_limit_is_502(http: aiohttp.ClientSession) -> None:
    """A Triton answer is translated whole, so past `max_buffered_bytes` it is refused."""
    replica = await Replica(big_json(2 * 1024 * 1024)).start()
    endpoints = [
        {
            "url": replica.url,
            "engine": "triton-tensorrt-llm",
            "model": MODEL,
            "metrics_url": replica.url + "/metrics",
        }
    ]
    cfg = gateway_config([], None, endpoints, max_buffered_bytes=64 * 1024, max_retries=0)
    try:
        async with GatewayRunner(cfg) as gw:
            await wait_until(lambda: gw.gateway.pool.ready_count() == 1, "ready Triton endpoint")
            async with http.post(gw.url + "/v1/completions", json=COMPLETION) as resp:
                assert resp.status == 502
                error = (await resp.json())["error"]
                assert "more than 65536 bytes" in error["message"]
        assert replica.calls[0].path.startswith("/v2/models/")
    finally:
        await replica.stop()
