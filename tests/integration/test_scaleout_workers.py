"""`servegate serve --workers 2`: both workers serve one port, share in-flight counts and
prefix insertions, scrape once, and a killed worker is replaced with its counts released."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from servegate.testing.cluster import SimCluster
from tests.integration.conftest import (
    FAST_SIM,
    MODEL,
    chat,
    gateway_config,
    single_scorer_picker,
)
from tests.integration.model_routing_helpers import split
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


# -- leader takeover in live processes ---------------------------------------------------

SCRAPE_S = 0.2
TAKEOVER = {
    "workers": 2,
    "heartbeat_s": 0.1,
    "expiry_s": 1.0,
    "leader_takeover_s": 0.5,
    "restart_backoff_s": 2.0,
}


class ScrapeCounter(Collector):
    """Counts renders of a simulator's registry: one per GET of its /metrics."""

    def __init__(self) -> None:
        self.hits = 0

    def collect(self) -> Iterable[Metric]:
        self.hits += 1
        return ()


async def one_process_view(url: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """/admin/scaleout and /admin/pools over one kept-alive connection, so from one
    worker; None when the two answers came from different pids (a reconnect)."""
    connector = aiohttp.TCPConnector(limit=1)
    timeout = aiohttp.ClientTimeout(total=3.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        docs = []
        for path in ("/admin/scaleout", "/admin/pools", "/admin/scaleout"):
            async with session.get(url + path, headers=ADMIN) as resp:
                docs.append(await resp.json())
    first, pools, last = docs
    return (first, pools) if first["pid"] == last["pid"] else None


def fresh(pools: dict[str, Any], within_s: float) -> bool:
    endpoints = [e for p in pools["pools"] for e in p["endpoints"]]
    return bool(endpoints) and all(
        e["available"] and e["metrics"]["age_s"] is not None and e["metrics"]["age_s"] < within_s
        for e in endpoints
    )


async def wait_view(
    url: str, done: Callable[[dict[str, Any], dict[str, Any]], bool], what: str, timeout: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    deadline = time.monotonic() + timeout
    last: tuple[dict[str, Any], dict[str, Any]] | None = None
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            last = await one_process_view(url)
            if last is not None and done(*last):
                return last
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}; last view: {last}")


async def watch_endpoints(url: str, pid: int, lapses: list[Any]) -> None:
    """Record every view of worker `pid` in which an endpoint is unavailable or unscraped."""
    while True:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            view = await one_process_view(url)
            if view is not None and view[0]["pid"] == pid and not fresh(view[1], 2.0):
                lapses.append(
                    [
                        (e["address"], e["healthy"], e["metrics"]["age_s"])
                        for p in view[1]["pools"]
                        for e in p["endpoints"]
                    ]
                )
        await asyncio.sleep(0.01)


@pytest.fixture
async def takeover_workers(sims: SimCluster) -> AsyncIterator[SubprocessGateway]:
    cfg = gateway_config(sims.urls, admin_keys=["admin-key"], host="127.0.0.1")
    cfg["pool"]["scrape_interval_s"] = SCRAPE_S
    cfg["scaleout"] = TAKEOVER
    async with SubprocessGateway(cfg, ready_endpoints=2) as gw:
        yield gw


async def test_a_follower_takes_over_scraping_from_a_killed_leader_and_hands_back(
    sims: SimCluster, takeover_workers: SubprocessGateway
) -> None:
    url = takeover_workers.url
    views = await poll_workers(url, paired, "two workers hearing each other", 20.0)
    leader = next(pid for pid, v in views.items() if v["leader"])
    follower = next(pid for pid in views if pid != leader)
    assert views[follower]["scrapes"] is False

    os.kill(leader, signal.SIGKILL)
    # until the supervisor restarts worker 0 (restart_backoff_s), only the follower listens
    doc, _ = await wait_view(
        url,
        lambda d, p: d["pid"] == follower and d["scrapes"] and fresh(p, 4 * SCRAPE_S),
        "the follower scraping on its own, its endpoints fresh",
        TAKEOVER["restart_backoff_s"] + 1.0,
    )
    assert doc["takeovers"] == 1

    # through the leader's restart the follower never loses its endpoints
    lapses: list[Any] = []
    watch = asyncio.create_task(watch_endpoints(url, follower, lapses))
    try:
        views = await poll_workers(
            url,
            lambda v: len(v) == 2 and leader not in v
            and sorted((x["leader"], x["scrapes"]) for x in v.values())
            == [(False, False), (True, True)],
            "a restarted leader scraping and the follower handing back",
            20.0,
        )  # fmt: skip
        for _ in range(10):  # both workers, after the hand-back
            await wait_view(url, lambda d, p: fresh(p, 4 * SCRAPE_S), "fresh endpoints", 5.0)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
    assert not lapses, lapses[:3]

    counters = [ScrapeCounter() for _ in sims]
    for sim, counter in zip(sims, counters, strict=True):
        sim.state.registry.register(counter)
    window_s = 2.0
    await asyncio.sleep(window_s)
    hits = [c.hits for c in counters]
    one_scraper = window_s / SCRAPE_S + 2
    assert all(1 <= h <= one_scraper for h in hits), (hits, one_scraper)


# -- reload under the supervisor ----------------------------------------------------------


class WorkersFlagGateway(SubprocessGateway):
    """`servegate serve --workers 2 --config F`: the worker count from the command line."""

    @property
    def config_path(self) -> Path:
        return self.log_path.parent / "gateway.yaml"

    def rewrite(self, config: dict[str, Any]) -> None:
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({**config, "gateway": self.config["gateway"]}))
        tmp.replace(self.config_path)

    async def __aenter__(self) -> WorkersFlagGateway:
        self.config_path.write_text(yaml.safe_dump(self.config))
        with self.log_path.open("wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "servegate.cli", "serve", "--workers", "2",
                "--config", str(self.config_path),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
        try:
            await self._wait_ready(30.0)
        except BaseException:
            await self.close()
            raise
        return self


def reload_config(urls: list[str], **extra: Any) -> dict[str, Any]:
    cfg = gateway_config(urls, admin_keys=["admin-key"], host="127.0.0.1")
    cfg["scaleout"] = {"heartbeat_s": 0.1, "expiry_s": 1.0}
    return {**cfg, **extra}


async def views_per_worker(
    url: str, done: Callable[[dict[str, Any], dict[str, Any]], bool], what: str, timeout: float
) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
    """Per live worker, its latest (/admin/scaleout, /admin/pools), until `done` holds for two."""
    views: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            view = await one_process_view(url)
            if view is not None:
                views[view[0]["pid"]] = view
        live = {pid: v for pid, v in views.items() if _alive(pid)}
        if len(live) == 2 and all(done(*v) for v in live.values()):
            return live
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}; last views: {views}")


async def test_sighup_reloads_every_worker_and_prefix_sharing_follows_the_new_scheduler(
    sims: SimCluster,
) -> None:
    async with WorkersFlagGateway(reload_config(sims.urls), ready_endpoints=2) as gw:
        await poll_workers(gw.url, paired, "two workers hearing each other", 20.0)
        async with aiohttp.ClientSession() as session:
            async with session.post(
                gw.url + "/v1/chat/completions", json=chat(LONG_PROMPT, max_tokens=1)
            ) as resp:
                assert resp.status == 200
            before = await views_per_worker(
                gw.url, lambda d, p: blocks(d) > 0, "blocks in both before the reload", 10.0
            )
            (held,) = {blocks(d) for d, _ in before.values()}

            gw.rewrite(
                reload_config(
                    sims.urls,
                    picker=single_scorer_picker("prefix-cache-scorer"),
                    model_rewrites=[split("chat", {MODEL: 1})],
                )
            )
            os.kill(gw.pid, signal.SIGHUP)
            # the pool owns the index (same scorer settings): both workers keep what they
            # learned across the new scheduler
            await views_per_worker(
                gw.url,
                lambda d, p: "chat" in p["model_rewrites"] and blocks(d) == held,
                "both workers on the new config, index kept",
                15.0,
            )

            async with session.post(
                gw.url + "/v1/chat/completions",
                json={**chat("another prompt " * 40, max_tokens=1), "model": "chat"},
            ) as resp:
                assert resp.status == 200
            views = await views_per_worker(
                gw.url,
                lambda d, p: blocks(d) > held,
                "the insertion after the reload in both workers",
                10.0,
            )
        assert len({blocks(d) for d, _ in views.values()}) == 1
        assert sum(d["prefix_applied"] for d, _ in views.values()) > 0
