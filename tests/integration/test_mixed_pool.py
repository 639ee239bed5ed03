"""One model served by vLLM, SGLang, trtllm-serve and Triton replicas in one pool.

Every engine's metrics land in the same `EndpointMetrics`, so the load scorers
compare replicas across engine types; Triton's answers are translated, the
others relayed, and the client cannot tell which served it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from servegate.gateway.triton import TRITON_ENGINE
from servegate.testing.cluster import SimCluster
from servegate.testing.gateway import GatewayRunner
from tests.integration.conftest import MODEL, PICKER_HEAD, wait_for

ENGINES = ("vllm", "sglang", "trtllm-serve", TRITON_ENGINE)
MIXED_SIM = {
    "model": MODEL,
    "speed": 20.0,
    "num_blocks": 256,
    "block_size": 16,
    "max_model_len": 2048,
    "max_num_seqs": 1,
}
RANDOM_PICKER = {**PICKER_HEAD, "plugins": [{"type": "random-picker"}]}
LOAD_PICKER = {
    **PICKER_HEAD,
    "plugins": [
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "max-score-picker"},
    ],
}


def mixed_config(cluster: SimCluster, picker: dict[str, Any]) -> dict[str, Any]:
    endpoints = []
    for handle, engine in zip(cluster, ENGINES, strict=True):
        entry: dict[str, Any] = {"url": handle.url, "engine": engine, "model": MODEL}
        if engine != "vllm":
            entry["metrics_url"] = handle.metrics_url
        endpoints.append(entry)
    return {
        "gateway": {"seed": 7, "port": 0, "debug_headers": True},
        "picker": picker,
        "pool": {
            "scrape_interval_s": 0.05,
            "health": {"interval_s": 0.1, "timeout_s": 0.5, "failure_threshold": 2},
            "endpoints": endpoints,
        },
    }


@pytest.fixture
async def mixed() -> AsyncIterator[SimCluster]:
    overrides = [{"persona": engine} for engine in ENGINES]
    async with SimCluster(len(ENGINES), base=MIXED_SIM, overrides=overrides) as cluster:
        yield cluster


@contextlib.asynccontextmanager
async def started(cfg: dict[str, Any]) -> AsyncIterator[GatewayRunner]:
    async with GatewayRunner(cfg) as gw:
        pool = gw.gateway.pool
        await wait_for(
            lambda: (
                pool.ready_count() == len(ENGINES) and all(s.metrics.scraped_at > 0 for s in pool)
            ),
            what="every engine ready and scraped",
        )
        yield gw


def request_body(chat: bool, stream: bool) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": "hello"}]
        return "/v1/chat/completions", body
    body["prompt"] = "hello"
    return "/v1/completions", body


async def send(
    session: aiohttp.ClientSession, gw: GatewayRunner, chat: bool, stream: bool
) -> tuple[str, str]:
    """One request; returns (endpoint, generated text) after checking it is well formed."""
    path, body = request_body(chat, stream)
    async with session.post(gw.url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        endpoint = resp.headers["x-gateway-destination-endpoint"]
        if not stream:
            choice = (await resp.json())["choices"][0]
            return endpoint, choice["message"]["content"] if chat else choice["text"]
        events = [e.removeprefix("data: ") for e in (await resp.text()).split("\n\n") if e]
    assert events[-1] == "[DONE]", events
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    if chat:
        return endpoint, "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    return endpoint, "".join(c["choices"][0]["text"] for c in chunks)


async def test_every_engine_serves_streaming_and_not(
    mixed: SimCluster, session: aiohttp.ClientSession
) -> None:
    engine_of = {h.address: e for h, e in zip(mixed, ENGINES, strict=True)}
    served: Counter[tuple[str, bool, bool]] = Counter()
    async with started(mixed_config(mixed, RANDOM_PICKER)) as gw:
        for i in range(48):
            chat, stream = bool(i & 1), bool(i & 2)
            endpoint, text = await send(session, gw, chat, stream)
            assert text
            served[(engine_of[endpoint], chat, stream)] += 1
    assert {engine for engine, _, _ in served} == set(ENGINES)
    assert {(chat, stream) for _, chat, stream in served} == {
        (False, False),
        (False, True),
        (True, False),
        (True, True),
    }
    lines = gw.access_lines()
    assert len(lines) == 48 and all(line["status"] == 200 for line in lines)


async def load(session: aiohttp.ClientSession, url: str, engine: str) -> None:
    """Long generations sent to a replica directly, in its own API, until cancelled."""
    if engine == TRITON_ENGINE:
        path = f"/v2/models/{MODEL}/generate_stream"
        body: dict[str, Any] = {"text_input": "load " * 200, "max_tokens": 1500}
    else:
        path = "/v1/completions"
        body = {"model": MODEL, "prompt": "load " * 200, "max_tokens": 1500, "stream": True}
    async with session.post(url + path, json=body) as resp:
        async for _ in resp.content.iter_any():
            pass


@pytest.mark.parametrize("idle", ENGINES)
async def test_load_scorers_prefer_the_idle_replica_across_engines(
    mixed: SimCluster, session: aiohttp.ClientSession, idle: str
) -> None:
    async with started(mixed_config(mixed, LOAD_PICKER)) as gw:
        loaders = [
            asyncio.create_task(load(session, h.url, engine))
            for h, engine in zip(mixed, ENGINES, strict=True)
            if engine != idle
            for _ in range(3)
        ]
        try:
            idle_address = mixed[ENGINES.index(idle)].address
            busy = [s for s in gw.gateway.pool if s.address != idle_address]
            await wait_for(
                lambda: all(s.metrics.waiting >= 1 and s.metrics.kv_usage > 0 for s in busy),
                timeout=10.0,
                what="the loaded replicas to report queues and KV use",
            )
            for i in range(8):
                endpoint, _ = await send(session, gw, chat=bool(i & 1), stream=bool(i & 2))
                assert endpoint == idle_address
        finally:
            for task in loaders:
                task.cancel()
            for task in loaders:
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await task
