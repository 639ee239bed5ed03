"""Real vLLM `/metrics`: servegate's parser, its scraper and the gateway agree with the engine.

The engine is held in a known, non-trivial state while the pages are read: two
adapter requests (`a1`, `a2`) running and a third adapter (`a3`) waiting, because
`--max-loras 2` leaves it no slot. The state lasts until a1 and a2 finish (a few
seconds; less on a busy machine), so an observation counts only when engine pages
read before and after it both show the state; otherwise the state is set up again.
The queue, running count and LoRA labels are then equal everywhere; KV usage moves
while decoding, so it must lie between the before and after values.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
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
ONE_BLOCK = 1 / NUM_BLOCKS
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


def held(view: EndpointMetrics) -> bool:
    return (view.running, view.waiting) == (2.0, 1.0)


def held_pages(server: VllmServer, attempts: int = 5) -> Iterator[str]:
    """`/metrics` pages of `server` in the held state; sets it up again when it ends."""
    for _ in range(attempts):
        running = [long_completion(name, f"hold {name} busy") for name in ("a1", "a2")]
        with inflight(server.url, running):
            wait_for(
                lambda: reference_view(server.metrics_text()).running == 2,
                timeout_s=60,
                what="a1 and a2 running",
            )
            with inflight(server.url, [long_completion("a3", "hold a3 waiting")]):
                while True:
                    page = server.metrics_text()
                    view = reference_view(page)
                    if held(view):
                        yield page
                    elif view.running < 2:
                        break
                    time.sleep(0.05)
        wait_for(
            lambda: reference_view(server.metrics_text()).running == 0,
            timeout_s=60,
            what=f"{server.url} idle again",
        )
    raise AssertionError(f"{server.url} left the held state {attempts} times before a check")


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
    text = next(held_pages(cluster[0]))
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
            scraper = Scraper(pool, session, endpoint, MetricsParser(SPEC), ScrapeSettings(1.0))
            return await scraper.scrape_once()

    for page in held_pages(server):
        assert asyncio.run(scrape())
        before, after = reference_view(page), reference_view(server.metrics_text())
        if held(after):
            break
    state = pool.get(endpoint.address)
    assert state is not None
    seen = state.metrics
    assert (seen.waiting, seen.running, seen.block_size, seen.num_blocks, seen.lora) == (
        after.waiting,
        after.running,
        after.block_size,
        after.num_blocks,
        after.lora,
    )
    assert before.kv_usage <= seen.kv_usage <= after.kv_usage


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
    for page in held_pages(server):
        text = gateway.metrics_text()
        before, after = reference_view(page), reference_view(server.metrics_text())
        # the gateway scrapes every 0.1 s: wait until it has seen the held state
        if held(after) and _gateway_gauge(text, QUEUE, server.address) == 1.0:
            break
    for other in cluster:
        if other is not server:
            assert _gateway_gauge(text, QUEUE, other.address) == 0.0
    # average over the pool: server 0's queue (1) and the idle ones' (0)
    assert _gateway_gauge(text, "inference_pool_average_queue_size") == 1.0 / len(cluster)
    # Idle servers hold no blocks. The gateway's last good scrape of server 0 can be
    # older than `before` (0.1 s interval, 0.5 s timeout on a busy machine); two
    # requests decoding fill about 8 blocks a second here, hence 8 blocks of slack.
    average_kv = _gateway_gauge(text, "inference_pool_average_kv_cache_utilization") * len(cluster)
    assert before.kv_usage - 8 * ONE_BLOCK <= average_kv <= after.kv_usage + ONE_BLOCK
