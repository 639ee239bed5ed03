"""The status page's JSON and its key: `/ui/state.json` reads what the gateway knows."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import aiohttp
import pytest

from servegate.gateway.errors import Unauthorized
from servegate.gateway.ui import DecisionLog, check_ui_key
from servegate.pool.endpoint import Endpoint, EndpointState
from servegate.scheduling.framework import Decision
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import FAST_SIM, MODEL, gateway_config, wait_for, wait_ready

PICKER = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"type": "prefix-cache-scorer"},
        {"type": "queue-scorer"},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
                {"pluginRef": "queue-scorer", "weight": 1},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}
ADMIN_KEY = "ui-admin-key"


@pytest.fixture
async def cluster() -> AsyncIterator[SimCluster]:
    lora = {"lora": {"max_loras": 2, "adapters": ["sql-lora"]}}
    async with SimCluster(3, base=FAST_SIM, overrides=[lora, {}, {}]) as c:
        yield c


async def _complete(
    session: aiohttp.ClientSession, url: str, prompt: str, model: str = MODEL
) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def test_state_lists_endpoints_share_hit_rate_and_scored_decisions(
    cluster: SimCluster,
) -> None:
    async with (
        GatewayRunner(gateway_config(cluster.urls, PICKER)) as gw,
        aiohttp.ClientSession() as session,
    ):
        await wait_ready(gw, 3)
        prefix = "The shared system prompt of the status page test. " * 20
        for i in range(6):
            await _complete(session, gw.url, prefix + f"question {i}")
        await _complete(session, gw.url, "a LoRA request", model="sql-lora")
        # the engines' counters reach the gateway with the next scrape
        await wait_for(
            lambda: sum(s.metrics.prefix_cache_hits or 0 for s in gw.gateway.pool) > 0,
            what="a scrape with prefix-cache hits",
        )
        async with session.get(gw.url + "/ui/state.json") as resp:
            assert resp.status == 200
            assert resp.headers["Cache-Control"] == "no-store"
            state = await resp.json()
        async with session.get(gw.url + "/ui") as resp:
            assert resp.status == 200
            assert resp.content_type == "text/html"
            page = await resp.text()
    assert "state.json" in page
    assert "http://" not in page.replace("http://www.w3.org", "")  # no external assets
    (pool,) = state["pools"]
    assert sorted(e["address"] for e in pool["endpoints"]) == sorted(cluster.addresses)
    assert pool["picks"] == 7
    assert sum(e["picks"] for e in pool["endpoints"]) == 7
    assert sum(e["share"] for e in pool["endpoints"]) == pytest.approx(1.0)
    lora = next(e["lora"] for e in pool["endpoints"] if e["address"] == cluster.addresses[0])
    assert lora is not None and lora["max"] == 2
    hits = sum(e["prefix_cache"]["hits"] for e in pool["endpoints"])
    queries = sum(e["prefix_cache"]["queries"] for e in pool["endpoints"])
    assert state["cluster"]["hit_rate"] == pytest.approx(hits / queries)
    assert 0 < state["cluster"]["hit_rate"] < 1
    assert "flow_control" in pool
    assert state["decisions_recorded"] == 7
    newest = state["decisions"][0]
    assert newest["model"] == "sql-lora"
    assert newest["endpoint"] == newest["ranked"][0]
    assert set(newest["scores"][newest["endpoint"]]) == {"prefix-cache-scorer", "queue-scorer"}
    assert newest["totals"][newest["endpoint"]] == pytest.approx(
        sum(newest["scores"][newest["endpoint"]].values())
    )
    # the shared-prefix requests after the first went where the prefix was
    shared = state["decisions"][1:6]
    assert all(d["scores"][d["endpoint"]]["prefix-cache-scorer"] > 0 for d in shared)


async def test_with_admin_keys_the_page_wants_one(cluster: SimCluster) -> None:
    config = gateway_config(cluster.urls, admin_keys=[ADMIN_KEY])
    basic = base64.b64encode(f"anyone:{ADMIN_KEY}".encode()).decode()
    async with GatewayRunner(config) as gw, aiohttp.ClientSession() as session:
        for path in ("/ui", "/ui/state.json"):
            async with session.get(gw.url + path) as resp:
                assert resp.status == 401
                assert resp.headers["WWW-Authenticate"].startswith("Basic")
                assert (await resp.json())["error"]["type"] == "authentication_error"
            for header in (f"Bearer {ADMIN_KEY}", f"Basic {basic}"):
                async with session.get(gw.url + path, headers={"Authorization": header}) as resp:
                    assert resp.status == 200
            async with session.get(gw.url + path, headers={"Authorization": "Bearer no"}) as resp:
                assert resp.status == 401


def test_key_check() -> None:
    check_ui_key((), "")
    check_ui_key(("k",), "Bearer k")
    check_ui_key(("k",), "Basic " + base64.b64encode(b"u:k").decode())
    for header in ("", "Bearer x", "Basic !!!", "Basic " + base64.b64encode(b"k").decode()):
        with pytest.raises(Unauthorized):
            check_ui_key(("k",), header)


def test_decision_log_is_bounded() -> None:
    log = DecisionLog(size=4)
    assert log.latest(10, 0.0) == []
    for i in range(10):
        log.record("default", _request(f"m{i}"), _decision(), float(i))
    assert len(log) == 4 and log.recorded == 10
    latest = log.latest(3, 10.0)
    assert [d["model"] for d in latest] == ["m9", "m8", "m7"]
    assert [d["seq"] for d in latest] == [10, 9, 8]
    assert latest[0]["age_s"] == 1.0


def _request(model: str) -> LLMRequest:
    return LLMRequest(
        request_id="r",
        kind=RequestKind.CHAT,
        model=model,
        target_model=model,
        base_model=model,
        prompt_tokens=5,
    )


def _decision() -> Decision:
    return Decision(
        endpoint=EndpointState(Endpoint("10.0.0.1:8000", "http://10.0.0.1:8000")), fallbacks=[]
    )
