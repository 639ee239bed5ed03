"""Range checks for what replicas (and peers) say about their load.

A replica's `/metrics` page, or a peer's report on the scale-out bus, is input
from another process: a value outside what any engine can report is a lie or a
bug, and must never decide routing or flow control. Two layers:

- `out_of_range(metrics)` names the signals that are impossible (a negative or
  absurdly large queue, KV usage well outside [0, 1]); the scraper rejects such
  a scrape as a failure (`out_of_range`), so the endpoint's metrics age as if the
  scrape had failed instead of making it look idle.
- `sane(metrics)` clamps every field into its range and is applied wherever
  metrics enter the pool (`Pool.set_metrics`), whatever their source: after it
  no value is negative, non-finite or over its cap, so no sum over endpoints (the
  saturation detectors') can overflow to infinity or NaN.
"""

from __future__ import annotations

from dataclasses import replace
from math import isfinite

from servegate.pool.endpoint import EndpointMetrics, LoraInfo

MAX_REQUESTS = 1_000_000.0
"""Waiting or running requests one replica can plausibly report (vLLM caps at far fewer)."""
KV_SLACK = 0.01
"""KV usage within this of [0, 1] is rounding and is clamped; beyond it, out of range."""
MAX_BLOCK_SIZE = 1 << 16
MAX_NUM_BLOCKS = 1 << 32
MAX_COUNTER = 2.0**62
"""Prefix-cache counters beyond this (or negative) are dropped."""
MAX_LORA = 1 << 16
MAX_IN_FLIGHT = 1_000_000
"""In-flight requests (or 1000x this in tokens) a peer may report for one endpoint."""
MAX_IN_FLIGHT_TOKENS = 1000 * MAX_IN_FLIGHT


def _finite_in(value: float, low: float, high: float) -> bool:
    return isfinite(value) and low <= value <= high


def out_of_range(m: EndpointMetrics) -> tuple[str, ...]:
    """The signals of `m` whose values no engine can report."""
    bad = []
    if not _finite_in(m.waiting, 0.0, MAX_REQUESTS):
        bad.append("waiting")
    if not _finite_in(m.running, 0.0, MAX_REQUESTS):
        bad.append("running")
    if not _finite_in(m.kv_usage, -KV_SLACK, 1.0 + KV_SLACK):
        bad.append("kv_usage")
    return tuple(bad)


def _clamp(value: float, high: float) -> float:
    if not isfinite(value) or value <= 0.0:
        return 0.0
    return min(value, high)


def _counter(value: float | None) -> float | None:
    if value is None or not _finite_in(value, 0.0, MAX_COUNTER):
        return None
    return value


def _geometry(value: int | None, high: int) -> int | None:
    return value if value is not None and 1 <= value <= high else None


def sane(m: EndpointMetrics) -> EndpointMetrics:
    """`m` with every field in range (the same object when nothing needed changing)."""
    waiting = _clamp(m.waiting, MAX_REQUESTS)
    running = _clamp(m.running, MAX_REQUESTS)
    kv_usage = _clamp(m.kv_usage, 1.0)
    block_size = _geometry(m.block_size, MAX_BLOCK_SIZE)
    num_blocks = _geometry(m.num_blocks, MAX_NUM_BLOCKS)
    queries = _counter(m.prefix_cache_queries)
    hits = _counter(m.prefix_cache_hits)
    lora = m.lora
    if lora is not None and not 0 <= lora.max_lora <= MAX_LORA:
        lora = LoraInfo(MAX_LORA, lora.running, lora.waiting)
    scraped_at = m.scraped_at if isfinite(m.scraped_at) and m.scraped_at >= 0.0 else 0.0
    if (
        waiting == m.waiting
        and running == m.running
        and kv_usage == m.kv_usage
        and block_size == m.block_size
        and num_blocks == m.num_blocks
        and queries == m.prefix_cache_queries
        and hits == m.prefix_cache_hits
        and lora is m.lora
        and scraped_at == m.scraped_at
    ):
        return m
    return replace(
        m,
        waiting=waiting,
        running=running,
        kv_usage=kv_usage,
        block_size=block_size,
        num_blocks=num_blocks,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        lora=lora,
        scraped_at=scraped_at,
    )


def in_flight_count(value: int, high: int) -> int:
    """A peer's in-flight count, capped (a negative one is 0)."""
    return 0 if value < 0 else min(value, high)
