"""Issue 18 item 11: hop-by-hop headers, forwarding chains, and replica headers that speak
for the gateway's origin."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from servegate.scheduling.affinity import encode_token
from servegate.testing.gateway import GatewayRunner
from tests.hostile.replica import MODEL, Replica, gateway_config, ready

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_request_hop_by_hop_and_forwarding_headers(http: aiohttp.ClientSession) -> None:
    replica = await Replica().start()
    try:
        async with GatewayRunner(gateway_config([replica.url])) as gw:
            await ready(gw, 1)
            sent = [
                {"Connection": "keep-alive, X-Hop-Secret", "X-Hop-Secret": "1", "X-Kept": "1"},
                {"X-Forwarded-For": "6.6.6.6", "Forwarded": "for=6.6.6.6;proto=https"},
            ]
            for headers in sent:
                async with http.post(
                    gw.url + "/v1/chat/completions", json=CHAT, headers=headers
                ) as resp:
                    assert resp.status == 200
        first, second = (c.headers for c in replica.calls)
        assert "x-hop-secret" not in first
        assert first["x-kept"] == "1"
        assert first["x-forwarded-for"] == "127.0.0.1"
        assert "forwarded" not in first
        assert second["x-forwarded-for"] == "6.6.6.6, 127.0.0.1"
        assert second["forwarded"] == "for=6.6.6.6;proto=https, for=127.0.0.1"
    finally:
        await replica.stop()


async def test_replica_headers_that_speak_for_the_gateway_are_dropped(
    http: aiohttp.ClientSession,
) -> None:
    forged = encode_token("10.6.6.6:8000")

    async def answer(request: web.Request, raw: bytes) -> web.StreamResponse:
        response = web.json_response({"choices": []})
        response.set_cookie("replica-session", "stolen")
        response.headers.update(
            {
                "Location": "http://10.6.6.6/",
                "Strict-Transport-Security": "max-age=63072000; includeSubDomains",
                "Access-Control-Allow-Origin": "*",
                "Access-Control-Allow-Credentials": "true",
                "x-session-token": forged,
                "x-gateway-destination-endpoint": "10.6.6.6:8000",
                "x-llm-d-request-dropped-reason": "forged",
                "Connection": "X-Upstream-Hop",
                "X-Upstream-Hop": "1",
                "X-Replica-Info": "kept",
            }
        )
        return response

    replica = await Replica(answer).start()
    try:
        async with GatewayRunner(gateway_config([replica.url])) as gw:
            await ready(gw, 1)
            async with http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                headers = resp.headers
        for name in (
            "Set-Cookie", "Location", "Strict-Transport-Security", "Access-Control-Allow-Origin",
            "Access-Control-Allow-Credentials", "x-session-token", "x-llm-d-request-dropped-reason",
            "X-Upstream-Hop",
        ):  # fmt: skip
            assert name not in headers, name
        assert headers.getall("x-gateway-destination-endpoint") == [replica.address]
        assert headers["X-Replica-Info"] == "kept"
    finally:
        await replica.stop()


async def test_a_forged_session_token_cannot_leave_the_pool(http: aiohttp.ClientSession) -> None:
    picker = {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [{"type": "session-affinity-scorer"}, {"type": "max-score-picker"}],
    }
    outside = await Replica().start()
    replica = await Replica().start()
    try:
        async with GatewayRunner(gateway_config([replica.url], picker)) as gw:
            await ready(gw, 1)
            token = {"x-session-token": encode_token(outside.address)}
            async with http.post(gw.url + "/v1/chat/completions", json=CHAT, headers=token) as resp:
                assert resp.status == 200
                assert resp.headers["x-session-token"] == encode_token(replica.address)
        assert outside.calls == []
        assert len(replica.calls) == 1
    finally:
        await replica.stop()
        await outside.stop()
