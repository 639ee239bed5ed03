"""Real vLLM `/metrics`: servegate's parser, its scraper and the gateway agree with the engine.

The engine is held in a known, non-trivial state while the pages are read: two
adapter requests (`a1`, `a2`) running and a third adapter (`a3`) waiting, because
`--max-loras 2` leaves it no slot. That state lasts for seconds, so separate
fetches by the test, the scraper and the gateway all see the same queue, running
count and LoRA labels; only the KV usage moves (decode fills blocks), so it is
compared within a few blocks.
"""

from __future__ import annotations

import aiohttp
import pytest
from gateway_process import GatewayProcess
from inflight import inflight, long_completion, wait_for
from prometheus_client.parser import text_string_to_metric_families

from servegate.datalayer.metrics_parser import MetricsParser
from servegate.datalayer.scraper import Scraper, ScrapeSettings
from servegate.engines.vllm import SPEC
from servegate.pool.endpoint import Endpoint, EndpointMetrics, LoraInfo
from servegate.pool.pool import Pool
from servegate.testing.vllm_cluster import VllmCluster, VllmServer

BLOCK_SIZE = 32
NUM_BLOCKS = 128
MAX_LORA = 2
KV_TOLERANCE = 8 / NUM_BLOCKS
"""Decode fills a block every 32 tokens per request; 8 blocks cover a second of drift."""


def reference_view(text: str) -> EndpointMetrics:
    """The engine's page read with prometheus_client, the way the vLLM spec says."""
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def values(name: str) -> list[float]:
        return [s.value for s in families[name].samples]

    kv = values("vllm:kv_cache_usage_perc")
    info = families["vllm:cache_config_info"].samples
    lora = None
    # vLLM declares the family at start but adds a series only with the first adapter request
    lora_samples = families["vllm:lora_requests_info"].samples
    if lora_samples:
        latest = max(lora_samples, key=lambda s: s.value)

        def names(label: str) -> frozenset[str]:
            return frozenset(n for n in latest.labels[label].split(",") if n)

        lora = LoraInfo(
            max_lora=int(latest.labels["max_lora"]),
            running=names("running_lora_adapters"),
            waiting=names("waiting_lora_adapters"),
        )
    return EndpointMetrics(
        waiting=sum(values("vllm:num_requests_waiting")),
        running=sum(values("vllm:num_requests_running")),
        kv_usage=sum(kv) / len(kv),
        block_size=max(int(s.labels["block_size"]) for s in info),
        num_blocks=sum(int(s.labels["num_gpu_blocks"]) for s in info),
        lora=lora,
    )


def servegate_view(text: str) -> EndpointMetrics:
    result = MetricsParser(SPEC).parse(text, now=1.0)
    assert result.malformed == 0
    return result.metrics


def comparable(m: EndpointMetrics) -> tuple[object, ...]:
    return (m.waiting, m.running, round(m.kv_usage, 9), m.block_size, m.num_blocks, m.lora)


@pytest.fixture
def held_state(cluster: VllmCluster) -> VllmServer:
    """Server 0 with a1 and a2 running and a3 waiting, until the test ends."""
    server = cluster[0]
    bodies = [long_completion(name, f"hold {name} busy") for name in ("a1", "a2", "a3")]
    with inflight(server.url, bodies):
        wait_for(
            lambda: reference_view(server.metrics_text()).waiting == 1,
            timeout_s=30,
            what="2 running + 1 waiting on server 0",
        )
        yield server
    wait_for(
        lambda: reference_view(server.metrics_text()).running == 0,
        timeout_s=30,
        what="server 0 idle again",
    )


def test_idle_page_geometry_and_lora_slots(cluster: VllmCluster) -> None:
    for server in cluster:
        before = server.metrics_text()
        assert comparable(servegate_view(before)) == comparable(reference_view(before))
        server.post("/v1/completions", {"model": "a1", "prompt": "slot", "max_tokens": 1})
        text = server.metrics_text()
        ref = reference_view(text)
        got = servegate_view(text)
        assert ref.lora is not None
        assert (ref.block_size, ref.num_blocks, ref.lora.max_lora) == (
            BLOCK_SIZE,
            NUM_BLOCKS,
            MAX_LORA,
        )
        assert comparable(got) == comparable(ref)
        families = {f.name for f in text_string_to_metric_families(text)}
        assert {"vllm:prefix_cache_hits", "vllm:prefix_cache_queries"} <= families
        assert got.prefix_cache_hits is not None
        assert got.prefix_cache_queries is not None


def test_loaded_page_parses_the_same_both_ways(held_state: VllmServer) -> None:
    text = held_state.metrics_text()
    ref = reference_view(text)
    got = servegate_view(text)
    assert comparable(got) == comparable(ref)
    assert (got.running, got.waiting) == (2.0, 1.0)
    assert got.lora is not None
    assert got.lora.running == frozenset({"a1", "a2"})
    assert 0.0 < got.kv_usage < 1.0


async def test_scraper_view_equals_engine_page(held_state: VllmServer) -> None:
    pool = Pool("engine")
    endpoint = Endpoint(address=held_state.address, url=held_state.url, model="tiny")
    pool.add(endpoint)
    async with aiohttp.ClientSession() as session:
        scraper = Scraper(pool, session, endpoint, MetricsParser(SPEC), ScrapeSettings(1.0))
        assert await scraper.scrape_once(), scraper.stats
    state = pool.get(endpoint.address)
    assert state is not None
    seen = state.metrics
    ref = reference_view(held_state.metrics_text())
    assert (seen.waiting, seen.running, seen.block_size, seen.num_blocks, seen.lora) == (
        ref.waiting,
        ref.running,
        ref.block_size,
        ref.num_blocks,
        ref.lora,
    )
    assert seen.kv_usage == pytest.approx(ref.kv_usage, abs=KV_TOLERANCE)


def _gateway_gauge(text: str, family: str, pod: str | None = None) -> float:
    for fam in text_string_to_metric_families(text):
        if fam.name != family:
            continue
        for sample in fam.samples:
            if pod is None or sample.labels.get("model_server_pod") == pod:
                return float(sample.value)
    raise AssertionError(f"{family} (pod {pod}) not on the gateway's /metrics page")


def test_gateway_pool_gauges_follow_the_engine(
    held_state: VllmServer, gateway: GatewayProcess, cluster: VllmCluster
) -> None:
    # The gateway scrapes every 0.1 s; give it a few intervals to see the held state.
    def queue_seen() -> bool:
        text = gateway.metrics_text()
        return _gateway_gauge(text, "inference_pool_per_pod_queue_size", held_state.address) == 1.0

    wait_for(queue_seen, timeout_s=5, what="the gateway to see server 0's queue of 1")
    text = gateway.metrics_text()
    ref = reference_view(held_state.metrics_text())
    others = [s for s in cluster if s is not held_state]
    for other in others:
        assert _gateway_gauge(text, "inference_pool_per_pod_queue_size", other.address) == 0.0
    # average over the pool: server 0's queue (1) and the idle ones' (0)
    assert _gateway_gauge(text, "inference_pool_average_queue_size") == pytest.approx(
        1.0 / len(cluster)
    )
    average_kv = _gateway_gauge(text, "inference_pool_average_kv_cache_utilization")
    assert average_kv == pytest.approx(ref.kv_usage / len(cluster), abs=KV_TOLERANCE)
