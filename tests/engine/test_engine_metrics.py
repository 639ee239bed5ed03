"""Real vLLM `/metrics`: servegate's parser, its scraper and the gateway agree with the engine.

The engine is held in a known, non-trivial state while the pages are read: two
adapter requests (`a1`, `a2`) running and a third adapter (`a3`) waiting, because
`--max-loras 2` leaves it no slot. `inflight.holding` freezes that state with the
engine paused, so every page read inside it is the same state and the views must
be equal, KV usage included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp
import pytest
from gateway_process import GatewayProcess
from inflight import holding, wait_for
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
QUEUE = "inference_pool_per_pod_queue_size"


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


@contextmanager
def held(server: VllmServer) -> Iterator[EndpointMetrics]:
    """`server` frozen with a1 and a2 running and a3 waiting; yields the engine's view."""
    with holding(server, running=("a1", "a2"), waiting=("a3",)):
        view = reference_view(server.metrics_text())
        assert (view.running, view.waiting) == (2.0, 1.0), view
        yield view


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


def test_loaded_page_parses_the_same_both_ways(cluster: VllmCluster) -> None:
    server = cluster[0]
    with held(server):
        text = server.metrics_text()
    ref = reference_view(text)
    got = servegate_view(text)
    assert comparable(got) == comparable(ref)
    assert (got.running, got.waiting) == (2.0, 1.0)
    assert got.lora is not None
    assert got.lora.running == frozenset({"a1", "a2"})
    assert 0.0 < got.kv_usage < 1.0


def test_scraper_view_equals_engine_page(cluster: VllmCluster) -> None:
    server = cluster[0]
    pool = Pool("engine")
    endpoint = Endpoint(address=server.address, url=server.url, model="tiny")
    pool.add(endpoint)

    async def scrape() -> bool:
        async with aiohttp.ClientSession() as session:
            scraper = Scraper(
                pool, session, endpoint, MetricsParser(SPEC), ScrapeSettings(scrape_interval_s=1.0)
            )
            return await scraper.scrape_once()

    with held(server) as before:
        assert asyncio.run(scrape())
        after = reference_view(server.metrics_text())
    assert comparable(after) == comparable(before)
    state = pool.get(endpoint.address)
    assert state is not None
    assert comparable(state.metrics) == comparable(after)


def _gateway_gauge(text: str, family: str, pod: str | None = None) -> float:
    for fam in text_string_to_metric_families(text):
        if fam.name != family:
            continue
        for sample in fam.samples:
            if pod is None or sample.labels.get("model_server_pod") == pod:
                return float(sample.value)
    raise AssertionError(f"{family} (pod {pod}) not on the gateway's /metrics page")


def test_gateway_pool_gauges_follow_the_engine(
    gateway: GatewayProcess, cluster: VllmCluster
) -> None:
    server = cluster[0]

    def caught_up() -> bool:
        """The gateway shows the held queue and the KV usage the engine's page shows now
        (a scrape taken while the state was being built can show the queue first)."""
        page = gateway.metrics_text()
        kv = _gateway_gauge(page, "inference_pool_average_kv_cache_utilization") * len(cluster)
        now = reference_view(server.metrics_text()).kv_usage
        return _gateway_gauge(page, QUEUE, server.address) == 1.0 and abs(kv - now) <= 1e-9

    with held(server) as engine:
        # the gateway scrapes every 0.1 s; the held state stays until the block ends
        wait_for(caught_up, timeout_s=30, what="the gateway's gauges for the held server")
        text = gateway.metrics_text()
        engine = reference_view(server.metrics_text())
    assert _gateway_gauge(text, QUEUE, server.address) == engine.waiting
    for other in cluster:
        if other is not server:
            assert _gateway_gauge(text, QUEUE, other.address) == 0.0
    # average over the pool: server 0's queue (1) and the idle ones' (0)
    assert _gateway_gauge(text, "inference_pool_average_queue_size") == 1.0 / len(cluster)
    # idle servers hold no blocks, and the held server's usage does not move
    average_kv = _gateway_gauge(text, "inference_pool_average_kv_cache_utilization")
    assert average_kv * len(cluster) == pytest.approx(engine.kv_usage, abs=1e-9)
