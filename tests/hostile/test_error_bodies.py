"""Every error the gateway answers is an OpenAI error body with a standard `type`: a
replica's non-JSON error is wrapped, and an unexpected exception is an OpenAI 500."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp import web

from servegate.gateway import app as app_module
from servegate.gateway.metrics import GatewayMetrics
from servegate.testing.gateway import GatewayRunner
from tests.hostile.replica import MODEL, Replica, gateway_config, ready

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def plain(status: int, text: str, content_type: str = "text/plain") -> Any:
    async def answer(request: web.Request, raw: bytes) -> web.StreamResponse:
        return web.Response(status=status, text=text, content_type=content_type)

    return answer


@pytest.mark.parametrize(
    ("status", "text", "content_type", "type_"),
    [
        pytest.param(500, "Internal Server Error", "text/plain", "server_error", id="500-text"),
        pytest.param(503, "<html>busy</html>", "text/html", "service_unavailable_error", id="503-html"),
        pytest.param(429, "", "text/plain", "rate_limit_error", id="429-empty"),
        pytest.param(500, "[1, 2]", "application/json", "server_error", id="500-json-not-object"),
    ],
)  # fmt: skip
async def test_a_non_json_replica_error_is_wrapped(
    http: aiohttp.ClientSession, status: int, text: str, content_type: str, type_: str
) -> None:
    replica = await Replica(plain(status, text, content_type)).start()
    try:
        async with GatewayRunner(gateway_config([replica.url], max_retries=0)) as gw:
            await ready(gw, 1)
            async with http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == status
                assert resp.content_type == "application/json"
                error = (await resp.json())["error"]
                assert error["type"] == type_
                assert error["code"] == "upstream_error"
                assert f"answered {status}" in error["message"]
                assert resp.headers["x-gateway-destination-endpoint"] == replica.address
    finally:
        await replica.stop()


async def test_a_bare_404_is_the_route_missing_there(http: aiohttp.ClientSession) -> None:
    """A framework's text 404 means the replica lacks the route: an OpenAI not_found."""
    replica = await Replica(plain(404, "404: Not Found", "text/plain")).start()
    try:
        async with GatewayRunner(gateway_config([replica.url], max_retries=0)) as gw:
            await ready(gw, 1)
            async with http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 404
                assert resp.content_type == "application/json"
                error = (await resp.json())["error"]
                assert error["type"] == "invalid_request_error"
                assert error["code"] == "not_found"
                assert "does not serve POST /v1/chat/completions" in error["message"]
    finally:
        await replica.stop()


async def test_a_json_replica_error_is_relayed_as_it_is(http: aiohttp.ClientSession) -> None:
    vllm = '{"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}'
    replica = await Replica(plain(400, vllm, "application/json")).start()
    try:
        async with GatewayRunner(gateway_config([replica.url])) as gw:
            await ready(gw, 1)
            async with http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 400
                assert await resp.text() == vllm
    finally:
        await replica.stop()


async def test_an_unexpected_exception_is_an_openai_500(
    http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    replica = await Replica().start()
    try:
        async with GatewayRunner(gateway_config([replica.url])) as gw:
            await ready(gw, 1)

            def broken(*args: object, **kwargs: object) -> None:
                raise RuntimeError("a bug")

            # a seam in plain Python: the Director is compiled (native.txt), its methods fixed
            monkeypatch.setattr(GatewayMetrics, "start", broken)
            monkeypatch.setattr(app_module, "public_models", broken)
            async with http.post(gw.url + "/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 500
                error = (await resp.json())["error"]
                assert (error["type"], error["code"]) == ("server_error", "internal_error")
            async with http.get(gw.url + "/v1/models") as resp:
                assert resp.status == 500
                assert (await resp.json())["error"]["type"] == "server_error"
            (line,) = gw.access_lines()
            assert line["status"] == 500
            assert "RuntimeError" in line["error"]
    finally:
        await replica.stop()
