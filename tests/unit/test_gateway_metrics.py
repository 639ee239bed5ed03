"""The gateway's metrics: one observation per request, the older names derived at scrape."""

from __future__ import annotations

import orjson
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from servegate.gateway.access_log import AccessRecord
from servegate.gateway.errors import (
    BadRequest,
    BodyTooLarge,
    GatewayError,
    ModelNotFound,
    NoEndpoints,
    NotFound,
    Saturated,
    ShuttingDown,
    TtlExpired,
    UpstreamFailed,
)
from servegate.gateway.metrics import (
    BoundedLabel,
    GatewayMetrics,
    PluginDurationCollector,
    Rollup,
    with_aliases,
)
from servegate.scheduling.framework import SchedulerProfile
from servegate.scheduling.pickers import MaxScorePicker
from servegate.scheduling.profiles import SingleProfileHandler
from servegate.scheduling.scheduler import PLUGIN_BUCKETS_S, PluginTiming, Scheduler


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def record(status: int = 200, **fields: object) -> AccessRecord:
    out = AccessRecord(request_id="r", method="POST", path="/v1/chat/completions", status=status)
    for key, item in fields.items():
        setattr(out, key, item)
    return out


def test_rollup_sums_over_the_labels_it_drops_and_renames() -> None:
    registry = CollectorRegistry()
    source = Counter("src", "s", ["a", "b"], registry=registry)
    source.labels("x", "1").inc(2)
    source.labels("x", "2").inc(3)
    source.labels("y", "1").inc(5)
    registry.register(Rollup(source, "dst", "d", {"renamed": "a"}))
    assert registry.get_sample_value("dst_total", {"renamed": "x"}) == 5.0
    assert registry.get_sample_value("dst_total", {"renamed": "y"}) == 5.0
    assert registry.get_sample_value("dst_created", {"renamed": "x"}) is None


def test_rollup_of_a_histogram_keeps_its_buckets() -> None:
    registry = CollectorRegistry()
    source = Histogram("h", "h", ["a", "b"], buckets=(1, 2), registry=registry)
    source.labels("x", "1").observe(0.5)
    source.labels("x", "2").observe(1.5)
    registry.register(Rollup(source, "g", "g", {"a": "a"}))
    assert registry.get_sample_value("g_bucket", {"a": "x", "le": "1.0"}) == 1.0
    assert registry.get_sample_value("g_bucket", {"a": "x", "le": "+Inf"}) == 2.0
    assert registry.get_sample_value("g_sum", {"a": "x"}) == 2.0
    assert registry.get_sample_value("g_count", {"a": "x"}) == 2.0


def test_bounded_label_counts_new_values_as_other_past_the_limit() -> None:
    bound = BoundedLabel(limit=2)
    assert [bound(v) for v in ("a", "b", "c", "a", "")] == ["a", "b", "other", "a", ""]


def test_one_request_lands_in_every_family_under_both_names() -> None:
    metrics = GatewayMetrics(lambda: [])
    series = metrics.start("alias", "model", "", 3)
    llm_d = {
        "model_name": "alias",
        "target_model_name": "model",
        "fairness_id": "default-flow",
        "priority": "3",
    }
    assert value(metrics, "llm_d_epp_request_running", **llm_d) == 1.0
    done = record(
        response_bytes=300,
        ttft_ms=100.0,
        prompt_tokens=40,
        completion_tokens=11,
        cached_tokens=16,
        stream=True,
    )
    metrics.finish(series, done, 1.1, 512, None)
    assert value(metrics, "llm_d_epp_request_running", **llm_d) == 0.0
    assert value(metrics, "llm_d_epp_request_total", **llm_d) == 1.0
    assert value(metrics, "llm_d_epp_request_size_bytes_sum", **llm_d) == 512.0
    assert value(metrics, "llm_d_epp_response_size_bytes_sum", **llm_d) == 300.0
    assert value(metrics, "llm_d_epp_request_cached_tokens_sum", **llm_d) == 16.0
    assert value(metrics, "llm_d_epp_request_ntpot_seconds_sum", **llm_d) == pytest.approx(0.1)
    # streaming TPOT: (1.1 s - 0.1 s) / (11 - 1)
    tpot = value(metrics, "llm_d_epp_request_streaming_tpot_seconds_sum", **llm_d)
    assert tpot == pytest.approx(0.1)
    ttft = value(metrics, "llm_d_epp_request_ttft_seconds_count", streaming="true", **llm_d)
    assert ttft == 1.0
    model = {"model_name": "alias", "target_model_name": "model"}
    assert value(metrics, "inference_objective_request_total", priority="3", **model) == 1.0
    assert value(metrics, "inference_objective_request_sizes_sum", **model) == 512.0
    assert value(metrics, "inference_objective_response_sizes_count", **model) == 1.0
    assert value(metrics, "inference_objective_input_tokens_sum", **model) == 40.0
    assert value(metrics, "inference_objective_output_tokens_sum", **model) == 11.0
    assert value(metrics, "inference_objective_prompt_cached_tokens_sum", **model) == 16.0
    ntpot = value(
        metrics, "inference_objective_normalized_time_per_output_token_seconds_sum", **model
    )
    assert ntpot == pytest.approx(0.1)
    assert value(metrics, "inference_objective_running_requests", model_name="alias") == 0.0
    assert value(metrics, "servegate_time_to_first_byte_seconds_count", **model) == 1.0


def test_streams_observe_the_gap_between_every_two_chunks_relayed() -> None:
    metrics = GatewayMetrics(lambda: [])
    series = metrics.start("m", "m", "t", 0)
    done = record(ttft_ms=50.0, completion_tokens=4, stream=True)
    for at in (10.0, 10.02, 10.05, 10.15):  # first chunk, then gaps of 20, 30 and 100 ms
        done.relayed(at)
    assert done.itl is not None
    assert done.itl.count == 3
    assert done.itl.sum == pytest.approx(0.15)
    metrics.finish(series, done, 0.2, 10, None)
    labels = {"model_name": "m", "target_model_name": "m", "fairness_id": "t", "priority": "0"}
    name = "llm_d_epp_request_streaming_itl_seconds"
    assert value(metrics, f"{name}_count", **labels) == 3.0
    assert value(metrics, f"{name}_sum", **labels) == pytest.approx(0.15)
    assert value(metrics, f"{name}_bucket", le="0.02", **labels) == 1.0
    assert value(metrics, f"{name}_bucket", le="0.04", **labels) == 2.0
    unary = record(ttft_ms=50.0, completion_tokens=4)
    unary.relayed(1.0)
    metrics.finish(series, unary, 0.2, 10, None)
    assert value(metrics, f"{name}_count", **labels) == 3.0
    assert "_itl" not in orjson.loads(orjson.dumps(done))  # not in the access log


def test_a_long_stream_keeps_a_fixed_number_of_itl_counters() -> None:
    """A stream of any length holds one counter per bucket, not one float per chunk."""
    long = record(ttft_ms=50.0, completion_tokens=4, stream=True)
    for chunk in range(100_000):
        long.relayed(10.0 + chunk * 0.01)
    assert long.itl is not None
    assert long.itl.count == 99_999
    assert len(long.itl.counts) == len(long.itl.bounds) + 1


def test_pd_decisions_are_counted_under_every_llm_d_name() -> None:
    metrics = GatewayMetrics(lambda: [])
    metrics.pd_decision("m", "prefill-decode")
    metrics.pd_decision("m", "prefill-decode")
    metrics.pd_decision("m", "decode-only")
    for name in (
        "llm_d_epp_disagg_decision_total",
        "llm_d_epp_pd_decision_total",
        "llm_d_inference_scheduler_disagg_decision_total",
        "llm_d_inference_scheduler_pd_decision_total",
    ):
        assert value(metrics, name, model_name="m", decision_type="prefill-decode") == 2.0
        assert value(metrics, name, model_name="m", decision_type="decode-only") == 1.0


def test_unary_requests_have_no_streaming_tpot() -> None:
    metrics = GatewayMetrics(lambda: [])
    series = metrics.start("m", "m", "t", 0)
    metrics.finish(series, record(ttft_ms=50.0, completion_tokens=5), 0.5, 10, None)
    labels = {"model_name": "m", "target_model_name": "m", "fairness_id": "t", "priority": "0"}
    assert value(metrics, "llm_d_epp_request_streaming_tpot_seconds_count", **labels) == 0.0
    assert value(metrics, "llm_d_epp_request_ttft_seconds_count", streaming="false", **labels) == 1


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (BadRequest("x"), "BadRequest"),
        (BodyTooLarge("x"), "BadRequest"),
        (ModelNotFound("x"), "NotFound"),
        (NotFound("x"), "NotFound"),
        (Saturated("x"), "ResourceExhausted"),
        (TtlExpired("x"), "ResourceExhausted"),
        (NoEndpoints("x"), "ServiceUnavailable"),
        (ShuttingDown("x"), "ServiceUnavailable"),
        (UpstreamFailed("x"), "ModelServerError"),
    ],
)
def test_errors_carry_llm_ds_codes(error: GatewayError, code: str) -> None:
    assert error.canonical == code


@pytest.mark.parametrize(
    ("status", "error_code", "counted"),
    [
        pytest.param(200, None, None, id="ok"),
        pytest.param(500, None, "ModelServerError", id="replica-5xx"),
        pytest.param(400, None, "ModelServerError", id="replica-4xx"),
        pytest.param(499, None, None, id="client-left"),
        pytest.param(429, "ResourceExhausted", "ResourceExhausted", id="gateway-error"),
    ],
)
def test_error_counting(status: int, error_code: str | None, counted: str | None) -> None:
    metrics = GatewayMetrics(lambda: [])
    series = metrics.start("m", "m", "", 0)
    metrics.finish(series, record(status), 0.1, 10, error_code)
    codes = {
        s.labels["error_code"]
        for family in metrics.registry.collect()
        if family.name == "inference_objective_request_error"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert codes == ({counted} if counted else set())


def test_errors_before_routing_name_what_is_known() -> None:
    metrics = GatewayMetrics(lambda: [])
    metrics.error("NotFound", model="nope")
    labels = {"model_name": "nope", "target_model_name": "", "error_code": "NotFound"}
    assert value(metrics, "inference_objective_request_error_total", **labels) == 1.0


def test_scheduler_attempts_name_the_primary_endpoint() -> None:
    metrics = GatewayMetrics(lambda: [])
    metrics.scheduled("m", "10.0.0.1:8000")
    metrics.scheduled("m", None)
    ok = {"status": "success", "target_model_name": "m", "namespace": "", "port": "8000"}
    assert value(metrics, "llm_d_epp_scheduler_attempts_total", endpoint_name="10.0.0.1:8000", **ok)
    assert value(
        metrics, "inference_extension_scheduler_attempts_total", pod_name="10.0.0.1:8000", **ok
    )
    failed = {"status": "failure", "target_model_name": "m", "namespace": "", "port": ""}
    assert value(metrics, "llm_d_epp_scheduler_attempts_total", endpoint_name="", **failed) == 1


def test_model_rewrites_are_counted_under_both_names() -> None:
    metrics = GatewayMetrics(lambda: [])
    metrics.rewritten("canary", "chat", "chat-v2")
    labels = {"model_rewrite_name": "canary", "model_name": "chat", "target_model": "chat-v2"}
    assert value(metrics, "llm_d_epp_model_rewrite_decisions_total", **labels) == 1.0
    assert value(metrics, "inference_extension_model_rewrite_decisions_total", **labels) == 1.0


def test_plugin_timing_buckets_each_call_once() -> None:
    timing = PluginTiming("t")
    for ns in (50_000, 100_000, 100_001, 10**9):
        timing.add(ns)
    assert timing.calls == 4 and sum(timing.counts) == 4
    assert timing.counts[0] == 2  # <= 100 µs, the first bound, inclusive
    assert timing.counts[1] == 1
    assert timing.counts[-1] == 1  # past the last bound: +Inf


def test_plugin_durations_are_exported_as_a_histogram_under_both_names() -> None:
    profile = SchedulerProfile("default", [], [], MaxScorePicker())
    scheduler = Scheduler({"default": profile}, SingleProfileHandler(), {})
    timing = scheduler.stats.plugins[("Picker", "max-score-picker")]
    timing.add(150_000)
    registry = CollectorRegistry()
    registry.register(PluginDurationCollector(scheduler))
    families = list(with_aliases(registry.collect()))
    names = [f.name for f in families]
    assert names == [
        "llm_d_epp_plugin_duration_seconds",
        "inference_extension_plugin_duration_seconds",
    ]
    labels = {"extension_point": "Picker", "plugin_type": "max-score-picker"}
    labels["plugin_name"] = "max-score-picker"
    samples = {
        (s.name, s.labels.get("le")): s.value
        for s in families[1].samples
        if s.labels.items() >= labels.items()
    }
    le = repr(PLUGIN_BUCKETS_S[1])
    assert samples[("inference_extension_plugin_duration_seconds_bucket", le)] == 1.0
    assert samples[("inference_extension_plugin_duration_seconds_bucket", "0.0001")] == 0.0
    assert samples[("inference_extension_plugin_duration_seconds_count", None)] == 1.0
    assert samples[("inference_extension_plugin_duration_seconds_sum", None)] == pytest.approx(
        1.5e-4
    )
