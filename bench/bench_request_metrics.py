"""Time the per-request metrics work of the gateway: one request observed in every series.

    .venv/bin/python bench/bench_request_metrics.py [--requests N]

What one request costs: `GatewayMetrics.start` (running up), the scheduling
observations (decision latency, attempt), and `finish` (running down, counters
and the eleven histograms of llm-d's request family), for a streamed request
with usage. For comparison, the same request observed through prometheus_client
metric objects directly (`Histogram.observe`, `Counter.inc`: a lock per update
and a linear bucket scan), in the four histograms the gateway recorded before
llm-d's family was added. It prints microseconds per request, median of 5 runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from servegate.gateway.access_log import AccessRecord
from servegate.gateway.metrics import (
    DECISION_BUCKETS,
    LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    GatewayMetrics,
)


def record() -> AccessRecord:
    out = AccessRecord("r", "POST", "/v1/chat/completions", status=200)
    out.ttft_ms, out.prompt_tokens, out.completion_tokens = 12.0, 100, 20
    out.cached_tokens, out.response_bytes, out.stream = 64, 900, True
    return out


def gateway(n: int) -> float:
    metrics = GatewayMetrics(lambda: [])
    done = record()
    t0 = time.perf_counter()
    for _ in range(n):
        series = metrics.start("model", "model", "tenant", 0)
        metrics.decision.observe(0.0001)
        metrics.scheduled("model", "10.0.0.1:8000")
        metrics.finish(series, done, 0.5, 2000, None)
    return (time.perf_counter() - t0) / n * 1e6


def prometheus_client_objects(n: int) -> float:
    r = CollectorRegistry()
    labels = ["model_name", "target_model_name"]
    requests = Counter("requests", "", labels, registry=r).labels("model", "model")
    running = Gauge("running", "", ["model_name"], registry=r).labels("model")
    hists = [
        Histogram(name, "", labels, buckets=buckets, registry=r).labels("model", "model")
        for name, buckets in (
            ("duration", LATENCY_BUCKETS),
            ("ttft", LATENCY_BUCKETS),
            ("inp", TOKEN_BUCKETS),
            ("out", TOKEN_BUCKETS),
        )
    ]
    decision = Histogram("decision", "", buckets=DECISION_BUCKETS, registry=r)
    values = (0.5, 0.012, 100, 20)
    t0 = time.perf_counter()
    for _ in range(n):
        running.inc()
        decision.observe(0.0001)
        running.dec()
        requests.inc()
        for hist, value in zip(hists, values, strict=True):
            hist.observe(value)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    args = parser.parse_args()
    for name, run in (("gateway", gateway), ("prometheus_client", prometheus_client_objects)):
        runs = [run(args.requests) for _ in range(5)]
        print(f"{name:>18}: {statistics.median(runs):6.2f} µs per request")


if __name__ == "__main__":
    main()
