"""A gateway whose pool comes from Kubernetes discovery, serving while pods churn.

The API server is `FakeKubeApi` (the real list/watch protocol on 127.0.0.1); the
pods are simulators. Kubernetes gives every pod its own IP and the same target
port, so the simulated pods listen on distinct loopback addresses (127.0.0.2,
127.0.0.3, …) at one free port, and the data-parallel pod on 127.0.0.1 at two.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from servegate.testing.kubeapi import FakeKubeApi
from tests.integration.conftest import FAST_SIM, chat, wait_for

APP = {"app": "sim", "llm-d.ai/inferenceServing": "true"}


def common_free_port(hosts: list[str]) -> int:
    """A port free on every host (pods share their target port), chosen by the kernel."""
    for _ in range(50):
        first = socket.socket()
        first.bind((hosts[0], 0))
        port = int(first.getsockname()[1])
        held = [first]
        try:
            for host in hosts[1:]:
                sock = socket.socket()
                held.append(sock)
                sock.bind((host, port))
            return port
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no common free port")


def gateway_config(kubeconfig: Path, ports: list[int]) -> dict[str, Any]:
    return {
        "gateway": {"seed": 3, "port": 0, "debug_headers": True},
        "pool": {
            "scrape_interval_s": 0.05,
            "health": {"interval_s": 0.1, "timeout_s": 0.5, "failure_threshold": 1},
            "discovery": {
                "kind": "kubernetes",
                "kubeconfig": str(kubeconfig),
                "selector": {"matchLabels": {"app": "sim"}},
                "target_ports": ports,
                "backoff_initial_s": 0.02,
                "backoff_max_s": 0.2,
                "watch_timeout_s": 5,
            },
        },
    }


class Load:
    """Sequential requests through the gateway until stopped; every status is kept."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url
        self.statuses: Counter[int] = Counter()
        self.served_by: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            async with self.session.post(f"{self.url}/v1/chat/completions", json=chat()) as resp:
                await resp.read()
                self.statuses[resp.status] += 1
                self.served_by[resp.headers.get("x-gateway-destination-endpoint", "")] += 1

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi(namespace="serving", token="t0ken", bookmark_interval_s=0.2) as fake:
        yield fake


async def test_requests_keep_succeeding_while_pods_churn(api: FakeKubeApi, tmp_path: Path) -> None:
    hosts = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    port = common_free_port(hosts)
    overrides = [{"host": h, "port": port} for h in hosts]
    async with (
        SimCluster(3, base=FAST_SIM, overrides=overrides) as cluster,
        GatewayRunner(gateway_config(api.write_kubeconfig(tmp_path / "kc"), [port])) as gw,
        aiohttp.ClientSession() as session,
    ):
        pool = gw.gateway.pool
        a, b, c = (f"{h}:{port}" for h in hosts)
        async with session.get(f"{gw.url}/ready") as resp:
            assert resp.status == 503  # no pods yet

        api.add_pod("sim-a", hosts[0], APP, ready=True)
        api.add_pod("sim-b", hosts[1], APP, ready=True)
        await wait_for(lambda: {s.address for s in pool} == {a, b}, 1.0, "pods a and b joined")
        await wait_for(lambda: pool.ready_count() == 2, 2.0, "a and b healthy")

        load = Load(session, gw.url)
        load.start()
        try:
            api.add_pod("sim-c", hosts[2], APP)  # scheduled, not ready: not in the pool
            await asyncio.sleep(0.2)
            assert c not in {s.address for s in pool}
            api.set_ready("sim-c", True)
            await wait_for(lambda: pool.get(c) is not None, 1.0, "c joined when ready")
            await wait_for(lambda: load.served_by[c] > 0, 3.0, "c took traffic")

            api.set_labels("sim-b", {"app": "retired"})  # leaves the selector
            await wait_for(lambda: pool.get(b) is None, 1.0, "b left")

            api.pause()  # the watch misses the next changes, then expires (410)
            api.delete_pod("sim-a")
            api.expire()
            await wait_for(lambda: pool.get(a) is None, 1.0, "a dropped by the relist")
            assert api.lists() == 2

            api.set_labels("sim-b", APP)  # the new watch works
            await wait_for(lambda: pool.get(b) is not None, 1.0, "b back")
            before = load.served_by[b]
            await wait_for(lambda: load.served_by[b] > before, 3.0, "b took traffic again")
        finally:
            await load.stop()
        assert set(load.statuses) == {200}, load.statuses
        assert sum(load.statuses.values()) >= 10
        assert {a, b, c} <= set(load.served_by)
        assert len(cluster) == 3


async def test_a_data_parallel_pod_serves_on_every_rank(api: FakeKubeApi, tmp_path: Path) -> None:
    async with SimCluster(2, base=FAST_SIM) as ranks:
        ports = [handle.server.port for handle in ranks]
        cfg = gateway_config(api.write_kubeconfig(tmp_path / "kc"), ports)
        async with GatewayRunner(cfg) as gw, aiohttp.ClientSession() as session:
            api.add_pod("dp-0", "127.0.0.1", APP, ready=True)
            await wait_for(lambda: gw.gateway.pool.ready_count() == 2, 2.0, "both ranks ready")
            served: Counter[str] = Counter()
            for _ in range(12):
                async with session.post(f"{gw.url}/v1/chat/completions", json=chat()) as resp:
                    assert resp.status == 200
                    served[resp.headers["x-gateway-destination-endpoint"]] += 1
            assert set(served) == {h.address for h in ranks}
