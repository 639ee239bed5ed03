"""Two replicas (in-process gateways, each with its own bus) share in-flight counts and
approximate-prefix insertions; without sharing they do not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from servegate.pool.pool import Pool
from servegate.scaleout.wiring import ScaleOut
from servegate.scheduling.prefix.approx import PrefixCacheScorer
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import FAST_SIM, chat, gateway_config, wait_for, wait_ready
from tests.integration.subprocess_gateway import free_port

SLOW_SIM = {**FAST_SIM, "speed": 0.05}
ADMIN = "admin-key"
FAST_BUS = {"heartbeat_s": 0.1, "expiry_s": 0.5}
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 20


def replica_config(urls: list[str], bind: str, peers: list[str]) -> dict[str, Any]:
    cfg = gateway_config(urls, admin_keys=[ADMIN])
    cfg["scaleout"] = {"bind": bind, "peers": peers, **FAST_BUS}
    return cfg


@pytest.fixture
async def sims() -> AsyncIterator[SimCluster]:
    async with SimCluster(2, base=SLOW_SIM) as c:
        yield c


@pytest.fixture
async def replicas(sims: SimCluster) -> AsyncIterator[tuple[GatewayRunner, GatewayRunner]]:
    a, b = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    # each lists both addresses, its own included, as one shared config would
    async with (
        GatewayRunner(replica_config(sims.urls, a, [a, b])) as ga,
        GatewayRunner(replica_config(sims.urls, b, [a, b])) as gb,
    ):
        await wait_ready(ga, 2)
        await wait_ready(gb, 2)
        await wait_for(
            lambda: len(scaleout(ga).inflight.peers) == 1 and len(scaleout(gb).inflight.peers) == 1,
            what="replicas hear each other",
        )
        yield ga, gb


def scaleout(gw: GatewayRunner) -> ScaleOut:
    current = gw.running.scaleout
    assert current is not None
    return current


def in_flight(pool: Pool) -> dict[str, tuple[int, int, int]]:
    return {
        s.address: (s.local_in_flight_requests, s.peer_in_flight_requests, s.in_flight_requests)
        for s in pool
    }


def approx_blocks(gw: GatewayRunner) -> int:
    scorers = [p for p in gw.gateway.scheduler.plugins.values() if isinstance(p, PrefixCacheScorer)]
    assert scorers
    return sum(len(s.index) for s in scorers)


async def test_in_flight_counts_cross_replicas_and_are_released(
    replicas: tuple[GatewayRunner, GatewayRunner], session: aiohttp.ClientSession
) -> None:
    ga, gb = replicas
    body = chat("count me", max_tokens=40)
    task = asyncio.create_task(session.post(ga.url + "/v1/chat/completions", json=body))
    try:
        await wait_for(
            lambda: sum(r for _, r, _ in in_flight(gb.gateway.pool).values()) == 1,
            timeout=3.0,
            what="replica B sees A's request as a peer's",
        )
        assert sum(r for r, _, _ in in_flight(ga.gateway.pool).values()) == 1
        assert sum(t for _, _, t in in_flight(gb.gateway.pool).values()) == 1
        assert all(
            s.peer_in_flight_tokens > 0 for s in gb.gateway.pool if s.peer_in_flight_requests
        )
    finally:
        response = await task
        assert response.status == 200
        response.release()
    await wait_for(
        lambda: all(t == 0 for _, _, t in in_flight(gb.gateway.pool).values()),
        timeout=3.0,
        what="replica B releases A's finished request",
    )


async def test_prefix_insertions_reach_the_peer_without_echo(
    replicas: tuple[GatewayRunner, GatewayRunner], session: aiohttp.ClientSession
) -> None:
    ga, gb = replicas
    assert approx_blocks(gb) == 0
    async with session.post(
        ga.url + "/v1/chat/completions", json=chat(LONG_PROMPT, max_tokens=1)
    ) as resp:
        assert resp.status == 200
    inserted = approx_blocks(ga)
    assert inserted > 0
    await wait_for(lambda: approx_blocks(gb) == inserted, timeout=3.0, what="B inserts A's blocks")
    await asyncio.sleep(0.2)
    assert scaleout(gb).bus.stats.sent.get("prefix", 0) == 0
    assert scaleout(ga).prefix.applied == 0


async def test_admin_route_reports_peers_and_what_is_not_shared(
    replicas: tuple[GatewayRunner, GatewayRunner], session: aiohttp.ClientSession
) -> None:
    ga, gb = replicas
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with session.get(ga.url + "/admin/scaleout", headers=headers) as resp:
        assert resp.status == 200
        doc = await resp.json()
    assert doc["enabled"] is True
    assert doc["mode"] == "replica"
    assert list(doc["peers"]) == [scaleout(gb).origin]
    assert "session-affinity bindings" in doc["not_shared"]
    async with session.get(ga.url + "/admin/scaleout") as resp:
        assert resp.status == 401
    async with session.get(ga.url + "/metrics") as resp:
        text = await resp.text()
    assert "servegate_scaleout_peers 1.0" in text


async def test_a_silent_replica_is_expired_and_its_counts_released(
    sims: SimCluster, session: aiohttp.ClientSession
) -> None:
    a, b = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    async with GatewayRunner(replica_config(sims.urls, a, [b])) as ga:
        await wait_ready(ga, 2)
        gb = GatewayRunner(replica_config(sims.urls, b, [a]))
        await gb.__aenter__()
        try:
            await wait_ready(gb, 2)
            task = asyncio.create_task(
                session.post(gb.url + "/v1/chat/completions", json=chat("x", max_tokens=60))
            )
            await wait_for(
                lambda: sum(r for _, r, _ in in_flight(ga.gateway.pool).values()) == 1,
                timeout=3.0,
                what="A sees B's request",
            )
            # B stops heartbeating without saying goodbye (a crashed or partitioned replica)
            b_scaleout = scaleout(gb)
            await b_scaleout.inflight.stop()
            b_scaleout.bus.publish = lambda msg: None  # type: ignore[method-assign]
            await wait_for(
                lambda: sum(r for _, r, _ in in_flight(ga.gateway.pool).values()) == 0,
                timeout=3.0,
                what="A expires silent B",
            )
            assert scaleout(ga).inflight.expired == 1
            (await task).release()
        finally:
            await gb.__aexit__(None, None, None)


async def test_replicas_find_each_other_through_a_dns_name(
    sims: SimCluster, session: aiohttp.ClientSession
) -> None:
    """`peer_service` resolves to A records (here `localhost` → 127.0.0.1); each replica
    listens on the port the other resolves its name with, and no static peer is listed."""
    port_a, port_b = free_port(), free_port()

    def config(port: int, peer_port: int) -> dict[str, Any]:
        cfg = replica_config(sims.urls, f"tcp://127.0.0.1:{port}", [])
        cfg["scaleout"] |= {"peer_service": "localhost", "peer_port": peer_port}
        return cfg

    async with (
        GatewayRunner(config(port_a, port_b)) as ga,
        GatewayRunner(config(port_b, port_a)) as gb,
    ):
        await wait_ready(ga, 2)
        await wait_ready(gb, 2)
        for gw, other in ((ga, port_b), (gb, port_a)):
            link = scaleout(gw).link
            assert link is not None
            assert link.settings.peers == ()
            assert link.connected == {f"tcp://127.0.0.1:{other}"}
            assert link.lookup_failures == 0
        await wait_for(
            lambda: (
                list(scaleout(ga).inflight.peers) == [scaleout(gb).origin]
                and list(scaleout(gb).inflight.peers) == [scaleout(ga).origin]
            ),
            what="replicas hear each other through the name",
        )
        async with session.post(
            gb.url + "/v1/chat/completions", json=chat(LONG_PROMPT, max_tokens=1)
        ) as resp:
            assert resp.status == 200
        inserted = approx_blocks(gb)
        assert inserted > 0
        await wait_for(
            lambda: approx_blocks(ga) == inserted, timeout=3.0, what="A inserts B's blocks"
        )
