"""The gateway's own Prometheus metrics, with Gateway API Inference Extension names.

Per-request series are touched with cached label children (one dict lookup on
the hot path); pool gauges are computed only when /metrics is scraped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from servegate.pool.pool import Pool
    from servegate.scheduling.framework import Decision

LATENCY_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10,
    15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
TOKEN_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072,
)  # fmt: skip
DECISION_BUCKETS = (
    0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1,
)  # fmt: skip
SCORE_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
"""Weighted scores: a scorer's 0-1 score times its weight in the profile."""


class _PoolCollector(Collector):
    def __init__(self, pools: Callable[[], Iterable[Pool]]) -> None:
        self._pools = pools

    def collect(self) -> Iterable[Metric]:
        ready = GaugeMetricFamily(
            "inference_pool_ready_pods",
            "Endpoints in the pool that take requests.",
            labels=["name"],
        )
        kv = GaugeMetricFamily(
            "inference_pool_average_kv_cache_utilization",
            "Average KV-cache utilisation over the pool's endpoints.",
            labels=["name"],
        )
        queue = GaugeMetricFamily(
            "inference_pool_average_queue_size",
            "Average engine queue size over the pool's endpoints.",
            labels=["name"],
        )
        per_pod = GaugeMetricFamily(
            "inference_pool_per_pod_queue_size",
            "Engine queue size per endpoint.",
            labels=["name", "model_server_pod"],
        )
        ejected = GaugeMetricFamily(
            "servegate_endpoint_ejected",
            "1 while passive health keeps the endpoint out of rotation.",
            labels=["name", "endpoint"],
        )
        in_flight = GaugeMetricFamily(
            "servegate_endpoint_in_flight_requests",
            "Requests the gateway has in flight per endpoint.",
            labels=["name", "endpoint"],
        )
        picks = CounterMetricFamily(
            "servegate_endpoint_picks",
            "Times the scheduler picked each endpoint as the target.",
            labels=["name", "endpoint"],
        )
        now = time.monotonic()
        for pool in self._pools():
            states = list(pool)
            ready.add_metric([pool.name], pool.ready_count())
            n = len(states) or 1
            kv.add_metric([pool.name], sum(s.metrics.kv_usage for s in states) / n)
            queue.add_metric([pool.name], sum(s.metrics.waiting for s in states) / n)
            for s in states:
                per_pod.add_metric([pool.name, s.address], s.metrics.waiting)
                in_flight.add_metric([pool.name, s.address], s.in_flight_requests)
                ejected.add_metric([pool.name, s.address], 1 if s.ejected_until > now else 0)
                picks.add_metric([pool.name, s.address], s.picks)
        yield from (ready, kv, queue, per_pod, ejected, in_flight, picks)


@dataclass(frozen=True, slots=True)
class ObjectiveSeries:
    requests: Counter
    duration: Histogram
    ttft: Histogram
    input_tokens: Histogram
    output_tokens: Histogram
    running: Gauge


class GatewayMetrics:
    def __init__(self, pools: Callable[[], Iterable[Pool]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        objective = ["model_name", "target_model_name"]
        self.requests = Counter(
            "inference_objective_request", "Requests received.", objective, registry=r
        )
        self.request_errors = Counter(
            "inference_objective_request_error",
            "Requests that ended in an error.",
            [*objective, "error_code"],
            registry=r,
        )
        self.duration = Histogram(
            "inference_objective_request_duration_seconds",
            "End-to-end request latency at the gateway.",
            objective,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "servegate_time_to_first_byte_seconds",
            "From request arrival to the first response byte sent to the client.",
            objective,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.input_tokens = Histogram(
            "inference_objective_input_tokens",
            "Prompt tokens per request (from the engine's usage).",
            objective,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = Histogram(
            "inference_objective_output_tokens",
            "Completion tokens per request (from the engine's usage).",
            objective,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.running = Gauge(
            "inference_objective_running_requests",
            "Requests in flight through the gateway.",
            ["model_name"],
            registry=r,
        )
        self.decision = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds",
            "Time to make one scheduling decision.",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "servegate_upstream_retries",
            "Attempts moved to a fallback endpoint.",
            ["reason"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "servegate_upstream_errors",
            "Upstream failures by kind (connect, timeout, status code, midstream).",
            ["endpoint", "kind"],
            registry=r,
        )
        self.ejections = Counter(
            "servegate_endpoint_ejections",
            "Times passive health (outlier detection) ejected each endpoint.",
            ["endpoint"],
            registry=r,
        )
        self.responses = Counter(
            "servegate_http_responses", "Responses sent by status code.", ["code"], registry=r
        )
        self.disagg_decisions = Counter(
            "llm_d_inference_scheduler_disagg_decision",
            "Prefill/decode decisions by type (decode-only, prefill-decode), as llm-d counts them.",
            ["model_name", "decision_type"],
            registry=r,
        )
        self.disagg_fallbacks = Counter(
            "servegate_disagg_prefill_fallbacks",
            "Gateway-orchestrated prefill legs that failed, so the decode replica prefilled itself.",
            ["reason"],
            registry=r,
        )
        self.reloads = Counter(
            "servegate_config_reloads",
            "Configuration reloads by result (success, failure: the old config stays).",
            ["result"],
            registry=r,
        )
        self.picked_score = Histogram(
            "servegate_scheduler_picked_score",
            "Each scorer's weighted score for the endpoint the scheduler picked, by pool.",
            ["name", "scorer"],
            buckets=SCORE_BUCKETS,
            registry=r,
        )
        r.register(_PoolCollector(pools))
        self._score_children: dict[tuple[str, str], Histogram] = {}
        self._objective_children: dict[tuple[str, str], ObjectiveSeries] = {}
        self._response_children: dict[int, Counter] = {}

    def response(self, status: int) -> Counter:
        child = self._response_children.get(status)
        if child is None:
            child = self._response_children[status] = self.responses.labels(str(status))
        return child

    def objective(self, model: str, target: str) -> ObjectiveSeries:
        """The label children of one (model, target) pair, created once."""
        key = (model, target)
        children = self._objective_children.get(key)
        if children is None:
            children = ObjectiveSeries(
                requests=self.requests.labels(model, target),
                duration=self.duration.labels(model, target),
                ttft=self.ttft.labels(model, target),
                input_tokens=self.input_tokens.labels(model, target),
                output_tokens=self.output_tokens.labels(model, target),
                running=self.running.labels(model),
            )
            self._objective_children[key] = children
        return children

    def observe_pick(self, pool: str, decision: Decision) -> None:
        """Record the picked endpoint's per-scorer scores in its profile (the dashboard's
        "scores" panel): which signals decide, and how strongly."""
        result = decision.results.get(decision.profile)
        if result is None:
            return
        row = result.scores.get(decision.endpoint.endpoint.address)
        if not row:
            return
        children = self._score_children
        for scorer, value in row.items():
            child = children.get((pool, scorer))
            if child is None:
                child = children[(pool, scorer)] = self.picked_score.labels(pool, scorer)
            child.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
