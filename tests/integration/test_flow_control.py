"""Flow control end to end: a saturated pool holds requests in the gateway, in priority order."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from servegate.scheduling.flowcontrol import Outcome
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import FAST_SIM, MODEL, chat, gateway_config, wait_for, wait_ready

SLOW_SIM = {**FAST_SIM, "speed": 1.0}
OBJECTIVES = [{"name": "critical", "priority": 10}, {"name": "batch", "priority": -1}]


def flow_config(urls: list[str], max_concurrency: int = 2, **flow: Any) -> dict[str, Any]:
    cfg = gateway_config(urls)
    cfg["flow_control"] = {
        "enabled": True,
        "saturation_detector": {
            "type": "concurrency-detector",
            "parameters": {"maxConcurrency": max_concurrency},
        },
        "objectives": OBJECTIVES,
        **flow,
    }
    return cfg


async def post(
    session: aiohttp.ClientSession, url: str, objective: str | None = None, tokens: int = 40
) -> tuple[int, dict[str, str], str]:
    headers = {"x-llm-d-inference-objective": objective} if objective else {}
    async with session.post(
        url + "/v1/chat/completions", json=chat(max_tokens=tokens), headers=headers
    ) as resp:
        body = await resp.text()
        return resp.status, dict(resp.headers), body


async def send_and_leave_open(port: int) -> asyncio.StreamWriter:
    """A raw HTTP request whose client will hang up before any answer."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    body = orjson.dumps(chat(max_tokens=5))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )
    await writer.drain()
    return writer


async def test_saturated_pool_queues_then_serves_everyone(session: aiohttp.ClientSession) -> None:
    async with (
        SimCluster(1, base=SLOW_SIM) as cluster,
        GatewayRunner(flow_config(cluster.urls)) as gw,
    ):
        await wait_ready(gw, 1)
        results = await asyncio.gather(*(post(session, gw.url) for _ in range(6)))
        assert [status for status, _, _ in results] == [200] * 6
        waits = sorted(int(h["x-llm-d-flow-queue-duration-ms"]) for _, h, _ in results)
        # capacity 2 of 6: at least 4 waited for an earlier pair to finish
        assert waits[:2] == [0, 0] and waits[-1] > 0
        stats = gw.gateway.admission.controller.stats  # type: ignore[union-attr]
        assert stats.outcomes[(0, Outcome.DISPATCHED)] == 6
        assert gw.gateway.admission.controller.queues.requests == 0  # type: ignore[union-attr]
        assert all(s.in_flight_requests == 0 for s in gw.gateway.pool)


async def test_sheddable_is_dropped_and_ttl_expires(session: aiohttp.ClientSession) -> None:
    cfg = flow_config([], max_concurrency=1, default_request_ttl_s=0.15)
    async with SimCluster(1, base=SLOW_SIM) as cluster:
        cfg["pool"]["endpoints"] = [{"url": cluster.urls[0]}]
        async with GatewayRunner(cfg) as gw:
            await wait_ready(gw, 1)
            hold = asyncio.create_task(post(session, gw.url, "critical", tokens=200))
            await wait_for(lambda: any(s.in_flight_requests for s in gw.gateway.pool))
            shed = await post(session, gw.url, "batch")
            expired = await post(session, gw.url)
            assert (await hold)[0] == 200
    assert shed[0] == 429
    assert shed[1]["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    assert expired[0] == 429
    assert expired[1]["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
    assert int(expired[1]["x-llm-d-flow-queue-duration-ms"]) >= 150
    assert '"type":"rate_limit_error"' in expired[2].replace(" ", "")


async def test_priority_goes_first_and_disconnect_leaves_the_queue(
    session: aiohttp.ClientSession,
) -> None:
    async with (
        SimCluster(1, base=SLOW_SIM) as cluster,
        GatewayRunner(flow_config(cluster.urls, max_concurrency=1)) as gw,
    ):
        await wait_ready(gw, 1)
        controller = gw.gateway.admission.controller  # type: ignore[union-attr]
        finished: list[str] = []

        async def tagged(name: str, objective: str | None, tokens: int = 20) -> None:
            status, _, _ = await post(session, gw.url, objective, tokens=tokens)
            assert status == 200
            finished.append(name)

        hold = asyncio.create_task(tagged("hold", None, tokens=400))  # ~2 s at speed 1
        await wait_for(lambda: any(s.in_flight_requests for s in gw.gateway.pool))
        low = asyncio.create_task(tagged("low", None))
        await wait_for(lambda: controller.queues.requests == 1)
        high = asyncio.create_task(tagged("high", "critical"))
        await wait_for(lambda: controller.queues.requests == 2)
        writer = await send_and_leave_open(gw.port)
        await wait_for(lambda: controller.queues.requests == 3)
        writer.close()
        await writer.wait_closed()
        cancelled = (0, Outcome.EVICTED_CONTEXT_CANCELLED)
        await wait_for(lambda: controller.stats.outcomes.get(cancelled) == 1, what="removal")
        assert controller.queues.requests == 2 and not hold.done()
        await asyncio.gather(hold, low, high)
        assert finished == ["hold", "high", "low"]
        async with session.get(gw.url + "/metrics") as resp:
            text = await resp.text()
    assert 'outcome="EvictedContextCancelled",priority="0"' in text
    assert "inference_extension_flow_control_pool_saturation" in text
    queued = (
        'fairness_id="default-flow",inference_pool="default",'
        f'model_name="{MODEL}",priority="10",target_model_name="{MODEL}"'
    )
    assert f"inference_extension_flow_control_queue_size{{{queued}}} 0.0" in text
    assert f"llm_d_epp_flow_control_queue_size{{{queued}}} 0.0" in text


async def test_llm_d_picker_sections_enable_flow_control(session: aiohttp.ClientSession) -> None:
    picker = {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "featureGates": ["flowControl"],
        "plugins": [
            {"type": "concurrency-detector", "parameters": {"maxConcurrency": 1}},
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}],
            }
        ],
        "flowControl": {
            "defaultRequestTTL": "20s",
            "saturationDetector": {"pluginRef": "concurrency-detector"},
        },
    }
    async with (
        SimCluster(1, base=SLOW_SIM) as cluster,
        GatewayRunner(gateway_config(cluster.urls, picker=picker)) as gw,
    ):
        await wait_ready(gw, 1)
        controller = gw.gateway.admission.controller  # type: ignore[union-attr]
        assert controller.enabled and controller.ttl_s == 20.0
        results = await asyncio.gather(*(post(session, gw.url, tokens=10) for _ in range(3)))
    assert [r[0] for r in results] == [200, 200, 200]
    assert max(int(r[1]["x-llm-d-flow-queue-duration-ms"]) for r in results) > 0
