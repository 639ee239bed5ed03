"""SGLang, trtllm-serve and Triton personas: their paths, ports, metric names and errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servegate.testing.cluster import SimCluster

BASE: dict[str, Any] = {
    "model": "tiny",
    "num_blocks": 65,
    "block_size": 4,
    "max_model_len": 256,
    "speed": 50.0,
}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def families(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


async def test_sglang(http: aiohttp.ClientSession) -> None:
    async with SimCluster(1, base={**BASE, "persona": "sglang"}) as cluster:
        url = cluster.urls[0]
        async with http.post(
            url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}
        ) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 2
        async with http.get(url + "/metrics") as resp:
            names = families(await resp.text())
        assert {
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:token_usage",
            "sglang:cached_tokens",
        } <= names
        async with http.post(url + "/v1/completions", json={"model": "x", "prompt": "hi"}) as resp:
            body = await resp.json()
        # SGLang's flat error body
        assert body == {
            "object": "error",
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
        async with http.post(url + "/v1/load_lora_adapter", json={}) as resp:
            assert resp.status == 404


async def test_trtllm_serve(http: aiohttp.ClientSession) -> None:
    async with SimCluster(1, base={**BASE, "persona": "trtllm-serve"}) as cluster:
        handle = cluster[0]
        assert handle.metrics_url == handle.url + "/prometheus/metrics"
        async with http.get(handle.metrics_url) as resp:
            names = families(await resp.text())
        assert {
            "trtllm_num_requests_running",
            "trtllm_kv_cache_utilization",
            "trtllm_kv_cache_tokens_per_block",
        } <= names
        async with http.get(handle.url + "/metrics") as resp:
            stats = await resp.json()
        assert stats[0]["kvCacheStats"]["tokensPerBlock"] == 4
        async with http.get(handle.url + "/health") as resp:
            assert resp.status == 200


async def test_triton_generate_and_ports(http: aiohttp.ClientSession) -> None:
    async with SimCluster(1, base={**BASE, "persona": "triton-tensorrt-llm"}) as cluster:
        handle = cluster[0]
        url = handle.url
        assert handle.config.metrics_port not in (None, handle.config.port)
        async with http.get(url + "/v2/health/ready") as resp:
            assert (resp.status, await resp.read()) == (200, b"")
        async with http.post(url + "/v1/completions", json={"prompt": "hi"}) as resp:
            assert resp.status == 404
        body = {"text_input": "hello there", "max_tokens": 3, "exclude_input_in_output": True}
        async with http.post(url + "/v2/models/tiny/generate", json=body) as resp:
            data = await resp.json()
        assert (data["model_name"], data["model_version"]) == ("tiny", "1")
        assert len(data["text_output"].split()) == 3
        body = {"text_input": "hello there", "parameters": {"max_tokens": 2}}
        async with http.post(url + "/v2/models/tiny/generate", json=body) as resp:
            assert (await resp.json())["text_output"].startswith("hello there ")
        async with http.get(handle.metrics_url) as resp:
            names = families(await resp.text())
        assert {"nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics"} <= names
        async with http.get(url + "/metrics") as resp:
            assert resp.status == 404


async def test_triton_stream_has_no_done_and_errors_inline(http: aiohttp.ClientSession) -> None:
    async with SimCluster(1, base={**BASE, "persona": "triton-tensorrt-llm"}) as cluster:
        url = cluster.urls[0] + "/v2/models/tiny/generate_stream"
        async with http.post(url, json={"text_input": "hi", "max_tokens": 3}) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = (await resp.text()).split("\n\n")[:-1]
        assert all(e.startswith("data: ") for e in events)
        outputs = [orjson.loads(e.removeprefix("data: "))["text_output"] for e in events]
        assert len("".join(outputs).split()) == 3
        assert "[DONE]" not in "".join(events)
        headers = {"X-Return-Error": "stream_error"}
        async with http.post(
            url, json={"text_input": "hi", "max_tokens": 3}, headers=headers
        ) as resp:
            assert resp.status == 200
            events = (await resp.text()).split("\n\n")[:-1]
        assert orjson.loads(events[-1].removeprefix("data: ")) == {
            "error": "Simulated failure during generation"
        }


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        pytest.param(
            "/v2/models/other/generate",
            {"text_input": "x"},
            "Request for unknown model: 'other' is not found",
            id="unknown-model",
        ),
        pytest.param(
            "/v2/models/tiny/generate",
            {"max_tokens": 3},
            "'text_input' must be a string",
            id="no-text",
        ),
    ],
)
async def test_triton_errors(
    http: aiohttp.ClientSession, path: str, body: dict[str, Any], message: str
) -> None:
    triton = {**BASE, "persona": "triton-tensorrt-llm"}
    async with (
        SimCluster(1, base=triton) as cluster,
        http.post(cluster.urls[0] + path, json=body) as resp,
    ):
        assert resp.status == 400
        assert await resp.json() == {"error": message}


async def test_triton_not_ready_during_startup(http: aiohttp.ClientSession) -> None:
    base = {**BASE, "persona": "triton-tensorrt-llm", "faults": {"startup_delay_s": 5.0}}
    async with SimCluster(1, base=base) as cluster:
        async with http.get(cluster.urls[0] + "/v2/health/ready") as resp:
            assert (resp.status, await resp.read()) == (400, b"")
        async with http.get(cluster.urls[0] + "/v2/health/live") as resp:
            assert resp.status == 200
