"""A gateway with Kubernetes discovery applies the cluster's InferenceObjectives and
InferenceModelRewrites, follows their changes, and keeps them across a config reload.

The API server is `FakeKubeApi`; the pod is a simulator on 127.0.0.2.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from servegate.config import parse_config
from servegate.extproc.server import ExtProcServer
from servegate.gateway.app import build_gateway
from servegate.gateway.reload import ConfigSource
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from servegate.testing.kubeapi import FakeKubeApi
from tests.integration.conftest import FAST_SIM, MODEL, chat, wait_for
from tests.integration.test_kubernetes_discovery import common_free_port

POOL = "llm-pool"
APP = {"app": "sim", "llm-d.ai/inferenceServing": "true"}
OBJECTIVE = "x-llm-d-inference-objective"


def gateway_config(kubeconfig: Path, port: int, **extra: Any) -> dict[str, Any]:
    return {
        "gateway": {"seed": 3, "port": 0},
        "pool": {
            "name": POOL,
            "scrape_interval_s": 0.05,
            "health": {"interval_s": 0.1, "timeout_s": 0.5, "failure_threshold": 1},
            "discovery": {
                "kind": "kubernetes",
                "kubeconfig": str(kubeconfig),
                "selector": {"matchLabels": {"app": "sim"}},
                "target_ports": [port],
                "backoff_initial_s": 0.02,
                "backoff_max_s": 0.2,
                "watch_timeout_s": 5,
            },
        },
        **extra,
    }


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi(namespace="serving", token="t0ken", bookmark_interval_s=0.2) as fake:
        yield fake


@contextlib.asynccontextmanager
async def serving(
    api: FakeKubeApi, config: dict[str, Any], port: int, source: ConfigSource | None = None
) -> AsyncIterator[tuple[GatewayRunner, aiohttp.ClientSession]]:
    async with (
        SimCluster(1, base=FAST_SIM, overrides=[{"host": "127.0.0.2", "port": port}]),
        GatewayRunner(config, source=source) as gw,
        aiohttp.ClientSession() as session,
    ):
        api.add_pod("sim-a", "127.0.0.2", APP, ready=True)
        await wait_for(lambda: gw.gateway.pool.ready_count() == 1, 3.0, "the pod is ready")
        yield gw, session


async def ask(session: aiohttp.ClientSession, url: str, model: str) -> tuple[int, str]:
    async with session.post(f"{url}/v1/chat/completions", json=chat(model=model)) as resp:
        body = await resp.json()
        served = resp.headers.get("x-servegate-served-model", "")
        return resp.status, served if resp.status == 200 else body["error"]["message"]


async def test_rewrites_route_and_follow_the_cluster(api: FakeKubeApi, tmp_path: Path) -> None:
    port = common_free_port(["127.0.0.2"])
    api.set_model_rewrite("alias", POOL, "public-name", {MODEL: None})
    config = gateway_config(api.write_kubeconfig(tmp_path / "kc"), port)
    async with serving(api, config, port) as (gw, session):
        await wait_for(lambda: "public-name" in gw.gateway.routing.splits, 1.0, "rewrite read")
        assert await ask(session, gw.url, "public-name") == (200, MODEL)

        api.set_model_rewrite("alias", POOL, "public-name", {"retired-model": None})
        await wait_for(
            lambda: gw.gateway.routing.splits["public-name"].targets[0].model == "retired-model",
            1.0,
            "rewrite changed",
        )
        status, message = await ask(session, gw.url, "public-name")
        assert status == 404 and "routed to `retired-model`" in message

        api.delete_model_rewrite("alias")
        await wait_for(lambda: not gw.gateway.routing.splits, 1.0, "rewrite deleted")
        status, message = await ask(session, gw.url, "public-name")
        assert status == 404 and "does not exist" in message
        assert (await ask(session, gw.url, MODEL))[0] == 200


async def test_objectives_set_priorities_over_the_configs(api: FakeKubeApi, tmp_path: Path) -> None:
    port = common_free_port(["127.0.0.2"])
    api.set_objective("batch", -1, POOL)
    flow = {"objectives": [{"name": "batch", "priority": 3}, {"name": "gold", "priority": 9}]}
    config = gateway_config(api.write_kubeconfig(tmp_path / "kc"), port, flow_control=flow)
    async with serving(api, config, port) as (gw, _):
        admission = gw.gateway.admission
        await wait_for(lambda: admission.priority_of({OBJECTIVE: "batch"}) == -1, 1.0, "read")
        assert admission.priority_of({OBJECTIVE: "gold"}) == 9  # the config's stays
        api.set_objective("interactive", 10, POOL)
        await wait_for(
            lambda: gw.gateway.admission.priority_of({OBJECTIVE: "interactive"}) == 10,
            1.0,
            "objective added",
        )
        api.delete_objective("batch")
        await wait_for(
            lambda: gw.gateway.admission.priority_of({OBJECTIVE: "batch"}) == 3,
            1.0,
            "deleted: the config's priority is back",
        )


async def test_a_config_reload_keeps_the_clusters_objects(api: FakeKubeApi, tmp_path: Path) -> None:
    port = common_free_port(["127.0.0.2"])
    api.set_model_rewrite("alias", POOL, "public-name", {MODEL: None})
    api.set_objective("batch", -1, POOL)
    config = gateway_config(api.write_kubeconfig(tmp_path / "kc"), port)
    path = tmp_path / "servegate.yaml"
    path.write_text(yaml.safe_dump(config))
    async with serving(api, config, port, ConfigSource(path)) as (gw, session):
        reloader = gw.reloader
        await wait_for(lambda: "public-name" in gw.gateway.routing.splits, 1.0, "rewrite read")
        config["flow_control"] = {"enabled": True}  # rebuilds admission and routing
        path.write_text(yaml.safe_dump(config))
        result = await reloader.reload()
        assert result.ok, result.error
        assert "public-name" in gw.gateway.routing.splits
        assert gw.gateway.admission.priority_of({OBJECTIVE: "batch"}) == -1
        assert await ask(session, gw.url, "public-name") == (200, MODEL)


async def test_the_envoy_mode_picker_applies_objectives_too(
    api: FakeKubeApi, tmp_path: Path
) -> None:
    api.set_objective("batch", -1, POOL)
    config = gateway_config(api.write_kubeconfig(tmp_path / "kc"), 8000)
    config["extproc"] = {"host": "127.0.0.1", "port": 0, "health_port": 0, "metrics_port": 0}
    parsed = parse_config("", "<test>", environ={}, overrides=config)
    async with ExtProcServer(build_gateway(parsed, None, io.BytesIO())) as server:
        await wait_for(
            lambda: server.gw.admission.priority_of({OBJECTIVE: "batch"}) == -1, 1.0, "read"
        )
        api.set_objective("batch", 4, POOL)
        await wait_for(
            lambda: server.gw.admission.priority_of({OBJECTIVE: "batch"}) == 4, 1.0, "followed"
        )
