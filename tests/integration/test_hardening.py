"""Hostile or careless clients: routing headers, oversized bodies, the admin API, the API document."""

from __future__ import annotations

from collections import Counter

import aiohttp
import pytest
from aiohttp import web

from servegate.gateway.openapi import openapi_document
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import MODEL, chat, gateway_config, wait_for, wait_ready

ADMIN = {"Authorization": "Bearer admin-secret"}


@pytest.fixture
async def gw2(cluster: SimCluster) -> GatewayRunner:  # type: ignore[misc]
    cfg = gateway_config(cluster.urls, admin_keys=["admin-secret"], max_body_bytes=4096)
    async with GatewayRunner(cfg) as gw:
        await wait_ready(gw, len(cluster))
        yield gw


@pytest.mark.parametrize(
    "header",
    [
        "x-gateway-destination-endpoint",
        "x-gateway-destination-endpoint-served",
        "x-prefiller-host-port",
    ],
)
async def test_clients_cannot_choose_an_address(
    gw2: GatewayRunner, cluster: SimCluster, session: aiohttp.ClientSession, header: str
) -> None:
    outside = "127.0.0.1:1"
    async with session.post(
        gw2.url + "/v1/chat/completions", json=chat(), headers={header: outside}
    ) as resp:
        assert resp.status == 200
        assert resp.headers["x-gateway-destination-endpoint"] in cluster.addresses
    assert all(line["endpoint"] != outside for line in gw2.access_lines())


async def test_a_subset_naming_no_pool_member_is_503_and_never_forwarded(
    gw2: GatewayRunner, session: aiohttp.ClientSession
) -> None:
    """The Endpoint Picker Protocol's subset semantics: non-members are ignored, and
    when nothing is left the answer is 503; the address is never tried."""
    outside = "127.0.0.1:1"
    async with session.post(
        gw2.url + "/v1/chat/completions",
        json=chat(),
        headers={"x-gateway-destination-endpoint-subset": outside},
    ) as resp:
        assert resp.status == 503
        assert resp.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
        assert (await resp.json())["error"]["code"] == "rejected-no-endpoints"
    assert all(line["endpoint"] != outside for line in gw2.access_lines())


async def test_body_over_the_limit_is_413(
    gw2: GatewayRunner, session: aiohttp.ClientSession
) -> None:
    async with session.post(gw2.url + "/v1/chat/completions", json=chat("x" * 10_000)) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        pytest.param({}, 401, id="no-key"),
        pytest.param({"Authorization": "Bearer wrong"}, 401, id="wrong-key"),
        pytest.param(ADMIN, 200, id="admin-key"),
    ],
)
async def test_admin_needs_its_own_key(
    gw2: GatewayRunner, session: aiohttp.ClientSession, headers: dict[str, str], status: int
) -> None:
    async with session.get(gw2.url + "/admin/pool", headers=headers) as resp:
        assert resp.status == status


async def test_admin_disabled_without_keys(
    gateway: GatewayRunner, session: aiohttp.ClientSession
) -> None:
    async with session.get(gateway.url + "/admin/pool", headers=ADMIN) as resp:
        assert resp.status == 403


async def test_drain_and_undrain(
    gw2: GatewayRunner, cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    target = cluster.addresses[0]
    async with session.post(gw2.url + f"/admin/endpoints/{target}/drain", headers=ADMIN) as resp:
        assert resp.status == 200
    async with session.get(gw2.url + "/admin/pool", headers=ADMIN) as resp:
        state = await resp.json()
    drained = next(e for e in state["endpoints"] if e["address"] == target)
    assert drained["draining"] and not drained["available"]
    assert state["flow_control"]["enabled"] is False
    used = Counter()
    for _ in range(12):
        async with session.post(gw2.url + "/v1/chat/completions", json=chat()) as resp:
            used[resp.headers["x-gateway-destination-endpoint"]] += 1
    assert target not in used
    async with session.post(gw2.url + f"/admin/endpoints/{target}/undrain", headers=ADMIN) as r:
        assert r.status == 200
    assert gw2.gateway.pool.ready_count() == 3
    async with session.post(gw2.url + "/admin/endpoints/10.9.9.9:1/drain", headers=ADMIN) as r:
        assert r.status == 404


async def test_openapi_document_is_served_and_covers_every_route(
    gateway: GatewayRunner, session: aiohttp.ClientSession
) -> None:
    async with session.get(gateway.url + "/openapi.json") as resp:
        doc = await resp.json()
    assert doc == openapi_document()
    routes = {
        (r.method.lower(), r.resource.canonical)  # type: ignore[union-attr]
        for r in gateway.app.router.routes()
        if r.method != "HEAD"
    }
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert routes == documented


async def test_unknown_route_and_method(
    gateway: GatewayRunner, session: aiohttp.ClientSession
) -> None:
    async with session.get(gateway.url + "/v2/nothing") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "not_found"
    async with session.get(gateway.url + "/v1/chat/completions") as resp:
        assert resp.status == 405


async def test_a_replica_cookie_reaches_no_client_and_no_other_request(
    session: aiohttp.ClientSession,
) -> None:
    """The gateway's upstream session keeps no cookie jar: what one client's replica set
    must never ride along on another client's request; and a replica's Set-Cookie is not
    relayed (it would set a cookie for the gateway's origin; tests/hostile/test_headers.py)."""
    cookies_seen: list[str | None] = []

    async def completions(request: web.Request) -> web.Response:
        cookies_seen.append(request.headers.get("Cookie"))
        response = web.json_response({"id": "x", "object": "chat.completion", "choices": []})
        response.set_cookie("replica-session", "secret-of-client-1")
        return response

    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    # by host name: aiohttp's default jar ignores cookies from bare IP addresses
    cfg = gateway_config([f"http://localhost:{port}"])
    cfg["pool"]["endpoints"][0]["model"] = MODEL
    try:
        async with GatewayRunner(cfg) as gw:
            await wait_for(lambda: gw.gateway.pool.ready_count() == 1, what="ready replica")
            for _ in range(2):
                # a fresh client each time: nothing on the client side carries the cookie
                async with (
                    aiohttp.ClientSession() as client,
                    client.post(gw.url + "/v1/chat/completions", json=chat()) as resp,
                ):
                    assert resp.status == 200
                    assert "Set-Cookie" not in resp.headers
    finally:
        await runner.cleanup()
    assert cookies_seen == [None, None]
