from __future__ import annotations

import pytest

from servegate.config import ConfigError, parse_config
from servegate.pool.discovery.settings import KubernetesDiscoverySettings, LabelSelector

SELECTOR_CASES = [
    pytest.param({"matchLabels": {"b": "2", "a": "1"}}, "a=1,b=2", id="labels-sorted"),
    pytest.param(
        {"matchExpressions": [{"key": "role", "operator": "In", "values": ["decode", "both"]}]},
        "role in (decode,both)",
        id="in",
    ),
    pytest.param(
        {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["canary"]}]},
        "tier notin (canary)",
        id="notin",
    ),
    pytest.param(
        {
            "matchLabels": {"app": "vllm"},
            "matchExpressions": [
                {"key": "gpu", "operator": "Exists"},
                {"key": "draining", "operator": "DoesNotExist"},
            ],
        },
        "app=vllm,gpu,!draining",
        id="exists",
    ),
    pytest.param({}, "", id="empty"),
]


@pytest.mark.parametrize(("selector", "query"), SELECTOR_CASES)
def test_selector_query(selector: dict[str, object], query: str) -> None:
    assert LabelSelector.model_validate(selector).to_query() == query


MATCH_CASES = [
    pytest.param({"app": "vllm", "gpu": "h100"}, True, id="all-hold"),
    pytest.param({"app": "sglang", "gpu": "h100"}, False, id="label-differs"),
    pytest.param({"app": "vllm"}, False, id="exists-missing"),
    pytest.param({"app": "vllm", "gpu": "a", "draining": "1"}, False, id="doesnotexist-present"),
    pytest.param({"app": "vllm", "gpu": "a", "tier": "canary"}, False, id="notin-hit"),
    pytest.param({"app": "vllm", "gpu": "a", "tier": "prod"}, True, id="notin-miss"),
]


@pytest.mark.parametrize(("labels", "expected"), MATCH_CASES)
def test_selector_matches(labels: dict[str, str], expected: bool) -> None:
    selector = LabelSelector.model_validate(
        {
            "matchLabels": {"app": "vllm"},
            "matchExpressions": [
                {"key": "gpu", "operator": "Exists"},
                {"key": "draining", "operator": "DoesNotExist"},
                {"key": "tier", "operator": "NotIn", "values": ["canary"]},
            ],
        }
    )
    assert selector.matches(labels) is expected


def _config(discovery: str) -> str:
    return "pool:\n  discovery:\n" + "".join(f"    {line}\n" for line in discovery.splitlines())


ERROR_CASES = [
    pytest.param(
        "kind: kubernetes\nselector: {matchLabels: {a: b}}", "needs `selector`", id="no-ports"
    ),
    pytest.param("kind: kubernetes\ntarget_ports: [8000]", "needs `selector`", id="no-selector"),
    pytest.param(
        "kind: kubernetes\ninference_pool: p\ntarget_ports: [8000]",
        "either inference_pool",
        id="pool-and-ports",
    ),
    pytest.param("kind: kubernetes\ninference_pool: p\nnamespce: x", "unknown field", id="typo"),
    pytest.param(
        "kind: kubernetes\nselector: {}\ntarget_ports: [8000, 8000]",
        "lists a port twice",
        id="duplicate-port",
    ),
    pytest.param(
        "kind: kubernetes\nselector: {matchExpressions: [{key: a, operator: In}]}\n"
        "target_ports: [1]",
        "needs at least one value",
        id="in-without-values",
    ),
    pytest.param("kind: consul", "discovery", id="unknown-kind"),
    pytest.param(
        "kind: kubernetes\ninference_pool: p\ninference_pool_api: v1", "group/version", id="api"
    ),
    pytest.param(
        "kind: kubernetes\ninference_pool: p\nextension_api: v1alpha2",
        "extension_api must look like group/version",
        id="extension-api",
    ),
]


@pytest.mark.parametrize(("discovery", "message"), ERROR_CASES)
def test_config_errors_name_the_problem(discovery: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(_config(discovery), environ={})


def test_defaults_to_static() -> None:
    assert parse_config("", environ={}).pool.discovery.kind == "static"


def test_kubernetes_section_loads() -> None:
    cfg = parse_config(
        _config(
            "kind: kubernetes\nnamespace: llm\nselector: {matchLabels: {app: vllm}}\n"
            "target_ports: [8000, 8001]\nkv_events_port: 5557"
        ),
        environ={},
    )
    discovery = cfg.pool.discovery
    assert isinstance(discovery, KubernetesDiscoverySettings)
    assert discovery.target_ports == (8000, 8001)
    assert discovery.selector is not None
    assert discovery.selector.to_query() == "app=vllm"
    assert discovery.kv_events_port == 5557
    assert discovery.watch_objectives and discovery.watch_model_rewrites
    assert discovery.extension_api == "inference.networking.x-k8s.io/v1alpha2"
