"""Starting and stopping the gateway: the running pieces are built complete, owned once."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from servegate.config import ConfigError, PoolSettings, parse_config
from servegate.datalayer.outlier import OutlierDetectionSettings
from servegate.gateway.app import build_gateway
from servegate.gateway.feeds import PoolFeeds
from servegate.gateway.lifecycle import start_gateway
from servegate.gateway.metrics import GatewayMetrics
from servegate.gateway.pools import PoolState, build_pool_state
from servegate.gateway.probes import NoProbes
from servegate.gateway.reload import FixedConfig
from servegate.pool.discovery import FixedMembership
from servegate.testing.gateway import GatewayRunner

ADMIN = "admin-key"
UNREACHABLE = "http://127.0.0.1:9"
"""The discard port: nothing answers, so scrapes and probes fail quietly."""


def pool_state(**settings: Any) -> PoolState:
    doc = {"endpoints": [{"url": UNREACHABLE}], **settings}
    return build_pool_state(
        PoolSettings.model_validate(doc), OutlierDetectionSettings(), GatewayMetrics()
    )


def data_layer_tasks() -> list[str]:
    return sorted(
        t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith(("scrape ", "health "))
    )


async def test_a_gateway_started_without_a_file_answers_a_reload_with_409() -> None:
    async with (
        GatewayRunner({"gateway": {"port": 0, "admin_keys": [ADMIN]}}) as gw,
        aiohttp.ClientSession() as session,
    ):
        assert isinstance(gw.reloader, FixedConfig)
        resp = await session.post(
            f"{gw.url}/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"}
        )
        body = await resp.json()
    assert (resp.status, body["ok"]) == (409, False)
    assert "not started from a file" in body["error"]


async def test_the_running_gateway_holds_what_it_opened_and_stop_closes_it() -> None:
    config = parse_config("", environ={}, overrides={"pool": {"endpoints": [{"url": UNREACHABLE}]}})
    gw = build_gateway(config, None, io.BytesIO())
    running = await start_gateway(gw)
    state = gw.default.state
    try:
        assert isinstance(running.probes, NoProbes)  # no probe port configured
        assert running.scaleout is None  # no supervisor, no scaleout.bind
        assert isinstance(running.feeds[state].discovery, FixedMembership)
        assert running.feeds[state].datalayer.watched() == ["127.0.0.1:9"]
        assert gw.default.started
    finally:
        await running.stop()
    assert running.control.closed
    assert state not in running.feeds
    assert not gw.default.started
    assert data_layer_tasks() == []


async def test_a_follower_pools_data_layer_idles_until_scraping_is_turned_on() -> None:
    async with aiohttp.ClientSession() as control:
        feeds = PoolFeeds(control)
        await feeds.set_scraping(False)  # a scale-out follower, before any pool starts
        state = pool_state()
        feed = await feeds.start(state)
        assert feed.datalayer.watched() == [] and data_layer_tasks() == []
        assert await feeds.start(state) is feed  # a second runtime over the pool shares it
        await feeds.set_scraping(True)  # the leader fell silent
        assert feed.datalayer.watched() == ["127.0.0.1:9"]
        assert data_layer_tasks() == ["health 127.0.0.1:9", "scrape 127.0.0.1:9"]
        await feeds.stop(state)
        assert state not in feeds and feed.datalayer.watched() == []
    assert data_layer_tasks() == []


async def test_a_pool_whose_discovery_cannot_start_leaves_nothing_running(
    tmp_path: Path,
) -> None:
    kubeconfig = str(tmp_path / "none")
    state = pool_state(
        discovery={"kind": "kubernetes", "kubeconfig": kubeconfig, "inference_pool": "p"}
    )
    async with aiohttp.ClientSession() as control:
        feeds = PoolFeeds(control)
        with pytest.raises(ConfigError, match="cannot load Kubernetes credentials"):
            await feeds.start(state)
        assert state not in feeds
        assert data_layer_tasks() == []
