"""Reloading pools, pickers and traffic splits at run time, under load."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from servegate.config import parse_config
from servegate.gateway.reload import ConfigSource, Reloader
from servegate.gateway.server import serve_until_stopped
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import wait_for
from tests.integration.model_routing_helpers import (
    V1,
    V2,
    complete,
    metric,
    pool,
    sim,
    split,
    wait_pools,
)

ADMIN = "admin-key"
RANDOM_PICKER = {
    "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [{"type": "random-picker"}],
    "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "random-picker"}]}],
}


def config(a: SimCluster, b: SimCluster, weights: dict[str, int], **extra: Any) -> dict[str, Any]:
    return {
        "gateway": {"seed": 5, "port": 0, "admin_keys": [ADMIN]},
        "pools": [pool("a", a), pool("b", b)],
        "model_rewrites": [split("chat", weights)],
        **extra,
    }


def write(path: Path, doc: dict[str, Any] | str) -> None:
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


@pytest.fixture
async def two_pools() -> AsyncIterator[tuple[SimCluster, SimCluster]]:
    async with SimCluster(2, base=sim(V1)) as a, SimCluster(1, base=sim(V2)) as b:
        yield a, b


class Load:
    """Requests for `chat`, back to back from several clients, until stopped."""

    def __init__(self, url: str, clients: int = 12) -> None:
        self.url = url
        self.clients = clients
        self.results: list[tuple[float, float, int, str | None]] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _client(self, session: aiohttp.ClientSession) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            status, served, _ = await complete(session, self.url, "chat")
            self.results.append((began, time.monotonic(), status, served))

    async def __aenter__(self) -> Load:
        self._session = aiohttp.ClientSession()
        self._tasks = [
            asyncio.create_task(self._client(self._session)) for _ in range(self.clients)
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 10)
        await self._session.close()

    async def wait_for_more(self, n: int) -> None:
        target = len(self.results) + n
        await wait_for(lambda: len(self.results) >= target, timeout=10, what=f"{n} more requests")


async def _trigger(how: str, gw: GatewayRunner, reloader: Reloader) -> None:
    if how == "call":
        assert (await reloader.reload()).ok
    elif how == "admin":
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                f"{gw.url}/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"}
            )
            body = await resp.json()
        assert (resp.status, body["ok"], body["pools"]) == (200, True, ["a", "b"])


@pytest.mark.parametrize(
    "how", ["call", "admin", "watch"], ids=["sighup-call", "admin-route", "file-watch"]
)
async def test_reload_under_load_moves_traffic_without_a_failed_request(
    two_pools: tuple[SimCluster, SimCluster], tmp_path: Path, how: str
) -> None:
    a, b = two_pools
    path = tmp_path / "servegate.yaml"
    before = config(a, b, {V1: 100, V2: 0})
    write(path, before)
    source = ConfigSource(path, environ={})
    async with GatewayRunner(parse_config(path.read_text(), environ={}), source=source) as gw:
        reloader = gw.reloader
        await wait_pools(gw, {"a": V1, "b": V2})
        old_a = gw.gateway.runtime("a")
        assert old_a is not None
        snapshot = gw.gateway.snapshot
        if how == "watch":
            reloader.watch(0.05)
        async with Load(gw.url) as load:
            await load.wait_for_more(100)
            asked = time.monotonic()
            after = config(a, b, {V1: 0, V2: 100})
            after["pools"][0]["picker"] = RANDOM_PICKER
            write(path, after)
            await _trigger(how, gw, reloader)
            await wait_for(lambda: gw.gateway.snapshot is not snapshot, 5, what="the reload")
            switched = time.monotonic()
            await load.wait_for_more(100)
        assert [r for r in load.results if r[2] != 200] == []
        assert {served for _, ended, _, served in load.results if ended < asked} == {V1}
        assert {served for began, _, _, served in load.results if began > switched} == {V2}
        new_a = gw.gateway.runtime("a")
        assert new_a is not None and new_a is not old_a
        assert new_a.pool is old_a.pool  # the pool's live state survived the picker change
        assert "random-picker" in new_a.scheduler.plugins
        await wait_for(lambda: not old_a.started, what="the old runtime to stop")
        assert new_a.pool.ready_count() == 2
        text = gw.gateway.metrics.render().decode()
        assert metric(text, "servegate_config_reloads_total", {"result": "success"}) == 1


BROKEN = [
    ("pools: [unclosed", "not valid YAML"),
    ("pools: [{name: a, scrape_interval_s: fast}]", "pools.0.scrape_interval_s"),
    (
        "pools: [{name: a, picker: {apiVersion: inference.networking.x-k8s.io/v1alpha1,"
        " kind: EndpointPickerConfig, plugins: [{type: no-such-plugin}]}}]",
        "no-such-plugin",
    ),
    ("picker: missing-picker.yaml", "cannot read"),
    (
        "model_rewrites: [{rules: [{matches: [{model: x}], targets: [{modelRewrite: y, weight: 0}]}]}]",
        "must add up to more than 0",
    ),
]


@pytest.mark.parametrize(
    ("text", "reason"),
    BROKEN,
    ids=["invalid-yaml", "invalid-field", "unknown-plugin", "missing-picker-file", "zero-weights"],
)
async def test_a_broken_reload_keeps_the_old_config_and_says_why(
    two_pools: tuple[SimCluster, SimCluster], tmp_path: Path, text: str, reason: str
) -> None:
    a, b = two_pools
    path = tmp_path / "servegate.yaml"
    write(path, config(a, b, {V1: 100, V2: 0}))
    source = ConfigSource(path, environ={})
    async with GatewayRunner(parse_config(path.read_text(), environ={}), source=source) as gw:
        reloader = gw.reloader
        await wait_pools(gw, {"a": V1, "b": V2})
        snapshot = gw.gateway.snapshot
        write(path, text)
        result = await reloader.reload()
        assert not result.ok and result.error is not None and reason in result.error
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                f"{gw.url}/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"}
            )
            body = await resp.json()
            status, served, _ = await complete(session, gw.url, "chat")
        assert resp.status == 422 and reason in body["error"]
        assert (status, served) == (200, V1)
        assert gw.gateway.snapshot is snapshot
        text_metrics = gw.gateway.metrics.render().decode()
        assert metric(text_metrics, "servegate_config_reloads_total", {"result": "failure"}) == 2


async def test_reload_adds_and_removes_pools(
    two_pools: tuple[SimCluster, SimCluster], tmp_path: Path
) -> None:
    a, b = two_pools
    path = tmp_path / "servegate.yaml"
    write(path, config(a, b, {V1: 1}))
    async with (
        SimCluster(1, base=sim("chat-v3")) as c,
        GatewayRunner(
            parse_config(path.read_text(), environ={}), source=ConfigSource(path, environ={})
        ) as gw,
    ):
        reloader = gw.reloader
        await wait_pools(gw, {"a": V1, "b": V2})
        old_b = gw.gateway.runtime("b")
        assert old_b is not None
        old_feed = gw.running.feeds[old_b.state]
        doc = config(a, b, {"chat-v3": 1})
        doc["pools"] = [pool("a", a), pool("c", c)]
        write(path, doc)
        result = await reloader.reload()
        assert (result.ok, result.pools) == (True, ("a", "c"))
        async with aiohttp.ClientSession() as session:
            assert (await complete(session, gw.url, "chat"))[:2] == (200, "chat-v3")
            assert (await complete(session, gw.url, V2))[0] == 404
            models = await (await session.get(f"{gw.url}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["chat", V1, "chat-v3"]
        await wait_for(lambda: not old_b.started, what="the removed pool to stop")
        assert old_b.state not in gw.running.feeds
        assert old_feed.datalayer.watched() == []  # its scrapes and health checks stopped


async def test_sighup_and_a_watched_file_reload_the_server(
    two_pools: tuple[SimCluster, SimCluster], tmp_path: Path
) -> None:
    a, b = two_pools
    path = tmp_path / "servegate.yaml"
    doc = config(a, b, {V1: 1}, reload={"watch": True, "interval_s": 0.05})
    write(path, doc)
    cfg = parse_config(path.read_text(), environ={})
    ports: list[int] = []
    stop = asyncio.Event()
    server = asyncio.create_task(
        serve_until_stopped(
            cfg, tmp_path, stop, 1.0, ports.append, source=ConfigSource(path, environ={})
        )
    )
    try:
        await wait_for(lambda: bool(ports), what="the server to listen")
        url = f"http://127.0.0.1:{ports[0]}"
        async with aiohttp.ClientSession() as session:

            async def serves(model: str) -> bool:
                return (await complete(session, url, "chat"))[1] == model

            await wait_for_async(lambda: serves(V1))
            write(path, config(a, b, {V2: 1}))  # SIGHUP first; the watcher may beat it
            os.kill(os.getpid(), signal.SIGHUP)
            await wait_for_async(lambda: serves(V2))
            write(path, config(a, b, {V1: 1}, reload={"watch": True, "interval_s": 0.05}))
            await wait_for_async(lambda: serves(V1))
    finally:
        stop.set()
        await asyncio.wait_for(server, 10)


async def wait_for_async(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")
