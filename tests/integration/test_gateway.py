"""The gateway end to end: real HTTP to simulated vLLM replicas on loopback."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import orjson
import pytest

from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import (
    FAST_SIM,
    MODEL,
    chat,
    gateway_config,
    single_scorer_picker,
    wait_for,
    wait_ready,
)


async def test_non_streaming_chat_and_completion(
    gateway: GatewayRunner, cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    async with session.post(
        gateway.url + "/v1/chat/completions", json=chat(), headers={"X-Request-ID": "req-1"}
    ) as resp:
        assert resp.status == 200
        body = await resp.json()
        assert resp.headers["X-Request-ID"] == "req-1"
        assert resp.headers["x-gateway-destination-endpoint"] in cluster.addresses
        scores = orjson.loads(resp.headers["x-servegate-scores"])
        assert set(scores["totals"]) == set(cluster.addresses)
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 8
    async with session.post(
        gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3}
    ) as resp:
        assert resp.status == 200
        assert (await resp.json())["object"] == "text_completion"
    line = gateway.access_lines()[0]
    assert line["request_id"] == "req-1"
    assert line["status"] == 200
    assert line["completion_tokens"] == 8
    assert line["endpoint"] in cluster.addresses


async def test_streaming_is_relayed_chunk_by_chunk(
    gateway: GatewayRunner, session: aiohttp.ClientSession
) -> None:
    body = chat(stream=True, stream_options={"include_usage": True}, max_tokens=5)
    async with session.post(gateway.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        raw = await resp.read()
    events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) >= 1
    line = gateway.access_lines()[-1]
    assert (line["stream"], line["completion_tokens"]) == (True, 5)
    assert line["ttft_ms"] is not None


async def test_models_health_ready(gateway: GatewayRunner, session: aiohttp.ClientSession) -> None:
    async with session.get(gateway.url + "/v1/models") as resp:
        ids = {m["id"] for m in (await resp.json())["data"]}
    assert ids == {MODEL}
    async with session.get(gateway.url + "/health") as resp:
        assert resp.status == 200
    async with session.get(gateway.url + "/ready") as resp:
        assert resp.status == 200
        assert (await resp.json())["ready_endpoints"] == 3


async def test_load_follows_queue_depth(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    busy = cluster[0]
    busy.engine.pause()
    direct = [
        asyncio.create_task(session.post(busy.url + "/v1/chat/completions", json=chat()))
        for _ in range(6)
    ]
    async with GatewayRunner(
        gateway_config(cluster.urls, single_scorer_picker("queue-scorer"))
    ) as gw:
        await wait_ready(gw, 3)
        await wait_for(lambda: gw.gateway.pool.get(busy.address).metrics.waiting >= 6, what="queue")  # type: ignore[union-attr]
        served = Counter()
        for _ in range(10):
            async with session.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 200
                served[resp.headers["x-gateway-destination-endpoint"]] += 1
        assert served[busy.address] == 0
        assert sum(served.values()) == 10
    busy.engine.resume()
    for task in direct:
        (await task).close()


async def test_load_follows_kv_utilisation(session: aiohttp.ClientSession) -> None:
    base = {"model": MODEL, "speed": 0.1, "num_blocks": 64, "block_size": 16, "max_model_len": 1000}
    async with SimCluster(2, base=base) as cluster:
        full = cluster[0]
        long_prompt = "word " * 600  # ~600 tokens of a 63 x 16 = 1008-token cache
        holder = asyncio.create_task(
            session.post(
                full.url + "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": long_prompt,
                    "max_tokens": 390,
                    "ignore_eos": True,
                },
            )
        )
        picker = single_scorer_picker("kv-cache-utilization-scorer")
        async with GatewayRunner(gateway_config(cluster.urls, picker)) as gw:
            await wait_ready(gw, 2)
            state = gw.gateway.pool.get(full.address)
            assert state is not None
            await wait_for(
                lambda: state.metrics.kv_usage > 0.3, what="KV usage on the busy replica"
            )
            for _ in range(6):
                async with session.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                    assert resp.status == 200
                    assert resp.headers["x-gateway-destination-endpoint"] == cluster[1].address
        holder.cancel()
        with pytest.raises(asyncio.CancelledError):
            await holder


async def test_dead_endpoint_is_routed_around(
    gateway: GatewayRunner, cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    dead = cluster[1]
    dead.fault("crash")
    statuses = []
    for _ in range(12):
        async with session.post(gateway.url + "/v1/chat/completions", json=chat()) as resp:
            statuses.append(resp.status)
            assert resp.headers["x-gateway-destination-endpoint"] != dead.address
    assert statuses == [200] * 12
    pool = gateway.gateway.pool
    await wait_for(lambda: not pool.get(dead.address).healthy, what="dead endpoint to leave")  # type: ignore[union-attr]
    assert pool.ready_count() == 2
    metrics = await (await session.get(gateway.url + "/metrics")).text()
    assert 'inference_pool_ready_pods{name="default"} 2.0' in metrics


async def test_503_from_an_endpoint_is_retried_on_another(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    cfg = gateway_config(cluster.urls)
    cfg["pool"]["health"]["failure_threshold"] = 1000  # keep the failing endpoint in the pool
    async with GatewayRunner(cfg) as gw:
        await wait_ready(gw, 3)
        cluster[0].fault("unavailable")
        for _ in range(10):
            async with session.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
                assert resp.status == 200
                assert resp.headers["x-gateway-destination-endpoint"] != cluster[0].address
        text = await (await session.get(gw.url + "/metrics")).text()
        assert 'servegate_upstream_retries_total{reason="503"}' in text
        assert any(line["retries"] >= 1 for line in gw.access_lines())


async def test_unknown_model_is_404(gateway: GatewayRunner, session: aiohttp.ClientSession) -> None:
    async with session.post(gateway.url + "/v1/chat/completions", json=chat(model="nope")) as resp:
        assert resp.status == 404
        err = (await resp.json())["error"]
    assert err["code"] == "model_not_found"
    assert err["param"] == "model"
    assert "nope" in err["message"]


async def test_empty_or_unhealthy_pool_is_503(
    cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    cfg = gateway_config(cluster.urls)
    cfg["pool"]["models"] = [{"id": MODEL}]
    async with GatewayRunner(cfg) as gw:
        await wait_ready(gw, 3)
        for sim in cluster:
            sim.fault("unavailable")
        await wait_for(lambda: gw.gateway.pool.ready_count() == 0, what="all endpoints to leave")
        async with session.post(gw.url + "/v1/chat/completions", json=chat()) as resp:
            assert resp.status == 503
            assert resp.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
            assert (await resp.json())["error"]["code"] == "rejected-no-endpoints"
        async with session.get(gw.url + "/ready") as resp:
            assert resp.status == 503
    async with (
        GatewayRunner({"gateway": {"port": 0}, "pool": {"models": [{"id": MODEL}]}}) as empty,
        session.post(empty.url + "/v1/chat/completions", json=chat()) as resp,
    ):
        assert resp.status == 503


async def test_bad_input_errors(cluster: SimCluster, session: aiohttp.ClientSession) -> None:
    cfg = gateway_config(cluster.urls, api_keys=["secret"], max_body_bytes=2000)
    async with GatewayRunner(cfg) as gw:
        await wait_ready(gw, 3)
        url = gw.url + "/v1/chat/completions"
        auth = {"Authorization": "Bearer secret"}
        async with session.post(url, json=chat()) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["type"] == "authentication_error"
        async with session.post(
            url, json=chat(), headers={"Authorization": "Bearer wrong"}
        ) as resp:
            assert resp.status == 401
        async with session.post(url, data=b"{nope", headers=auth) as resp:
            assert resp.status == 400
        async with session.post(url, json=chat("x" * 5000), headers=auth) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["code"] == "request_too_large"
        async with session.post(url, json=chat(), headers=auth) as resp:
            assert resp.status == 200
        async with session.get(gw.url + "/v1/nothing") as resp:
            assert resp.status == 404
            assert "error" in await resp.json()


async def test_upstream_error_body_passes_through(
    gateway: GatewayRunner, session: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": "word " * 3000, "max_tokens": 5}  # > max_model_len
    async with session.post(gateway.url + "/v1/completions", json=body) as resp:
        assert resp.status == 400
        assert "maximum context length" in (await resp.text()) or "max_model_len" in (
            await resp.text()
        )


async def test_client_disconnect_cancels_upstream(
    gateway: GatewayRunner, cluster: SimCluster, session: aiohttp.ClientSession
) -> None:
    for sim in cluster:
        sim.fault("slow", factor=50.0)  # ~10 ms a token: 2000 tokens take ~20 s
    body = chat(stream=True, max_tokens=2000, ignore_eos=True)
    resp = await session.post(gateway.url + "/v1/chat/completions", json=body)
    assert resp.status == 200
    await resp.content.readline()
    served = next(s for s in cluster if s.address == resp.headers["x-gateway-destination-endpoint"])
    assert served.engine.num_running == 1
    resp.close()
    await wait_for(lambda: served.engine.num_running == 0, what="upstream request to be aborted")
    pool = gateway.gateway.pool
    await wait_for(lambda: all(s.in_flight_requests == 0 for s in pool), what="in-flight release")
    await wait_for(lambda: bool(gateway.access_lines()), what="the access-log line")
    line = gateway.access_lines()[-1]
    assert (line["status"], line["error"]) == (499, "client disconnected")


async def test_metrics_show_requests(
    gateway: GatewayRunner, session: aiohttp.ClientSession
) -> None:
    for _ in range(3):
        async with session.post(gateway.url + "/v1/chat/completions", json=chat()) as resp:
            await resp.read()
    async with session.post(gateway.url + "/v1/chat/completions", json=chat(model="nope")) as resp:
        await resp.read()
    text = await (await session.get(gateway.url + "/metrics")).text()
    objective = f'model_name="{MODEL}",priority="0",target_model_name="{MODEL}"'
    assert f"inference_objective_request_total{{{objective}}} 3.0" in text
    assert f'llm_d_epp_request_total{{fairness_id="default-flow",{objective}}} 3.0' in text
    # the unknown model is counted by llm-d's code, its target unresolved
    assert (
        'inference_objective_request_error_total{error_code="NotFound",model_name="nope",'
        'target_model_name=""} 1.0'
    ) in text
    assert 'servegate_http_responses_total{code="404"} 1.0' in text
    assert "inference_extension_scheduler_e2e_duration_seconds_count 3.0" in text
    assert "inference_pool_per_pod_queue_size" in text
    picks = [
        line for line in text.splitlines() if line.startswith("servegate_endpoint_picks_total")
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in picks) == 3.0
    assert len(gateway.access_lines()) == 4  # /metrics itself is not logged


async def test_lora_adapter_goes_to_the_replica_that_has_it(session: aiohttp.ClientSession) -> None:
    overrides = [{"lora": {"max_loras": 2, "adapters": ["sql-lora"]}}, {}, {}]
    async with SimCluster(3, base=FAST_SIM, overrides=overrides) as cluster:  # noqa: SIM117
        async with GatewayRunner(gateway_config(cluster.urls)) as gw:
            await wait_ready(gw, 3)
            await wait_for(
                lambda: gw.gateway.pool.resolve_model("sql-lora") is not None, what="adapter"
            )
            for _ in range(6):
                async with session.post(
                    gw.url + "/v1/chat/completions", json=chat(model="sql-lora")
                ) as resp:
                    assert resp.status == 200
                    assert resp.headers["x-gateway-destination-endpoint"] == cluster[0].address
            models = {
                m["id"]: m["parent"]
                for m in (await (await session.get(gw.url + "/v1/models")).json())["data"]
            }
            assert models == {MODEL: None, "sql-lora": MODEL}
