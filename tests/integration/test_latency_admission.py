"""latency-slo-admitter end to end: sheddable requests that would miss their SLO are shed
(or held), everything else is served; the predictor learns from completed streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
import pytest

from servegate.gateway.latency import DEBUG_HEADER
from servegate.scheduling.latency.predictor import MIN_LEARNED_MS
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import (
    FAST_SIM,
    PICKER_HEAD,
    chat,
    gateway_config,
    wait_for,
    wait_ready,
)


def slo_picker(queue_timeout_ms: float = 0.0) -> dict[str, Any]:
    return {
        **PICKER_HEAD,
        "plugins": [
            {"type": "prefix-cache-scorer"},
            {"type": "predicted-latency-producer", "parameters": {"streamingMode": True}},
            {"type": "slo-headroom-tier-filter"},
            {"type": "latency-scorer", "parameters": {"headroomSelectionStrategy": "most"}},
            {"type": "latency-slo-admitter", "parameters": {"queueTimeoutMs": queue_timeout_ms}},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "predicted-latency-producer"},
                    {"pluginRef": "slo-headroom-tier-filter"},
                    {"pluginRef": "latency-scorer", "weight": 1},
                ],
            }
        ],
    }


def config(urls: list[str], queue_timeout_ms: float = 0.0) -> dict[str, Any]:
    cfg = gateway_config(urls, slo_picker(queue_timeout_ms), debug_headers=True)
    cfg["flow_control"] = {"objectives": [{"name": "batch", "priority": -1}]}
    return cfg


@pytest.fixture
async def cluster() -> AsyncIterator[SimCluster]:
    async with SimCluster(2, base=FAST_SIM) as c:
        yield c


async def post(
    session: aiohttp.ClientSession,
    gw: GatewayRunner,
    ttft_ms: float | None,
    sheddable: bool,
    stream: bool = False,
) -> tuple[int, dict[str, str], bytes]:
    headers = {}
    if sheddable:
        headers["x-llm-d-inference-objective"] = "batch"
    if ttft_ms is not None:
        headers["x-llm-d-slo-ttft-ms"] = str(ttft_ms)
    body = chat(max_tokens=6)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    async with session.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


async def freeze_busy(gw: GatewayRunner, learned: int = 20) -> None:
    """Stop the data layer and make every endpoint look busy and warm (not idle, not cold),
    its latency model having measured `learned` streams, each as predicted."""
    runtime = gw.gateway.default
    await gw.running.feeds[runtime.state].datalayer.stop()
    for state in runtime.pool:
        runtime.pool.set_metrics(state.address, replace(state.metrics, kv_usage=0.5))
        runtime.pool.acquire(state, 0)
        model = runtime.state.latency.model(state.address)
        for _ in range(learned):
            model.ttft_error.add(100.0, 100.0)


def release_all(gw: GatewayRunner) -> None:
    pool = gw.gateway.default.pool
    for state in pool:
        pool.release(state, 0)


async def test_sheddable_request_that_would_miss_its_slo_is_shed(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    async with GatewayRunner(config(cluster.urls)) as gw:
        await wait_ready(gw, len(cluster))
        await freeze_busy(gw)
        status, headers, body = await post(session, gw, ttft_ms=0.001, sheddable=True)
        assert status == 429
        error = orjson.loads(body)["error"]
        assert error["code"] == "rejected-slo"
        assert "latency SLO" in error["message"]
        assert headers["x-llm-d-request-dropped-reason"] == "rejected-slo"
        # not sheddable, or an SLO the predictor expects to meet, or no SLO: served
        assert (await post(session, gw, ttft_ms=0.001, sheddable=False))[0] == 200
        assert (await post(session, gw, ttft_ms=600_000, sheddable=True))[0] == 200
        assert (await post(session, gw, ttft_ms=None, sheddable=True))[0] == 200
        # an idle endpoint lets a sheddable request try
        release_all(gw)
        assert (await post(session, gw, ttft_ms=0.001, sheddable=True))[0] == 200
        page = (await (await session.get(gw.url + "/metrics")).read()).decode()
        assert 'servegate_latency_slo_shed_total{inference_pool="default"} 1.0' in page


async def test_sheddable_request_is_served_while_the_latency_model_is_still_learning(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    async with GatewayRunner(config(cluster.urls)) as gw:
        await wait_ready(gw, len(cluster))
        await freeze_busy(gw, learned=19)
        assert (await post(session, gw, ttft_ms=0.001, sheddable=True))[0] == 200
        page = (await (await session.get(gw.url + "/metrics")).read()).decode()
        assert 'servegate_latency_slo_shed_total{inference_pool="default"} 0.0' in page


async def test_held_request_is_admitted_when_an_endpoint_frees_up(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    async with GatewayRunner(config(cluster.urls, queue_timeout_ms=5000)) as gw:
        await wait_ready(gw, len(cluster))
        await freeze_busy(gw)
        waiting = asyncio.create_task(post(session, gw, ttft_ms=0.001, sheddable=True))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        release_all(gw)
        status, _, _ = await asyncio.wait_for(waiting, 5.0)
        assert status == 200
        assert gw.gateway.default.latency is not None
        assert gw.gateway.default.latency.admitted_after_wait == 1


async def test_held_request_is_shed_when_the_wait_ends(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    async with GatewayRunner(config(cluster.urls, queue_timeout_ms=150)) as gw:
        await wait_ready(gw, len(cluster))
        await freeze_busy(gw)
        status, headers, _ = await post(session, gw, ttft_ms=0.001, sheddable=True)
        assert status == 429
        assert headers["x-llm-d-request-dropped-reason"] == "rejected-slo"


async def test_streams_teach_the_predictor_and_show_in_the_log_and_debug_header(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    async with GatewayRunner(config(cluster.urls)) as gw:
        await wait_ready(gw, len(cluster))
        for _ in range(6):
            status, headers, _ = await post(session, gw, ttft_ms=5000, sheddable=False, stream=True)
            assert status == 200
        debug = orjson.loads(headers[DEBUG_HEADER])
        assert debug["endpoint"] == headers["x-gateway-destination-endpoint"]
        assert debug["slo_ttft_ms"] == 5000
        assert set(debug["candidates"]) == set(cluster.addresses)
        await wait_for(lambda: len(gw.access_lines()) >= 6, what="access lines")
        lines = gw.access_lines()
        for line in lines:
            assert line["predicted_ttft_ms"] > 0
            assert line["slo_ttft_ms"] == 5000
            assert line["tpot_ms"] is not None and line["tpot_ms"] > 0
        predictor = gw.gateway.default.state.latency
        learned = sum(m.ttft_error.observations for m in predictor.endpoints.values())
        # Every stream teaches its TTFT, except one whose first byte came within
        # MIN_LEARNED_MS of dispatch (the fast simulator's first chunk can): read from the
        # log, with the log's 3-decimal rounding either way.
        shown = [line["ttft_ms"] - line["dispatched_ms"] for line in lines]
        surely = sum(ttft >= MIN_LEARNED_MS + 0.001 for ttft in shown)
        maybe = sum(ttft >= MIN_LEARNED_MS - 0.001 for ttft in shown)
        assert surely <= learned <= maybe
        assert learned >= 1
        assert predictor.pool_ttft.effective_n > 0
        assert all(not m.pending for m in predictor.endpoints.values())
        page = (await (await session.get(gw.url + "/metrics")).read()).decode()
        assert "servegate_latency_prediction_error_ratio{" in page
        assert 'servegate_latency_slo_requests_total{inference_pool="default",outcome=' in page


async def test_over_the_learning_cap_streams_are_served_but_not_learned(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    cfg = config(cluster.urls)
    cfg["pool"]["latency"] = {"learn_per_s": 0.001}  # one stream per endpoint, then none
    async with GatewayRunner(cfg) as gw:
        await wait_ready(gw, len(cluster))
        for _ in range(8):
            status, _, _ = await post(session, gw, ttft_ms=5000, sheddable=False, stream=True)
            assert status == 200
        await wait_for(lambda: len(gw.access_lines()) >= 8, what="access lines")
        lines = gw.access_lines()
        predictor = gw.gateway.default.state.latency
        assert predictor.learn_per_s == 0.001
        models = predictor.endpoints.values()
        learned = [max(m.ttft_error.observations, m.tpot_error.observations) for m in models]
        assert all(n <= 1 for n in learned)  # the one stream the bucket holds
        # every stream with a TTFT or TPOT to teach (read from the log, with its 3-decimal
        # rounding either way) was either learned or counted as sampled out
        decided = sum(learned) + sum(m.sampled_out for m in models)
        shown = [
            max(line["ttft_ms"] - line["dispatched_ms"], line["tpot_ms"] or 0.0) for line in lines
        ]
        assert sum(t >= MIN_LEARNED_MS + 0.001 for t in shown) <= decided
        assert decided <= sum(t >= MIN_LEARNED_MS - 0.001 for t in shown)
        assert sum(m.sampled_out for m in models) >= decided - len(cluster) > 0
        assert all(not m.pending for m in models)  # backlog released all the same
        page = (await (await session.get(gw.url + "/metrics")).read()).decode()
        for address, m in predictor.endpoints.items():
            series = (
                f'servegate_latency_prediction_sampled_out_total{{endpoint="{address}",'
                f'inference_pool="default"}} {float(m.sampled_out)}'
            )
            assert series in page
