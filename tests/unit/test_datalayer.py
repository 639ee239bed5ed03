from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from fake_replica import FakeReplica, fixture_page, wait_until

from servegate.datalayer import DataLayer, HealthSettings, ScrapeSettings
from servegate.engines import EngineRegistry
from servegate.pool.endpoint import Endpoint
from servegate.pool.pool import Pool

FAST_SCRAPE = ScrapeSettings(scrape_interval_s=0.05, scrape_timeout_s=0.3)
FAST_HEALTH = HealthSettings(interval_s=0.05, timeout_s=0.3)
MODELS: list[dict[str, object]] = [{"id": "tiny", "parent": None}]
IN_FLIGHT = 2
"""Requests an endpoint may still receive once its tasks are cancelled: a scrape and a
probe already written land, however late."""


def polls(replica: FakeReplica) -> int:
    return sum(replica.requests.values())


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def replicas() -> AsyncIterator[list[FakeReplica]]:
    servers = [await FakeReplica(fixture_page("vllm"), MODELS).start() for _ in range(2)]
    yield servers
    for server in servers:
        await server.stop()


def endpoint(replica: FakeReplica, engine: str = "vllm") -> Endpoint:
    return Endpoint(replica.address, replica.url, engine=engine)


async def test_follows_pool_membership(
    replicas: list[FakeReplica], session: aiohttp.ClientSession
) -> None:
    first, second = replicas
    pool = Pool()
    pool.add(endpoint(first))
    layer = DataLayer(pool, session, EngineRegistry(), FAST_SCRAPE, FAST_HEALTH)
    await layer.start()
    try:
        state = pool.get(first.address)
        assert state is not None
        await wait_until(lambda: state.healthy and state.metrics.scraped_at > 0)
        assert state.served_models == frozenset({"tiny"})

        second_state = pool.add(endpoint(second))
        await wait_until(lambda: second_state.healthy and second_state.metrics.block_size == 32)
        assert layer.watched() == sorted([first.address, second.address])
        assert set(layer.scrape_stats()) == set(layer.health_stats()) == set(layer.watched())

        landed = polls(first)
        pool.remove(first.address)
        assert layer.watched() == [second.address]
        # the replica still watched is the clock: however slow the machine, its next polls
        # take several of the removed replica's intervals
        clock = polls(second)
        await wait_until(lambda: polls(second) >= clock + 10)
        late = polls(first) - landed
        assert late <= IN_FLIGHT, f"a removed endpoint is no longer polled ({late} late probes)"
        landed = polls(second)
    finally:
        await layer.stop()
    assert layer.watched() == []
    await asyncio.sleep(10 * FAST_SCRAPE.scrape_interval_s)
    late = polls(second) - landed
    assert late <= IN_FLIGHT, f"stop() ends every task ({late} late probes)"


async def test_replaced_endpoint_gets_new_tasks(
    replicas: list[FakeReplica], session: aiohttp.ClientSession
) -> None:
    replica = replicas[0]
    pool = Pool()
    pool.add(endpoint(replica))
    layer = DataLayer(pool, session, scrape=FAST_SCRAPE, health=FAST_HEALTH)
    await layer.start()
    try:
        old = layer.scrape_stats()[replica.address]
        replica.page = fixture_page("sglang")
        state = pool.add(endpoint(replica, "sglang"))
        await wait_until(lambda: state.metrics.waiting == 3.0)
        assert layer.scrape_stats()[replica.address] is not old
    finally:
        await layer.stop()


async def test_unknown_engine_gets_no_tasks(
    replicas: list[FakeReplica], session: aiohttp.ClientSession
) -> None:
    pool = Pool()
    layer = DataLayer(pool, session, scrape=FAST_SCRAPE, health=FAST_HEALTH)
    await layer.start()
    try:
        state = pool.add(endpoint(replicas[0], "tgi"))
        assert layer.unknown_engine_endpoints == 1
        assert layer.watched() == []
        assert not state.healthy
    finally:
        await layer.stop()


async def test_health_disabled_trusts_endpoints(
    replicas: list[FakeReplica], session: aiohttp.ClientSession
) -> None:
    pool = Pool()
    layer = DataLayer(pool, session, scrape_enabled=False, health_enabled=False)
    await layer.start()
    try:
        state = pool.add(endpoint(replicas[0]))
        assert state.healthy
        assert layer.scrape_stats() == {}
        assert layer.health_stats() == {}
    finally:
        await layer.stop()
    assert sum(replicas[0].requests.values()) == 0


async def test_events_after_stop_are_ignored(
    replicas: list[FakeReplica], session: aiohttp.ClientSession
) -> None:
    pool = Pool()
    layer = DataLayer(pool, session, scrape=FAST_SCRAPE, health=FAST_HEALTH)
    await layer.start()
    await layer.stop()
    pool.add(endpoint(replicas[0]))
    assert layer.watched() == []
    await layer.start()
    try:
        assert layer.watched() == [replicas[0].address]
    finally:
        await layer.stop()
