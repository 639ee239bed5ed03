"""The test helpers: in-process clusters with KV events, and child-process clusters."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from servegate.testing.cluster import SimCluster, SimClusterProcess

msgpack = pytest.importorskip("msgpack")

BASE: dict[str, Any] = {
    "model": "tiny",
    "num_blocks": 65,
    "block_size": 4,
    "max_model_len": 256,
    "speed": 50.0,
}


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_in_process_cluster_publishes_kv_events(transport: Any) -> None:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        async with (
            SimCluster(2, base=BASE, kv_events=transport) as cluster,
            aiohttp.ClientSession() as http,
        ):
            assert len(set(cluster.urls)) == 2
            handle = cluster[1]
            assert handle.kv_events_topic == f"kv@{handle.address}@tiny"
            assert handle.kv_events_endpoint is not None
            sub.connect(handle.kv_events_endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            await asyncio.sleep(0.2)
            prompt = "the model and the cache " * 4
            async with http.post(
                handle.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}
            ) as resp:
                assert resp.status == 200
            topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            assert (topic.decode(), int.from_bytes(seq, "big")) == (handle.kv_events_topic, 0)
            _, events, _ = msgpack.unpackb(payload, raw=False)
            assert events[0]["type"] == "BlockStored"
            assert set(events[0]["block_hashes"]) <= handle.engine.kv.cached_hashes()
            assert cluster[0].engine.stats.requests_received == 0
    finally:
        sub.close(linger=0)
        ctx.term()


async def test_per_server_overrides() -> None:
    overrides: list[dict[str, Any]] = [{"persona": "sglang"}, {"lora": {"adapters": ["a1"]}}]
    async with SimCluster(2, base=BASE, overrides=overrides) as cluster:
        assert [c.persona for c in cluster.configs] == ["sglang", "vllm"]
        assert cluster.engines[1].lora is not None


async def test_process_cluster_crash_exits_only_that_child() -> None:
    async with SimClusterProcess(2, base=BASE) as cluster, aiohttp.ClientSession() as http:
        pids = [s.pid for s in cluster.servers]
        assert len(set(pids)) == 2
        for url in cluster.urls:
            async with http.post(
                url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}
            ) as resp:
                assert resp.status == 200
        async with http.post(cluster.urls[0] + "/admin/fault", json={"mode": "crash"}) as resp:
            assert await resp.json() == {"mode": "crash", "exit": True}
        assert await asyncio.wait_for(cluster[0].proc.wait(), 5) == 70
        async with http.get(cluster[1].health_url) as resp:
            assert resp.status == 200
        survivor = cluster[1].proc
    assert survivor.returncode is not None


async def test_process_cluster_reports_startup_failure() -> None:
    with pytest.raises(RuntimeError, match="exited"):
        async with SimClusterProcess(1, base={**BASE, "kv_events": {"endpoint": "bogus://x"}}):
            pass
