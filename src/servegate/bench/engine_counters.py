"""The replicas' own counters, read before and after each target's run.

A router can only claim cache hits; the engines count them. From vLLM's `/metrics`:
prefix-cache hits and queries (in tokens; `vllm:prefix_cache_*_total`, older
`vllm:gpu_prefix_cache_*_total`) give the true cluster hit rate, and finished
requests (`vllm:request_success_total`, else `vllm:e2e_request_latency_seconds_count`)
give each replica's share of the load. Counters are summed over all label sets
(data-parallel ranks, finish reasons). Parsed with `prometheus_client` as this is
not on any hot path.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

HIT_SAMPLES = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
QUERY_SAMPLES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
REQUEST_SAMPLES = ("vllm:request_success_total", "vllm:e2e_request_latency_seconds_count")
SCRAPE_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class EngineCounters:
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    requests: float | None = None


def _first_present(sums: dict[str, float], names: Iterable[str]) -> float | None:
    for name in names:
        if name in sums:
            return sums[name]
    return None


def parse_engine_counters(page: str) -> EngineCounters:
    """Raises ValueError when the page is not Prometheus text."""
    wanted = {*HIT_SAMPLES, *QUERY_SAMPLES, *REQUEST_SAMPLES}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name in wanted:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return EngineCounters(
        prefix_hits=_first_present(sums, HIT_SAMPLES),
        prefix_queries=_first_present(sums, QUERY_SAMPLES),
        requests=_first_present(sums, REQUEST_SAMPLES),
    )


@dataclass(slots=True)
class EngineDelta:
    """What one engine counted during one target's runs (summed over its segments)."""

    prefix_hits: float | None = None
    prefix_queries: float | None = None
    requests: float | None = None
    failed_scrapes: int = 0

    def add(self, before: EngineCounters | None, after: EngineCounters | None) -> None:
        if before is None or after is None:
            self.failed_scrapes += 1
            return
        self.prefix_hits = _add(self.prefix_hits, before.prefix_hits, after.prefix_hits)
        self.prefix_queries = _add(self.prefix_queries, before.prefix_queries, after.prefix_queries)
        self.requests = _add(self.requests, before.requests, after.requests)


def _add(total: float | None, before: float | None, after: float | None) -> float | None:
    if before is None or after is None:
        return total
    # A counter that went down means the engine restarted; count from zero then.
    delta = after - before if after >= before else after
    return delta if total is None else total + delta


def engine_url(base: str) -> str:
    return base.rstrip("/").removesuffix("/metrics")


async def scrape_counters(session: aiohttp.ClientSession, base_url: str) -> EngineCounters | None:
    """None when the engine cannot be reached or its page cannot be parsed."""
    try:
        async with session.get(
            engine_url(base_url) + "/metrics",
            timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S),
        ) as response:
            if response.status != 200:
                return None
            page = await response.text()
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None
    try:
        return parse_engine_counters(page)
    except ValueError:
        return None


async def reset_prefix_cache(session: aiohttp.ClientSession, base_url: str) -> bool:
    """vLLM answers this only with `VLLM_SERVER_DEV_MODE=1`; False when it refused."""
    try:
        async with session.post(
            engine_url(base_url) + "/reset_prefix_cache",
            timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S),
        ) as response:
            await response.read()
            return response.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False
