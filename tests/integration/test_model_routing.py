"""Several pools, aliases and traffic splits, end to end over simulated replicas."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.model_routing_helpers import (
    V1,
    V2,
    complete,
    many,
    metric,
    pool,
    sim,
    split,
    wait_pools,
)


def config(a: SimCluster, b: SimCluster, rewrites: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "gateway": {"seed": 11, "port": 0},
        "pools": [pool("a", a), pool("b", b)],
        "model_rewrites": rewrites,
    }


@pytest.fixture
async def two_pools() -> AsyncIterator[tuple[SimCluster, SimCluster]]:
    async with SimCluster(2, base=sim(V1)) as a, SimCluster(1, base=sim(V2)) as b:
        yield a, b


@pytest.fixture
async def gateway(two_pools: tuple[SimCluster, SimCluster]) -> AsyncIterator[GatewayRunner]:
    a, b = two_pools
    rewrites = [
        split("chat", {V1: 90, V2: 10}),
        split("chat-sticky", {V1: 50, V2: 50}, sticky=True),
        split("ghost", {"no-such-model": 1}),
    ]
    async with GatewayRunner(config(a, b, rewrites)) as gw:
        await wait_pools(gw, {"a": V1, "b": V2})
        yield gw


async def test_a_90_10_split_over_3000_requests(gateway: GatewayRunner) -> None:
    n, p = 3000, 0.1
    async with aiohttp.ClientSession() as session:
        results = await many(session, gateway.url, "chat", n)
        metrics_text = await (await session.get(f"{gateway.url}/metrics")).text()
    assert {status for status, _, _ in results} == {200}
    served = [model for _, model, _ in results]
    # The replica answered with the model it was asked for: the rewrite reached it.
    assert set(served) == {V1, V2}
    assert [header for _, _, header in results] == served
    tolerance = 4 * math.sqrt(n * p * (1 - p))  # 4 sigma of the binomial: ±66
    assert abs(served.count(V2) - n * p) <= tolerance, served.count(V2)
    for target in (V1, V2):
        labels = {"model_name": "chat", "target_model_name": target}
        assert metric(metrics_text, "inference_objective_request_total", labels) == served.count(
            target
        )
        count = metric(metrics_text, "inference_objective_request_duration_seconds_count", labels)
        assert count == served.count(target)
    lines = [line for line in gateway.access_lines() if line["model"] == "chat"]
    assert len(lines) == n
    assert {(line["target_model"], line["pool"]) for line in lines} == {(V1, "a"), (V2, "b")}


async def test_sticky_sessions_never_flip(gateway: GatewayRunner) -> None:
    sessions, rounds = 120, 4
    seen: dict[str, set[str | None]] = {}
    async with aiohttp.ClientSession() as session:
        for _ in range(rounds):
            for i in range(sessions):
                sid = f"conversation-{i}"
                status, served, _ = await complete(
                    session, gateway.url, "chat-sticky", {"x-session-id": sid}
                )
                assert status == 200
                seen.setdefault(sid, set()).add(served)
    assert all(len(models) == 1 for models in seen.values())
    both = {next(iter(models)) for models in seen.values()}
    assert both == {V1, V2}


@pytest.mark.parametrize(
    ("model", "status", "served"),
    [
        (V1, 200, V1),
        (V2, 200, V2),
        ("ghost", 404, None),
        ("nothing", 404, None),
    ],
    ids=["pool-a-directly", "pool-b-directly", "rewrite-to-unserved-model", "unknown-model"],
)
async def test_models_reach_their_pool(
    gateway: GatewayRunner, model: str, status: int, served: str | None
) -> None:
    async with aiohttp.ClientSession() as session:
        got_status, got_served, _ = await complete(session, gateway.url, model)
    assert got_status == status
    if served is not None:
        assert got_served == served


async def test_models_lists_public_names(gateway: GatewayRunner) -> None:
    async with aiohttp.ClientSession() as session:
        data = await (await session.get(f"{gateway.url}/v1/models")).json()
    ids = [entry["id"] for entry in data["data"]]
    assert ids == sorted(["chat", "chat-sticky", "ghost", V1, V2])
    chat = next(entry for entry in data["data"] if entry["id"] == "chat")
    assert chat["root"] == V1


async def test_the_rewrite_error_names_the_target(gateway: GatewayRunner) -> None:
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            f"{gateway.url}/v1/completions", json={"model": "ghost", "prompt": "x"}
        )
        body = await resp.json()
    assert "no-such-model" in body["error"]["message"]


async def test_every_pool_has_its_own_runtime(gateway: GatewayRunner) -> None:
    gw = gateway.gateway
    names = [r.name for r in gw.pool_runtimes()]
    assert names == ["a", "b"]
    assert gw.pool is gw.pool_runtimes()[0].pool
    a, b = gw.pool_runtimes()
    assert a.scheduler is not b.scheduler and a.admission is not b.admission
    assert {s.address for s in a.pool}.isdisjoint({s.address for s in b.pool})
