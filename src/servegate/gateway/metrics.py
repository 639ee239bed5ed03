"""The gateway's own Prometheus metrics, with llm-d's and the Inference Extension's names.

Every request is observed once, into the `llm_d_epp_*` family (llm-d router's
current names, labelled `model_name`, `target_model_name`, `fairness_id`,
`priority`). The Gateway API Inference Extension's older names
(`inference_objective_*`, `inference_pool_*`, `inference_extension_*`), which
GIE's Grafana dashboard and many alerts still query, are built from those same
series when /metrics is scraped: summed over the labels the older family does
not have (`Rollup`), or copied under the other name where the labels agree.
Per-request series are touched through cached label children (one dict lookup
on the hot path); pool gauges are computed only when /metrics is scraped.

Client-chosen label values (the fairness id; the model name of a request that
named no served model) are bounded as upstream bounds them: after 1000
distinct values, new ones are counted as `other`.

docs/metrics.md lists every series, its labels and its upstream name.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import metrics as _client_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString as _go_float

from servegate import __version__
from servegate.gateway.histogram import TPOT_BUCKETS, Buckets
from servegate.scheduling.scheduler import ScoreTable

if TYPE_CHECKING:
    from servegate.gateway.access_log import AccessRecord
    from servegate.pool.pool import Pool
    from servegate.scheduling.framework import Decision
    from servegate.scheduling.scheduler import Scheduler

LATENCY_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10,
    15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
TTFT_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10,
    15, 20, 30, 45, 60, 120,
)  # fmt: skip
NTPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
INPUT_TOKEN_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072,
    262144, 524288, 1048576,
)  # fmt: skip
OUTPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
REQUEST_SIZE_BUCKETS = tuple(float(1 << n) for n in range(6, 31))
"""64 B to 1 GiB, doubling (upstream's request-size buckets)."""
RESPONSE_SIZE_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536,
)  # fmt: skip
DECISION_BUCKETS = (
    0.00001, 0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1,
)  # fmt: skip
SCORE_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
"""Weighted scores: a scorer's 0-1 score times its weight in the profile."""

TOKEN_BUCKETS = INPUT_TOKEN_BUCKETS
"""Kept for importers of the older name."""

DEFAULT_FAIRNESS_ID = "default-flow"
"""The flow of a request that names none (llm-d's `DefaultFairnessID`)."""
OVERFLOW_LABEL = "other"
MAX_LABEL_VALUES = 1000

MODEL_SERVER_ERROR = "ModelServerError"
REQUEST_LABELS = ("model_name", "target_model_name", "fairness_id", "priority")


class BoundedLabel:
    """Label values as they come until `limit` distinct ones were seen, then `other`."""

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int = MAX_LABEL_VALUES) -> None:
        self._seen: set[str] = set()
        self._limit = limit

    def __call__(self, value: str) -> str:
        if not value or value in self._seen:
            return value
        if len(self._seen) >= self._limit:
            return OVERFLOW_LABEL
        self._seen.add(value)
        return value


# -- per-request recording without locks ----------------------------------------------


def le(bound: float) -> str:
    """A bucket bound as Prometheus clients write it (`0.005`, `1.0`, `+Inf`)."""
    text: str = _go_float(bound)  # type: ignore[no-untyped-call]
    return text


class Value:
    """One counter or gauge child: a float the event loop adds to."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class Family(Collector):
    """A labelled counter, gauge or histogram for the request path, rendered by
    prometheus_client at scrape.

    prometheus_client's own metrics take a lock per update and scan the buckets
    linearly; here the event loop is the only writer (and /metrics is rendered on the
    same loop), so a child is a plain float or a bucket list found by bisection.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        kind: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = (),
        registry: CollectorRegistry | None = None,
        created: bool = False,
    ) -> None:
        """`created`: a counter also exports each child's creation time (`_created`), as
        prometheus_client's `Counter` does (unless its created series are disabled)."""
        self.name = name
        self.documentation = documentation
        self.kind = kind
        self.label_names = tuple(labels)
        self.bounds = tuple(float(b) for b in buckets)
        self.children: dict[tuple[str, ...], Value | Buckets] = {}
        self.created: dict[tuple[str, ...], float] | None = {} if created else None
        if registry is not None:
            registry.register(self)

    def _child(self, values: tuple[str, ...]) -> Value | Buckets:
        if len(values) != len(self.label_names):
            raise ValueError(f"{self.name}: expected labels {self.label_names}, got {values}")
        child = self.children.get(values)
        if child is None:
            child = Buckets(self.bounds) if self.kind == "histogram" else Value()
            self.children[values] = child
            if self.created is not None:
                self.created[values] = time.time()
        return child

    def labels(self, *values: str) -> Value:
        child = self._child(values)
        assert isinstance(child, Value)
        return child

    def histogram(self, *values: str) -> Buckets:
        child = self._child(values)
        assert isinstance(child, Buckets)
        return child

    def collect(self) -> Iterable[Metric]:
        out = Metric(self.name, self.documentation, self.kind)
        names = self.label_names
        created = self.created if _client_metrics._use_created else None
        for values, child in self.children.items():
            labels = dict(zip(names, values, strict=True))
            if isinstance(child, Value):
                suffix = "_total" if self.kind == "counter" else ""
                out.add_sample(self.name + suffix, labels, child.value)
                if created is not None:
                    out.add_sample(self.name + "_created", labels, created[values])
                continue
            cumulative = 0
            for bound, count in zip((*child.bounds, math.inf), child.counts, strict=True):
                cumulative += count
                out.add_sample(self.name + "_bucket", {**labels, "le": le(bound)}, cumulative)
            out.add_sample(self.name + "_count", labels, cumulative)
            out.add_sample(self.name + "_sum", labels, child.sum)
        yield out


# -- scrape-time views over the recorded series ---------------------------------------


def _suffix(sample: Sample, family: Metric) -> str:
    return sample.name[len(family.name) :]


class Rollup(Collector):
    """`source` again under `name`, summed over the labels `labels` does not keep.

    `labels` maps each output label to the source label it is read from, so a
    label can also be renamed. `_created` samples are dropped (a sum has none).
    """

    def __init__(
        self,
        source: Collector,
        name: str,
        documentation: str,
        labels: Mapping[str, str],
    ) -> None:
        self._source = source
        self._name = name
        self._doc = documentation
        self._labels = dict(labels)

    def collect(self) -> Iterable[Metric]:
        for family in self._source.collect():
            out = Metric(self._name, self._doc, family.type)
            sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for sample in family.samples:
                suffix = _suffix(sample, family)
                if suffix == "_created":
                    continue
                kept = tuple(
                    (out_l, sample.labels.get(src, "")) for out_l, src in self._labels.items()
                )
                if "le" in sample.labels:
                    kept = (*kept, ("le", sample.labels["le"]))
                key = (suffix, kept)
                sums[key] = sums.get(key, 0.0) + sample.value
            for (suffix, kept), value in sums.items():
                out.add_sample(self._name + suffix, dict(kept), value)
            yield out


def renamed(family: Metric, name: str, labels: Mapping[str, str] | None = None) -> Metric:
    """`family` under another name (same samples, `_created` dropped, labels renamed)."""
    out = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        suffix = _suffix(sample, family)
        if suffix == "_created":
            continue
        sample_labels = sample.labels
        if labels:
            sample_labels = {labels.get(k, k): v for k, v in sample_labels.items()}
        out.add_sample(name + suffix, sample_labels, sample.value)
    return out


RUNTIME_ALIASES = {
    f"llm_d_epp_{name}": f"inference_extension_{name}"
    for name in (
        "flow_control_request_queue_duration_seconds",
        "flow_control_request_enqueue_duration_seconds",
        "flow_control_dispatch_cycle_duration_seconds",
        "flow_control_queue_size",
        "flow_control_queue_bytes",
        "flow_control_pool_saturation",
        "plugin_duration_seconds",
    )
}
"""Per-pool families (flow control, plugin timings) and their Inference Extension names:
the labels are the same in both, so the older family is a copy."""


def with_aliases(families: Iterable[Metric]) -> Iterable[Metric]:
    for family in families:
        yield family
        legacy = RUNTIME_ALIASES.get(family.name)
        if legacy is not None:
            yield renamed(family, legacy)


# -- pool gauges and scheduler timings, computed at scrape -----------------------------


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


class _PoolCollector(Collector):
    def __init__(self, pools: Callable[[], Iterable[Pool]]) -> None:
        self._pools = pools

    def collect(self) -> Iterable[Metric]:
        def gauge(name: str, doc: str, labels: tuple[str, ...] = ("name",)) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=list(labels))

        families: dict[str, GaugeMetricFamily] = {}
        pool_gauges = {
            "average_kv_cache_utilization": "Average KV-cache utilisation over the pool's endpoints.",
            "average_queue_size": "Average engine queue size over the pool's endpoints.",
            "average_running_requests": "Average engine running requests over the pool's endpoints.",
        }
        for stem, doc in pool_gauges.items():
            families["llm_d_epp_" + stem] = gauge("llm_d_epp_" + stem, doc)
            families["inference_pool_" + stem] = gauge("inference_pool_" + stem, doc)
        for stem in ("kv_cache_utilization", "queue_size", "running_requests"):
            name = "llm_d_epp_std_dev_" + stem
            families[name] = gauge(name, f"Standard deviation of {stem} over the pool's endpoints.")
        ready_doc = "Endpoints in the pool that take requests."
        families["inference_pool_ready_pods"] = gauge("inference_pool_ready_pods", ready_doc)
        families["llm_d_epp_ready_endpoints"] = gauge("llm_d_epp_ready_endpoints", ready_doc)
        per_pod = gauge(
            "inference_pool_per_pod_queue_size",
            "Engine queue size per endpoint.",
            ("name", "model_server_pod"),
        )
        per_endpoint = gauge(
            "llm_d_epp_per_endpoint_queue_size",
            "Engine queue size per endpoint.",
            ("name", "model_server_endpoint"),
        )
        ejected = gauge(
            "servegate_endpoint_ejected",
            "1 while passive health keeps the endpoint out of rotation.",
            ("name", "endpoint"),
        )
        in_flight = gauge(
            "servegate_endpoint_in_flight_requests",
            "Requests the gateway has in flight per endpoint.",
            ("name", "endpoint"),
        )
        picks = CounterMetricFamily(
            "servegate_endpoint_picks",
            "Times the scheduler picked each endpoint as the target.",
            labels=["name", "endpoint"],
        )
        now = time.monotonic()
        for pool in self._pools():
            states = list(pool)
            label = [pool.name]
            kv_mean, kv_std = _mean_std([s.metrics.kv_usage for s in states])
            q_mean, q_std = _mean_std([s.metrics.waiting for s in states])
            r_mean, r_std = _mean_std([s.metrics.running for s in states])
            for prefix in ("llm_d_epp_", "inference_pool_"):
                families[prefix + "average_kv_cache_utilization"].add_metric(label, kv_mean)
                families[prefix + "average_queue_size"].add_metric(label, q_mean)
                families[prefix + "average_running_requests"].add_metric(label, r_mean)
            families["llm_d_epp_std_dev_kv_cache_utilization"].add_metric(label, kv_std)
            families["llm_d_epp_std_dev_queue_size"].add_metric(label, q_std)
            families["llm_d_epp_std_dev_running_requests"].add_metric(label, r_std)
            ready = pool.ready_count()
            families["inference_pool_ready_pods"].add_metric(label, ready)
            families["llm_d_epp_ready_endpoints"].add_metric(label, ready)
            for s in states:
                per_pod.add_metric([pool.name, s.address], s.metrics.waiting)
                per_endpoint.add_metric([pool.name, s.address], s.metrics.waiting)
                in_flight.add_metric([pool.name, s.address], s.in_flight_requests)
                ejected.add_metric([pool.name, s.address], 1 if s.ejected_until > now else 0)
                picks.add_metric([pool.name, s.address], s.picks)
        yield from families.values()
        yield from (per_pod, per_endpoint, ejected, in_flight, picks)


class PluginDurationCollector(Collector):
    """`llm_d_epp_plugin_duration_seconds` from the scheduler's own per-call buckets."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def collect(self) -> Iterable[Metric]:
        from servegate.scheduling.scheduler import PLUGIN_BUCKETS_S

        family = HistogramMetricFamily(
            "llm_d_epp_plugin_duration_seconds",
            "Time in each plugin call, by extension point, plugin type and plugin name.",
            labels=["extension_point", "plugin_type", "plugin_name"],
        )
        stats = self._scheduler.stats
        for (point, name), timing in (*stats.plugins.items(), *stats.hooks.items()):
            if not timing.calls:
                continue
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip((*PLUGIN_BUCKETS_S, math.inf), timing.counts, strict=True):
                cumulative += count
                buckets.append((le(bound), float(cumulative)))
            family.add_metric([point, timing.type, name], buckets, timing.total_ns / 1e9)
        yield family


# -- per-request series ---------------------------------------------------------------


@dataclass(slots=True)
class RequestSeries:
    """The label children of one (model, target, fairness id, priority), created once."""

    model: str
    target: str
    fairness_id: str
    priority: str
    requests: Value
    duration: Buckets
    request_size: Buckets
    response_size: Buckets
    input_tokens: Buckets
    output_tokens: Buckets
    cached_tokens: Buckets
    ntpot: Buckets
    streaming_tpot: Buckets
    streaming_itl: Buckets
    ttft_streaming: Buckets
    ttft_unary: Buckets
    running: Value


ObjectiveSeries = RequestSeries
"""The older name of `RequestSeries`."""


class GatewayMetrics:
    def __init__(self, pools: Callable[[], Iterable[Pool]] | None = None) -> None:
        """`pools`: the pools whose gauges to export, read at every scrape; or name them
        later with `watch` (the gateway's are known only once its runtimes are built)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = list(REQUEST_LABELS)

        def histogram(
            name: str, doc: str, buckets: Sequence[float], extra: Sequence[str] = ()
        ) -> Family:
            return Family(name, doc, "histogram", [*labels, *extra], buckets, r)

        self.requests = Family(
            "llm_d_epp_request", "Requests received, by model and target model.", "counter",
            labels, registry=r,
        )  # fmt: skip
        self.request_errors = Family(
            "llm_d_epp_request_error",
            "Requests that ended in an error, by llm-d's error code.",
            "counter",
            [*labels, "error_code"],
            registry=r,
        )
        self.duration = histogram(
            "llm_d_epp_request_duration_seconds",
            "End-to-end request latency at the gateway.",
            LATENCY_BUCKETS,
        )
        self.request_size = histogram(
            "llm_d_epp_request_size_bytes", "Request body size in bytes.", REQUEST_SIZE_BUCKETS
        )
        self.response_size = histogram(
            "llm_d_epp_response_size_bytes",
            "Response body size in bytes, as relayed to the client.",
            RESPONSE_SIZE_BUCKETS,
        )
        self.input_tokens = histogram(
            "llm_d_epp_request_input_tokens",
            "Prompt tokens per request (from the engine's usage).",
            INPUT_TOKEN_BUCKETS,
        )
        self.output_tokens = histogram(
            "llm_d_epp_request_output_tokens",
            "Completion tokens per request (from the engine's usage).",
            OUTPUT_TOKEN_BUCKETS,
        )
        self.cached_tokens = histogram(
            "llm_d_epp_request_cached_tokens",
            "Prompt tokens served from the engine's prefix cache (usage.prompt_tokens_details).",
            INPUT_TOKEN_BUCKETS,
        )
        self.ntpot = histogram(
            "llm_d_epp_request_ntpot_seconds",
            "Request latency divided by its output tokens.",
            NTPOT_BUCKETS,
        )
        self.streaming_tpot = histogram(
            "llm_d_epp_request_streaming_tpot_seconds",
            "Streaming requests: (latency - TTFT) / (output tokens - 1).",
            TPOT_BUCKETS,
        )
        self.streaming_itl = histogram(
            "llm_d_epp_request_streaming_itl_seconds",
            "Streaming requests: time between consecutive response chunks relayed.",
            TPOT_BUCKETS,
        )
        self.ttft = histogram(
            "llm_d_epp_request_ttft_seconds",
            "From request arrival to the first response byte relayed (the whole body, unary).",
            TTFT_BUCKETS,
            ("streaming",),
        )
        self.running = Family(
            "llm_d_epp_request_running",
            "Requests in flight through the gateway.",
            "gauge",
            labels,
            registry=r,
        )
        self.decision_family = Family(
            "llm_d_epp_scheduler_e2e_duration_seconds",
            "Time to make one scheduling decision.",
            "histogram",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.decision = self.decision_family.histogram()
        self.attempts = Family(
            "llm_d_epp_scheduler_attempts",
            "Scheduling attempts, by status and the primary endpoint chosen.",
            "counter",
            ["status", "target_model_name", "endpoint_name", "namespace", "port"],
            registry=r,
        )
        self.rewrites = Family(
            "llm_d_epp_model_rewrite_decisions",
            "Model rewrites applied, by rule name, requested model and target model.",
            "counter",
            ["model_rewrite_name", "model_name", "target_model"],
            registry=r,
            created=True,
        )
        self.info = Gauge(
            "llm_d_epp_info", "Build information.", ["commit", "build_ref"], registry=r
        )
        self.info.labels("", __version__).set(1)
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
        self.responses = Family(
            "servegate_http_responses",
            "Responses sent by status code.",
            "counter",
            ["code"],
            registry=r,
            created=True,
        )
        self.disagg_decisions = Family(
            "llm_d_inference_scheduler_disagg_decision",
            "Prefill/decode decisions by type (decode-only, prefill-decode), as llm-d counts them.",
            "counter",
            ["model_name", "decision_type"],
            registry=r,
            created=True,
        )
        self.pd_decision_families = tuple(
            Family(name, doc, "counter", ["model_name", "decision_type"], registry=r, created=True)
            for name, doc in (
                ("llm_d_epp_disagg_decision", "Disaggregation decisions by type (llm-d-router)."),
                ("llm_d_epp_pd_decision", "P/D decisions by type (llm-d-router, deprecated)."),
                (
                    "llm_d_inference_scheduler_pd_decision",
                    "P/D decisions by type (llm-d-inference-scheduler, deprecated name).",
                ),
            )
        )
        self._pd_children: dict[tuple[str, str], tuple[Value, ...]] = {}
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
        self.picked_score = Family(
            "servegate_scheduler_picked_score",
            "Each scorer's weighted score for the endpoint the scheduler picked, by pool.",
            "histogram",
            ["name", "scorer"],
            SCORE_BUCKETS,
            r,
        )
        if pools is not None:
            self.watch(pools)
        self._register_legacy()
        self.bound_model = BoundedLabel()
        self.bound_fairness = BoundedLabel()
        self._series: dict[tuple[str, str, str, int], RequestSeries] = {}
        self._response_children: dict[int, Value] = {}
        self._attempt_children: dict[tuple[str, str], Value] = {}
        self._error_children: dict[tuple[str, str, str, str, str], Value] = {}
        self._score_children: dict[tuple[str, str], Buckets] = {}
        self._score_rows: dict[tuple[str, int], tuple[list[str], list[Buckets]]] = {}
        """(pool, id of a profile's scorer names) → the names and their children, in order."""

    def observe_pick(self, pool: str, decision: Decision) -> None:
        """Record the picked endpoint's per-scorer scores in its profile (the dashboard's
        "scores" panel): which signals decide, and how strongly."""
        result = decision.results.get(decision.profile)
        if result is None:
            return
        scores = result.scores
        # the scheduler's: its row and children, by list (`type`, not `isinstance`: compiled by
        # mypyc, ScoreTable shares Mapping's ABC registry, which holds dict)
        if type(scores) is ScoreTable:
            names = scores.names
            key = (pool, id(names))
            held = self._score_rows.get(key)
            if held is None or held[0] is not names:  # (holding `names` keeps its id unique)
                if not names or decision.endpoint not in scores.scored:
                    return  # (no children made for nothing to observe)
                held = self._score_rows[key] = (names, [self._score_child(pool, n) for n in names])
            scores.observe_row(decision.endpoint, held[1])  # (nothing when not scored)
            return
        row = scores.get(decision.endpoint.endpoint.address)
        if not row:
            return
        for scorer, value in row.items():
            self._score_child(pool, scorer).observe(value)

    def _score_child(self, pool: str, scorer: str) -> Buckets:
        children = self._score_children
        child = children.get((pool, scorer))
        if child is None:
            child = children[(pool, scorer)] = self.picked_score.histogram(pool, scorer)
        return child

    def watch(self, pools: Callable[[], Iterable[Pool]]) -> None:
        """Export the gauges of the pools `pools()` returns at each scrape."""
        self.registry.register(_PoolCollector(pools))

    def _register_legacy(self) -> None:
        """The Inference Extension's names, summed from the llm-d series at scrape."""
        r = self.registry
        model = {"model_name": "model_name", "target_model_name": "target_model_name"}
        objective = "inference_objective_"
        for source, name, upstream in (
            (self.duration, "request_duration_seconds", "request_duration_seconds"),
            (self.request_size, "request_sizes", "request_size_bytes"),
            (self.response_size, "response_sizes", "response_size_bytes"),
            (self.input_tokens, "input_tokens", "request_input_tokens"),
            (self.output_tokens, "output_tokens", "request_output_tokens"),
            (self.cached_tokens, "prompt_cached_tokens", "request_cached_tokens"),
            (self.ntpot, "normalized_time_per_output_token_seconds", "request_ntpot_seconds"),
        ):
            doc = f"llm_d_epp_{upstream} summed over fairness_id and priority."
            r.register(Rollup(source, objective + name, doc, model))
        r.register(
            Rollup(
                self.ttft,
                "servegate_time_to_first_byte_seconds",
                "From request arrival to the first response byte sent to the client"
                " (llm_d_epp_request_ttft_seconds summed over streaming, fairness_id, priority).",
                model,
            )
        )
        r.register(
            Rollup(
                self.requests,
                objective + "request",
                "Requests received, by model, target model and priority.",
                {**model, "priority": "priority"},
            )
        )
        r.register(
            Rollup(
                self.request_errors,
                objective + "request_error",
                "Requests that ended in an error, by llm-d's error code.",
                {**model, "error_code": "error_code"},
            )
        )
        r.register(
            Rollup(
                self.running,
                objective + "running_requests",
                "Requests in flight through the gateway.",
                {"model_name": "model_name"},
            )
        )
        r.register(
            Rollup(
                self.decision_family,
                "inference_extension_scheduler_e2e_duration_seconds",
                "Time to make one scheduling decision.",
                {},
            )
        )
        r.register(
            Rollup(
                self.attempts,
                "inference_extension_scheduler_attempts",
                "Scheduling attempts, by status and the primary endpoint chosen.",
                {
                    "status": "status",
                    "target_model_name": "target_model_name",
                    "pod_name": "endpoint_name",
                    "namespace": "namespace",
                    "port": "port",
                },
            )
        )
        r.register(
            Rollup(
                self.rewrites,
                "inference_extension_model_rewrite_decisions",
                "Model rewrites applied, by rule name, requested model and target model.",
                {k: k for k in ("model_rewrite_name", "model_name", "target_model")},
            )
        )
        r.register(
            Rollup(
                self.info,
                "inference_extension_info",
                "Build information.",
                {"commit": "commit", "build_ref": "build_ref"},
            )
        )

    def response(self, status: int) -> Value:
        child = self._response_children.get(status)
        if child is None:
            child = self._response_children[status] = self.responses.labels(str(status))
        return child

    def start(self, model: str, target: str, fairness_id: str, priority: int) -> RequestSeries:
        """A routed request begins: its series (created once), with `running` raised."""
        fairness = self.bound_fairness(fairness_id or DEFAULT_FAIRNESS_ID)
        key = (model, target, fairness, priority)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = self._create(model, target, fairness, priority)
        series.running.value += 1
        return series

    def _create(self, model: str, target: str, fairness_id: str, priority: int) -> RequestSeries:
        model, target = self.bound_model(model), self.bound_model(target)
        values = (model, target, fairness_id, str(priority))
        return RequestSeries(
            *values,
            requests=self.requests.labels(*values),
            duration=self.duration.histogram(*values),
            request_size=self.request_size.histogram(*values),
            response_size=self.response_size.histogram(*values),
            input_tokens=self.input_tokens.histogram(*values),
            output_tokens=self.output_tokens.histogram(*values),
            cached_tokens=self.cached_tokens.histogram(*values),
            ntpot=self.ntpot.histogram(*values),
            streaming_tpot=self.streaming_tpot.histogram(*values),
            streaming_itl=self.streaming_itl.histogram(*values),
            ttft_streaming=self.ttft.histogram(*values, "true"),
            ttft_unary=self.ttft.histogram(*values, "false"),
            running=self.running.labels(*values),
        )

    def error(
        self,
        code: str,
        series: RequestSeries | None = None,
        model: str = "",
        fairness_id: str = "",
        priority: int = 0,
    ) -> None:
        """Count one error; `series` when the request was routed, else what is known of it."""
        if series is not None:
            key = (series.model, series.target, series.fairness_id, series.priority, code)
        else:
            fairness = self.bound_fairness(fairness_id or DEFAULT_FAIRNESS_ID)
            key = (self.bound_model(model), "", fairness, str(priority), code)
        child = self._error_children.get(key)
        if child is None:
            child = self._error_children[key] = self.request_errors.labels(*key)
        child.value += 1

    def finish(
        self,
        series: RequestSeries,
        record: AccessRecord,
        elapsed_s: float,
        request_bytes: int,
        error_code: str | None,
    ) -> None:
        """A routed request ended: observe it once in every per-request series.

        A response the replica answered with a status other than 2xx counts as
        `ModelServerError` (as llm-d counts it); a client that left (499) is no error.
        Every request's observations are `Buckets.observe` written out: the call cost
        about as much as the observation (1.40 -> 1.13 µs per finish, timeit).
        """
        series.running.value -= 1
        series.requests.value += 1
        child = series.duration
        child.counts[bisect_left(child.bounds, elapsed_s)] += 1
        child.sum += elapsed_s
        child = series.request_size
        child.counts[bisect_left(child.bounds, request_bytes)] += 1
        child.sum += request_bytes
        status = record.status
        if error_code is not None:
            self.error(error_code, series)
        elif not 200 <= status < 300 and status != 499:
            self.error(MODEL_SERVER_ERROR, series)
        response_bytes = record.response_bytes
        if response_bytes:
            child = series.response_size
            child.counts[bisect_left(child.bounds, response_bytes)] += 1
            child.sum += response_bytes
        stream = record.stream
        ttft_ms = record.ttft_ms
        if ttft_ms is not None:
            ttft = ttft_ms / 1000.0
            child = series.ttft_streaming if stream else series.ttft_unary
            child.counts[bisect_left(child.bounds, ttft)] += 1
            child.sum += ttft
        prompt = record.prompt_tokens
        if prompt:
            child = series.input_tokens
            child.counts[bisect_left(child.bounds, prompt)] += 1
            child.sum += prompt
        cached = record.cached_tokens
        if cached is not None:
            series.cached_tokens.observe(cached)
        output = record.completion_tokens
        if output and elapsed_s > 0:
            child = series.output_tokens
            child.counts[bisect_left(child.bounds, output)] += 1
            child.sum += output
            ntpot = elapsed_s / output
            child = series.ntpot
            child.counts[bisect_left(child.bounds, ntpot)] += 1
            child.sum += ntpot
            if stream and ttft_ms is not None and output > 1:
                series.streaming_tpot.observe((elapsed_s - ttft_ms / 1000.0) / (output - 1))
        if stream:
            gaps = record.itl
            if gaps is not None:
                series.streaming_itl.merge(gaps)

    def pd_decision(self, model: str, decision_type: str) -> None:
        """One prefill/decode decision, counted under each of llm-d's names for it."""
        key = (model, decision_type)
        children = self._pd_children.get(key)
        if children is None:
            model = self.bound_model(model)
            children = self._pd_children[key] = tuple(
                family.labels(model, decision_type)
                for family in (self.disagg_decisions, *self.pd_decision_families)
            )
        for child in children:
            child.value += 1

    def scheduled(self, target: str, address: str | None) -> None:
        """One scheduling attempt: `address` is the primary endpoint, None when it failed."""
        key = (target, address or "")
        child = self._attempt_children.get(key)
        if child is None:
            target = self.bound_model(target)
            if address is None:
                child = self.attempts.labels("failure", target, "", "", "")
            else:
                port = address.rpartition(":")[2]
                child = self.attempts.labels("success", target, address, "", port)
            self._attempt_children[key] = child
        child.value += 1

    def rewritten(self, rule: str, model: str, target: str) -> None:
        self.rewrites.labels(rule, self.bound_model(model), target).value += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
