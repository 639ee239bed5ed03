"""`servegate serve --workers 2`: both workers serve one port, share in-flight counts and
prefix insertions, scrape once, and a killed worker is replaced with its counts released."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from servegate.testing.cluster import SimCluster
from tests.integration.conftest import FAST_SIM, chat, gateway_config
from tests.integration.subprocess_gateway import SubprocessGateway

SLOW_SIM = {**FAST_SIM, "speed": 0.05}
ADMIN = {"Authorization": "Bearer admin-key"}
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 20

Views = dict[int, dict[str, Any]]


@pytest.fixture
async def sims() -> AsyncIterator[SimCluster]:
    async with SimCluster(2, base=SLOW_SIM) as c:
        yield c


@pytest.fixture
async def workers(sims: SimCluster) -> AsyncIterator[SubprocessGateway]:
    cfg = gateway_config(sims.urls, admin_keys=["admin-key"], host="127.0.0.1")
    cfg["scaleout"] = {"workers": 2, "heartbeat_s": 0.1, "expiry_s": 1.0}
    async with SubprocessGateway(cfg, ready_endpoints=2) as gw:
        yield gw


async def poll_workers(url: str, done: Callable[[Views], bool], what: str, timeout: float) -> Views:
    """Ask /admin/scaleout over fresh connections (SO_REUSEPORT spreads them over the
    workers) until `done` holds for the latest answer of every worker seen."""
    views: Views = {}
    deadline = time.monotonic() + timeout
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(url + "/admin/scaleout", headers=ADMIN) as resp:
                    doc = await resp.json()
                    views[doc["pid"]] = doc
            live = {pid: v for pid, v in views.items() if _alive(pid)}
            if done(live):
                return live
            await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}; last views: {views}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"
    return True


def paired(views: Views) -> bool:
    """Two workers, each hearing the other."""
    return len(views) == 2 and all(len(v["peers"]) == 1 for v in views.values())


def totals(view: dict[str, Any], column: str) -> int:
    return sum(e[column][0] for pool in view["in_flight"].values() for e in pool.values())


def blocks(view: dict[str, Any]) -> int:
    return sum(p["blocks"] for p in view["prefix"].values())


async def test_workers_share_one_port_and_scrape_once(workers: SubprocessGateway) -> None:
    views = await poll_workers(workers.url, paired, "two workers hearing each other", 20.0)
    assert all(v["mode"] == "worker" and v["enabled"] for v in views.values())
    assert sorted(v["scrapes"] for v in views.values()) == [False, True]


async def test_prefix_insertions_of_one_worker_reach_the_other(
    workers: SubprocessGateway,
) -> None:
    await poll_workers(workers.url, paired, "two workers hearing each other", 20.0)
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            workers.url + "/v1/chat/completions", json=chat(LONG_PROMPT, max_tokens=1)
        ) as resp,
    ):
        assert resp.status == 200
    views = await poll_workers(
        workers.url,
        lambda v: len(v) == 2 and len({blocks(x) for x in v.values()}) == 1
        and all(blocks(x) > 0 for x in v.values()),
        "both workers hold the same prefix blocks",
        10.0,
    )  # fmt: skip
    assert sum(v["prefix_applied"] for v in views.values()) > 0


async def test_in_flight_is_shared_and_a_killed_worker_is_replaced_and_released(
    workers: SubprocessGateway,
) -> None:
    await poll_workers(workers.url, paired, "two workers hearing each other", 20.0)
    session = aiohttp.ClientSession()
    task = asyncio.create_task(
        session.post(workers.url + "/v1/chat/completions", json=chat("hold", max_tokens=200))
    )
    try:
        views = await poll_workers(
            workers.url,
            lambda v: len(v) == 2
            and sorted((totals(x, "local"), totals(x, "peer")) for x in v.values())
            == [(0, 1), (1, 0)],
            "one worker's request counted by the other",
            10.0,
        )  # fmt: skip
        holder = next(pid for pid, v in views.items() if totals(v, "local") == 1)
        os.kill(holder, signal.SIGKILL)
        views = await poll_workers(
            workers.url,
            lambda v: len(v) == 2 and holder not in v and all(totals(x, "total") == 0 for x in v.values()),
            "a replacement worker and the dead worker's count released",
            15.0,
        )  # fmt: skip
        assert all(totals(v, "peer") == 0 for v in views.values())
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            (await task).release()
        await session.close()
