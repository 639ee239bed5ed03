from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from servegate.datalayer.metrics_parser import (
    LORA_MAX,
    LORA_RUNNING,
    LORA_WAITING,
    MetricsParser,
)
from servegate.engines import (
    SIGNALS,
    Aggregation,
    EngineConfigError,
    EngineRegistry,
    EngineSpec,
    MetricSpec,
    UnknownEngineError,
    builtin_engines,
    decode_engine_config,
    engine_for_labels,
)
from servegate.engines.registry import parse_selector
from servegate.pool.endpoint import ENGINE_LABEL, Endpoint

REAL_VLLM_PAGE = Path(__file__).resolve().parent.parent / "fixtures" / "real" / "vllm_metrics.txt"
"""`/metrics` of a real vLLM 0.32 server (scripts/record_fixtures.py)."""


@pytest.mark.parametrize(
    ("engine", "metrics_path", "metrics_port", "health_path", "openai_models"),
    [
        pytest.param("vllm", "/metrics", None, "/health", True, id="vllm"),
        pytest.param("sglang", "/metrics", None, "/health", True, id="sglang"),
        pytest.param("trtllm-serve", "/prometheus/metrics", None, "/health", True, id="trtllm"),
        pytest.param(
            "triton-tensorrt-llm", "/metrics", 8002, "/v2/health/ready", False, id="triton"
        ),
    ],
)
def test_builtin_engine_endpoints(
    engine: str,
    metrics_path: str,
    metrics_port: int | None,
    health_path: str,
    openai_models: bool,
) -> None:
    spec = builtin_engines()[engine]
    assert spec.name == engine
    assert (spec.metrics_path, spec.metrics_port) == (metrics_path, metrics_port)
    assert (spec.health_path, spec.health_port) == (health_path, None)
    assert spec.openai_models is openai_models


@pytest.mark.parametrize(
    ("engine", "signal", "first_name", "labels"),
    [
        pytest.param("vllm", "waiting", "vllm:num_requests_waiting", (), id="vllm-waiting"),
        pytest.param("vllm", "running", "vllm:num_requests_running", (), id="vllm-running"),
        pytest.param("vllm", "kv_usage", "vllm:kv_cache_usage_perc", (), id="vllm-kv"),
        pytest.param("sglang", "waiting", "sglang:num_queue_reqs", (), id="sglang-waiting"),
        pytest.param("sglang", "running", "sglang:num_running_reqs", (), id="sglang-running"),
        pytest.param("sglang", "kv_usage", "sglang:token_usage", (), id="sglang-kv"),
        pytest.param(
            "trtllm-serve", "waiting", "trtllm_num_requests_waiting", (), id="trtllm-waiting"
        ),
        pytest.param(
            "trtllm-serve", "running", "trtllm_num_requests_running", (), id="trtllm-running"
        ),
        pytest.param("trtllm-serve", "kv_usage", "trtllm_kv_cache_utilization", (), id="trtllm-kv"),
        pytest.param(
            "triton-tensorrt-llm",
            "waiting",
            "nv_trt_llm_request_metrics",
            (("request_type", "waiting"),),
            id="triton-waiting",
        ),
        pytest.param(
            "triton-tensorrt-llm",
            "running",
            "nv_trt_llm_request_metrics",
            (("request_type", "scheduled"),),
            id="triton-running",
        ),
        pytest.param(
            "triton-tensorrt-llm",
            "kv_usage",
            "nv_trt_llm_kv_cache_block_metrics",
            (("kv_cache_block_type", "fraction"),),
            id="triton-kv",
        ),
    ],
)
def test_builtin_metric_names_follow_the_protocol_table(
    engine: str, signal: str, first_name: str, labels: tuple[tuple[str, str], ...]
) -> None:
    source = builtin_engines()[engine].signal(signal)[0]
    assert source.name == first_name
    assert source.labels == labels


@pytest.mark.parametrize(
    ("engine", "signal", "names"),
    [
        pytest.param(
            "vllm",
            "kv_usage",
            ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            id="vllm-old-kv-name",
        ),
        pytest.param(
            "vllm",
            "prefix_cache_hits",
            ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
            id="vllm-old-prefix-name",
        ),
        pytest.param(
            "sglang",
            "waiting",
            ("sglang:num_queue_reqs", "sglang_num_queue_reqs"),
            id="sglang-underscore",
        ),
    ],
)
def test_alternative_spellings(engine: str, signal: str, names: tuple[str, ...]) -> None:
    assert builtin_engines()[engine].signal(signal)[0].names == names


def test_families_are_unique_and_cover_every_signal() -> None:
    spec = builtin_engines()["vllm"]
    families = spec.families()
    assert len(families) == len(set(families))
    for signal in SIGNALS:
        for source in spec.signal(signal):
            assert set(source.names) <= set(families)


def test_unknown_signal_is_an_error() -> None:
    with pytest.raises(KeyError, match="unknown signal 'queue'"):
        builtin_engines()["vllm"].signal("queue")


@pytest.mark.parametrize(
    ("engine", "endpoint", "metrics", "health", "models"),
    [
        pytest.param(
            "vllm",
            Endpoint("10.0.0.1:8000", "http://10.0.0.1:8000"),
            "http://10.0.0.1:8000/metrics",
            "http://10.0.0.1:8000/health",
            "http://10.0.0.1:8000/v1/models",
            id="vllm-api-port",
        ),
        pytest.param(
            "trtllm-serve",
            Endpoint("10.0.0.2:8000", "http://10.0.0.2:8000/"),
            "http://10.0.0.2:8000/prometheus/metrics",
            "http://10.0.0.2:8000/health",
            "http://10.0.0.2:8000/v1/models",
            id="trtllm-path",
        ),
        pytest.param(
            "triton-tensorrt-llm",
            Endpoint("10.0.0.3:8000", "http://10.0.0.3:8000"),
            "http://10.0.0.3:8002/metrics",
            "http://10.0.0.3:8000/v2/health/ready",
            "http://10.0.0.3:8000/v1/models",
            id="triton-metrics-port",
        ),
        pytest.param(
            "vllm",
            Endpoint(
                "10.0.0.4:8000",
                "http://10.0.0.4:8000",
                metrics_url="http://10.0.0.4:9100/custom",
                health_url="http://10.0.0.4:8000/ready",
            ),
            "http://10.0.0.4:9100/custom",
            "http://10.0.0.4:8000/ready",
            "http://10.0.0.4:8000/v1/models",
            id="endpoint-overrides",
        ),
    ],
)
def test_urls(engine: str, endpoint: Endpoint, metrics: str, health: str, models: str) -> None:
    spec = builtin_engines()[engine]
    assert spec.metrics_url(endpoint) == metrics
    assert spec.health_url(endpoint) == health
    assert spec.models_url(endpoint) == models


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        pytest.param({}, "vllm", id="no-label-is-vllm"),
        pytest.param({ENGINE_LABEL: "sglang"}, "sglang", id="sglang"),
        pytest.param({ENGINE_LABEL: ""}, "vllm", id="empty-label-is-vllm"),
        pytest.param({"app": "x", ENGINE_LABEL: "trtllm-serve"}, "trtllm-serve", id="trtllm"),
    ],
)
def test_engine_for_labels(labels: dict[str, str], expected: str) -> None:
    assert engine_for_labels(labels) == expected
    assert EngineRegistry().for_labels(labels).name == expected


def test_registry_lookup_error_lists_known_engines() -> None:
    registry = EngineRegistry()
    assert registry.names() == ["sglang", "triton-tensorrt-llm", "trtllm-serve", "vllm"]
    with pytest.raises(UnknownEngineError) as info:
        registry.get("tgi")
    message = str(info.value)
    assert "'tgi'" in message
    assert "sglang, triton-tensorrt-llm, trtllm-serve, vllm" in message
    assert ENGINE_LABEL in message


def test_for_endpoint_uses_the_endpoint_engine() -> None:
    registry = EngineRegistry()
    endpoint = Endpoint("h:1", "http://h:1", engine="sglang")
    assert registry.for_endpoint(endpoint).name == "sglang"


@pytest.mark.parametrize(
    ("text", "name", "labels"),
    [
        pytest.param("my_metric", "my_metric", (), id="bare"),
        pytest.param("ns:metric{}", "ns:metric", (), id="empty-braces"),
        pytest.param(
            "custom_queue_size{status=waiting}",
            "custom_queue_size",
            (("status", "waiting"),),
            id="unquoted",
        ),
        pytest.param(
            'm{a="x, y", b=z}',
            "m",
            (("a", "x, y"), ("b", "z")),
            id="quoted-comma",
        ),
        pytest.param(r'm{a="say \"hi\""}', "m", (("a", 'say "hi"'),), id="escaped-quote"),
        pytest.param(" m { a = b , } ", "m", (("a", "b"),), id="spaces-trailing-comma"),
    ],
)
def test_parse_selector(text: str, name: str, labels: tuple[tuple[str, str], ...]) -> None:
    assert parse_selector(text) == (name, labels)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("", "not a metric selector", id="empty"),
        pytest.param("1abc", "not a metric selector", id="bad-name"),
        pytest.param("m{a!=b}", "only equality", id="not-equal"),
        pytest.param("m{a=~b.*}", "only equality", id="regex"),
        pytest.param("m{a}", "cannot read the labels", id="no-value"),
        pytest.param('m{a="b" c="d"}', "separated by commas", id="missing-comma"),
    ],
)
def test_parse_selector_errors(text: str, message: str) -> None:
    with pytest.raises(EngineConfigError, match=message):
        parse_selector(text, "kvUsageSpec")


LLMD_EXAMPLE = """
name: my-custom-engine
queuedRequestsSpec: "custom_queue_size{status=waiting}"
runningRequestsSpec: "custom_running_size"
kvUsageSpec: "custom_cache_utilization"
loraSpec: custom_lora_info
cacheInfoSpec: custom_cache_info
cacheBlockSizeLabelName: page_size
"""


def test_custom_engine_from_llmd_fields() -> None:
    spec = decode_engine_config(LLMD_EXAMPLE)
    assert spec.name == "my-custom-engine"
    assert spec.waiting == (MetricSpec("custom_queue_size", labels=(("status", "waiting"),)),)
    assert spec.running == (MetricSpec("custom_running_size"),)
    assert spec.kv_usage == (MetricSpec("custom_cache_utilization", aggregation=Aggregation.MEAN),)
    assert spec.lora == (MetricSpec("custom_lora_info", aggregation=Aggregation.LATEST_BY_VALUE),)
    assert spec.block_size == (
        MetricSpec("custom_cache_info", label="page_size", aggregation=Aggregation.MAX),
    )
    assert spec.num_blocks == (MetricSpec("custom_cache_info", label="num_gpu_blocks"),)
    assert (spec.metrics_path, spec.metrics_port, spec.health_path) == ("/metrics", None, "/health")
    assert spec.prefix_cache_hits == ()


def test_custom_engine_parses_its_page() -> None:
    spec = decode_engine_config(
        {
            "name": "mine",
            "queuedRequestsSpec": "q{state=waiting}",
            "runningRequestsSpec": "q{state=running}",
            "kvUsageSpec": "kv",
            "cacheBlockSizeSpec": "tokens_per_block",
            "cacheNumBlocksSpec": "blocks",
            "metricsPath": "/stats",
            "metricsPort": 9400,
            "openaiModels": False,
        }
    )
    page = (
        'q{state="waiting",shard="0"} 3\n'
        'q{state="waiting",shard="1"} 4\n'
        'q{state="running",shard="0"} 2\n'
        "kv 0.5\n"
        "tokens_per_block 16\n"
        "blocks 1000\n"
    )
    metrics = MetricsParser(spec).parse(page, now=1.0).metrics
    # waiting = 3 + 4 over the two shards
    assert (metrics.waiting, metrics.running, metrics.kv_usage) == (7.0, 2.0, 0.5)
    assert (metrics.block_size, metrics.num_blocks) == (16, 1000)
    endpoint = Endpoint("h:8000", "http://h:8000")
    assert spec.metrics_url(endpoint) == "http://h:9400/stats"
    assert spec.openai_models is False


@pytest.mark.parametrize(
    ("document", "message"),
    [
        pytest.param({"name": "x", "queueSpec": "q"}, "queueSpec: unknown key", id="unknown-key"),
        pytest.param(
            {"name": "x", "loraGPUSlotsSpec": "s"}, "loraGPUSlotsSpec: unknown key", id="llmd-only"
        ),
        pytest.param({"queuedRequestsSpec": "q"}, "name: Field required", id="no-name"),
        pytest.param({"name": ""}, "name: String should have at least 1 character", id="empty"),
        pytest.param({"name": "x", "metricsPort": 70000}, "metricsPort", id="bad-port"),
        pytest.param({"name": "x", "metricsPath": "metrics"}, "metricsPath", id="relative-path"),
        pytest.param({"name": "x", "kvUsageSpec": "kv{a!=b}"}, "kvUsageSpec", id="bad-spec"),
        pytest.param("name: [unclosed", "not valid YAML", id="bad-yaml"),
        pytest.param("- name: x", "must be a mapping", id="list"),
    ],
)
def test_custom_engine_errors(document: dict[str, object] | str, message: str) -> None:
    with pytest.raises(EngineConfigError, match=message):
        decode_engine_config(document)


def test_add_engine_configs_all_or_nothing_and_replaces_builtins() -> None:
    registry = EngineRegistry()
    with pytest.raises(EngineConfigError, match="unique: a"):
        registry.add_engine_configs({"engineConfigs": [{"name": "a"}, {"name": "a"}]})
    assert "a" not in registry
    added = registry.add_engine_configs(
        """
        engineConfigs:
        - name: vllm
          queuedRequestsSpec: my_waiting
        - name: other
          kvUsageSpec: kv
        """
    )
    assert [spec.name for spec in added] == ["vllm", "other"]
    assert registry.get("vllm").waiting == (MetricSpec("my_waiting"),)
    assert registry.get("other").kv_usage[0].name == "kv"


@pytest.mark.parametrize(
    ("document", "message"),
    [
        pytest.param({"engineConfigs": [], "extra": 1}, "unknown key", id="extra-key"),
        pytest.param({"engineConfigs": {"name": "x"}}, "must be a list", id="not-a-list"),
    ],
)
def test_add_engine_configs_errors(document: dict[str, object], message: str) -> None:
    with pytest.raises(EngineConfigError, match=message):
        EngineRegistry().add_engine_configs(document)


def test_add_custom_and_registry_from_specs() -> None:
    registry = EngineRegistry([EngineSpec("only")])
    assert registry.names() == ["only"]
    spec = registry.add_custom({"name": "extra", "healthPath": "/ready", "healthPort": 8081})
    assert registry.get("extra") is spec
    endpoint = Endpoint("h:8000", "http://h:8000")
    assert spec.health_url(endpoint) == "http://h:8081/ready"


def real_vllm_labels() -> dict[str, set[str]]:
    """Sample name → label keys seen on the recorded real vLLM page."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(REAL_VLLM_PAGE.read_text()):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


@pytest.mark.parametrize("signal", SIGNALS)
def test_vllm_spec_reads_what_real_vllm_publishes(signal: str) -> None:
    """Each source's first name (and label) is on a real vLLM 0.32 page; the older
    spellings kept as alternatives are not (they serve older servers)."""
    published = real_vllm_labels()
    sources = builtin_engines()["vllm"].signal(signal)
    assert sources
    for source in sources:
        assert source.name in published
        assert {key for key, _ in source.labels} <= published[source.name]
        if source.label is not None:
            assert source.label in published[source.name]
        assert not set(source.alternatives) & set(published)


def test_real_vllm_lora_series_carry_the_labels_the_parser_reads() -> None:
    assert real_vllm_labels()["vllm:lora_requests_info"] == {LORA_MAX, LORA_RUNNING, LORA_WAITING}
