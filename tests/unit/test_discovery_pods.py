from __future__ import annotations

import copy
from typing import Any

import pytest

from servegate.pool.discovery.pods import (
    Target,
    inference_pool_target,
    is_ready,
    pod_endpoints,
)
from servegate.pool.discovery.settings import KubernetesDiscoverySettings, LabelSelector
from servegate.pool.endpoint import Role

SELECTOR = LabelSelector(match_labels={"app": "vllm"})
TARGET = Target(SELECTOR, (8000,))
SETTINGS = KubernetesDiscoverySettings(kind="kubernetes", selector=SELECTOR, target_ports=(8000,))


def pod(
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    ip: str = "10.1.2.3",
    ready: str = "True",
    phase: str = "Running",
) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {
            "name": "vllm-0",
            "labels": {"app": "vllm", **(labels or {})},
            "annotations": annotations or {},
        },
        "status": {
            "phase": phase,
            "podIP": ip,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": ready},
            ],
        },
    }


def _without(path: tuple[str, ...]) -> dict[str, Any]:
    p = pod()
    cursor: Any = p
    for key in path[:-1]:
        cursor = cursor[key]
    del cursor[path[-1]]
    return p


READY_CASES = [
    pytest.param(pod(), True, id="ready"),
    pytest.param(pod(ready="False"), False, id="not-ready"),
    pytest.param(pod(phase="Pending"), False, id="pending"),
    pytest.param(_without(("status", "podIP")), False, id="no-ip"),
    pytest.param(_without(("status", "conditions")), False, id="no-conditions"),
    pytest.param(
        {**pod(), "metadata": {**pod()["metadata"], "deletionTimestamp": "2025-01-01T00:00:00Z"}},
        False,
        id="terminating",
    ),
    pytest.param({}, False, id="empty"),
    pytest.param({"metadata": "x", "status": ["y"]}, False, id="garbage"),
]


@pytest.mark.parametrize(("obj", "expected"), READY_CASES)
def test_is_ready(obj: dict[str, Any], expected: bool) -> None:
    assert is_ready(obj) is expected


def test_one_endpoint_per_target_port_is_a_data_parallel_rank() -> None:
    settings = SETTINGS.model_copy(update={"kv_events_port": 5557})
    eps = pod_endpoints(pod(), Target(SELECTOR, (8000, 8001, 8002)), settings, "p")
    assert [e.address for e in eps] == ["10.1.2.3:8000", "10.1.2.3:8001", "10.1.2.3:8002"]
    assert [e.url for e in eps] == [f"http://10.1.2.3:{p}" for p in (8000, 8001, 8002)]
    # rank r publishes on 5557 + r
    assert [e.kv_events for e in eps] == [f"tcp://10.1.2.3:{5557 + r}" for r in range(3)]
    assert {e.pool for e in eps} == {"p"}


LABEL_CASES = [
    pytest.param({}, ("vllm", Role.BOTH, None), id="defaults"),
    pytest.param(
        {"llm-d.ai/engine-type": "sglang", "llm-d.ai/role": "decode", "llm-d.ai/model": "qwen"},
        ("sglang", Role.DECODE, "qwen"),
        id="all-labels",
    ),
    pytest.param({"llm-d.ai/role": "prefill"}, ("vllm", Role.PREFILL, None), id="prefill"),
    pytest.param({"llm-d.ai/role": "both"}, ("vllm", Role.BOTH, None), id="unknown-role"),
    pytest.param(
        {"llm-d.ai/engine-type": "trtllm-serve"}, ("trtllm-serve", Role.BOTH, None), id="trtllm"
    ),
]


@pytest.mark.parametrize(("labels", "expected"), LABEL_CASES)
def test_engine_role_model_from_labels(
    labels: dict[str, str], expected: tuple[str, Role, str | None]
) -> None:
    (ep,) = pod_endpoints(pod(labels), TARGET, SETTINGS, "default")
    assert (ep.engine, ep.role, ep.model) == expected
    assert ep.labels["app"] == "vllm"


KV_CASES = [
    pytest.param({}, None, (None, None), id="none"),
    pytest.param({}, 5557, ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558"), id="setting-port"),
    pytest.param(
        {"servegate.io/kv-events": "6000"},
        5557,
        ("tcp://10.1.2.3:6000", "tcp://10.1.2.3:6001"),
        id="annotation-port-wins",
    ),
    pytest.param(
        {"servegate.io/kv-events": "tcp://*:7000"},
        None,
        ("tcp://10.1.2.3:7000", "tcp://10.1.2.3:7001"),
        id="annotation-bind-endpoint",
    ),
    pytest.param(
        {"servegate.io/kv-events": "tcp://indexer.llm:5557"},
        None,
        ("tcp://indexer.llm:5557", "tcp://indexer.llm:5558"),
        id="annotation-host",
    ),
    pytest.param(
        {"servegate.io/kv-events": "ipc:///run/kv.sock"},
        None,
        ("ipc:///run/kv.sock", None),
        id="ipc-rank0-only",
    ),
    pytest.param({"servegate.io/kv-events": "not a socket"}, None, (None, None), id="garbage"),
]


@pytest.mark.parametrize(("annotations", "port", "expected"), KV_CASES)
def test_kv_events_address(
    annotations: dict[str, str], port: int | None, expected: tuple[str | None, str | None]
) -> None:
    settings = SETTINGS.model_copy(update={"kv_events_port": port})
    eps = pod_endpoints(pod(annotations=annotations), Target(SELECTOR, (8000, 8001)), settings, "d")
    assert tuple(e.kv_events for e in eps) == expected


def test_replay_annotation() -> None:
    (ep,) = pod_endpoints(
        pod(annotations={"servegate.io/kv-events-replay": "5558"}), TARGET, SETTINGS, "d"
    )
    assert ep.kv_events_replay == "tcp://10.1.2.3:5558"


def test_ipv6_pod_ip_is_bracketed() -> None:
    (ep,) = pod_endpoints(pod(ip="fd00::5"), TARGET, SETTINGS, "d")
    assert ep.address == "[fd00::5]:8000"
    assert ep.url == "http://[fd00::5]:8000"


SKIP_CASES = [
    pytest.param(pod(ready="False"), id="not-ready"),
    pytest.param({**pod(), "metadata": {"name": "x", "labels": {"app": "sglang"}}}, id="other-app"),
    pytest.param({"metadata": {"labels": ["not", "a", "map"]}}, id="garbage"),
]


@pytest.mark.parametrize("obj", SKIP_CASES)
def test_no_endpoints_for_unready_unselected_or_malformed_pods(obj: dict[str, Any]) -> None:
    assert pod_endpoints(obj, TARGET, SETTINGS, "d") == ()


POOL_V1 = {
    "apiVersion": "inference.networking.k8s.io/v1",
    "kind": "InferencePool",
    "metadata": {"name": "qwen"},
    "spec": {
        "selector": {"matchLabels": {"app": "qwen"}},
        "targetPorts": [{"number": 8000}, {"number": 8001}],
        "endpointPickerRef": {"name": "servegate", "port": {"number": 9002}},
    },
}
POOL_V1ALPHA2 = {
    "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
    "kind": "InferencePool",
    "metadata": {"name": "qwen"},
    "spec": {"selector": {"app": "qwen"}, "targetPortNumber": 8000, "extensionRef": {"name": "x"}},
}


@pytest.mark.parametrize(
    ("obj", "ports"),
    [
        pytest.param(POOL_V1, (8000, 8001), id="v1"),
        pytest.param(POOL_V1ALPHA2, (8000,), id="v1alpha2"),
    ],
)
def test_inference_pool_target(obj: dict[str, Any], ports: tuple[int, ...]) -> None:
    target = inference_pool_target(obj)
    assert target.ports == ports
    assert target.selector.to_query() == "app=qwen"


def _broken(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(POOL_V1)
    cursor: Any = obj
    for key in path[:-1]:
        cursor = cursor[key]
    cursor[path[-1]] = value
    return obj


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        pytest.param(_broken(("spec", "selector"), None), "no spec.selector", id="no-selector"),
        pytest.param(
            _broken(("spec", "selector"), {"matchLabels": {}}), "selects nothing", id="empty"
        ),
        pytest.param(_broken(("spec", "targetPorts"), []), "targetPorts", id="no-ports"),
        pytest.param(
            _broken(("spec", "targetPorts"), [{"number": "x"}]), "targetPorts", id="bad-port"
        ),
        pytest.param({}, "no spec.selector", id="empty-object"),
    ],
)
def test_unusable_inference_pool(obj: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        inference_pool_target(obj)
