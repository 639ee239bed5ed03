"""Ray discovery without Ray: the registry's leases, record decoding, pool reconciliation."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError
from tests.unit.fake_replica import wait_until

from servegate.pool.discovery import DiscoverySettings, RayDiscoverySettings, start_discovery
from servegate.pool.discovery.ray import (
    RayDiscovery,
    ReplicaRecord,
    ReplicaRegistry,
    decode_records,
)
from servegate.pool.pool import Pool


def record(n: int, **extra: Any) -> dict[str, Any]:
    return {"replica_id": f"r{n}", "url": f"http://127.0.0.1:{9000 + n}", **extra}


class FakeSource:
    """The registry deployment, as the discovery sees it through a Serve handle."""

    def __init__(self, registry: ReplicaRegistry) -> None:
        self.registry = registry
        self.fail = False
        self.calls = 0

    async def fetch(self) -> Sequence[Mapping[str, Any]]:
        self.calls += 1
        if self.fail:
            raise ConnectionError("registry replica restarting")
        return self.registry.snapshot()


SETTINGS = RayDiscoverySettings(kind="ray", poll_interval_s=0.01)


@pytest.mark.parametrize(
    ("events", "at", "expected"),
    [
        ([("register", 1, 0.0)], 4.9, {"r1"}),
        ([("register", 1, 0.0)], 5.0, set()),
        ([("register", 1, 0.0), ("register", 1, 4.0)], 8.0, {"r1"}),
        ([("register", 1, 0.0), ("register", 2, 0.0), ("deregister", 1, 1.0)], 2.0, {"r2"}),
        ([("deregister", 3, 0.0)], 0.0, set()),
    ],
    ids=["lease-live", "lease-expired", "renewed", "deregistered", "unknown-deregister"],
)
def test_registry_leases(
    events: list[tuple[str, int, float]], at: float, expected: set[str]
) -> None:
    registry = ReplicaRegistry(lease_s=5.0)
    for op, n, t in events:
        if op == "register":
            registry.register(record(n), now=t)
        else:
            registry.deregister(f"r{n}")
    assert {r["replica_id"] for r in registry.snapshot(now=at)} == expected


@pytest.mark.parametrize(
    "bad",
    [
        {"url": "http://127.0.0.1:1"},
        {"replica_id": "r", "url": "127.0.0.1:1"},
        {"replica_id": "r", "url": "http://127.0.0.1:1/path"},
        {"replica_id": "r", "url": "http://h:1", "colour": "blue"},
        {"replica_id": "r", "url": "http://h:1", "role": "chef"},
    ],
    ids=["no-id", "no-scheme", "path", "unknown-key", "bad-role"],
)
def test_registry_refuses_bad_records(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ReplicaRegistry().register(bad)


def test_decode_records_skips_what_does_not_decode() -> None:
    records = decode_records([record(1), {"replica_id": "x"}, "junk", record(2, model="m")])
    assert [r.replica_id for r in records] == ["r1", "r2"]
    assert records[1].model == "m"


def test_record_becomes_an_endpoint() -> None:
    ep = ReplicaRecord.model_validate(record(1, engine="sglang", labels={"zone": "a"}))
    endpoint = ep.to_endpoint("pool-a")
    assert (endpoint.address, endpoint.url, endpoint.engine, endpoint.pool) == (
        "127.0.0.1:9001",
        "http://127.0.0.1:9001",
        "sglang",
        "pool-a",
    )
    assert endpoint.labels == {"servegate.io/ray-replica": "r1", "zone": "a"}


async def test_pool_follows_the_registry() -> None:
    registry = ReplicaRegistry(lease_s=60)
    pool = Pool()
    discovery = RayDiscovery(SETTINGS, pool, FakeSource(registry))
    registry.register(record(1))
    registry.register(record(2))
    await discovery.poll_once()
    assert sorted(s.address for s in pool) == ["127.0.0.1:9001", "127.0.0.1:9002"]
    registry.deregister("r1")
    registry.register(record(3))
    await discovery.poll_once()
    assert sorted(s.address for s in pool) == ["127.0.0.1:9002", "127.0.0.1:9003"]
    assert sorted(discovery.endpoints()) == ["127.0.0.1:9002", "127.0.0.1:9003"]


async def test_a_replica_that_changes_its_record_is_replaced() -> None:
    registry = ReplicaRegistry(lease_s=60)
    pool = Pool()
    discovery = RayDiscovery(SETTINGS, pool, FakeSource(registry))
    registry.register(record(1))
    await discovery.poll_once()
    registry.register(record(1, model="bigger"))
    await discovery.poll_once()
    [state] = list(pool)
    assert state.endpoint.model == "bigger"


async def test_unreachable_registry_keeps_the_pool_and_retries() -> None:
    registry = ReplicaRegistry(lease_s=60)
    registry.register(record(1))
    pool = Pool()
    source = FakeSource(registry)
    discovery = RayDiscovery(SETTINGS, pool, source)
    await discovery.start()
    try:
        await asyncio.wait_for(discovery.synced.wait(), 5)
        source.fail = True
        calls = source.calls
        await wait_until(lambda: discovery.errors >= 2 and source.calls >= calls + 2, 5)
        assert [s.address for s in pool] == ["127.0.0.1:9001"]
        source.fail = False
        registry.register(record(2))
        await wait_until(lambda: len(list(pool)) == 2, 5)
    finally:
        await discovery.stop()


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        ({"kind": "ray", "registry": ""}, "registry"),
        ({"kind": "ray", "poll_interval_s": 0}, "poll_interval_s"),
        ({"kind": "ray", "selector": {}}, "selector"),
    ],
    ids=["empty-registry", "zero-interval", "unknown-key"],
)
def test_settings_are_strict(doc: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        TypeAdapter(DiscoverySettings).validate_python(doc)


def test_settings_defaults() -> None:
    settings = TypeAdapter(DiscoverySettings).validate_python({"kind": "ray"})
    assert settings == RayDiscoverySettings(kind="ray")
    assert (settings.app, settings.registry) == (None, "ReplicaRegistry")


async def test_start_discovery_without_ray_polls_and_stops_cleanly() -> None:
    """Outside a Ray worker the registry cannot be read: the pool stays as it is."""
    pool = Pool()
    discovery = await start_discovery(
        RayDiscoverySettings(kind="ray", app="servegate", poll_interval_s=0.01), pool
    )
    assert isinstance(discovery, RayDiscovery)
    try:
        await wait_until(lambda: discovery.errors >= 1, 5)
        assert list(pool) == []
    finally:
        await discovery.stop()
