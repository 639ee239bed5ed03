"""The built-in registry, the plugin context and strict parameter decoding."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import pytest
from pydantic import Field

from servegate.scheduling.disagg import DisaggHeadersHandler, PDDecider
from servegate.scheduling.factory import (
    Parameters,
    PluginContext,
    PluginParameterError,
    decode_parameters,
)
from servegate.scheduling.framework import Filter, Picker, Plugin, ProfileHandler, Scorer
from servegate.scheduling.latency.plugins import LatencySloAdmitter
from servegate.scheduling.registry import builtin_registry


@runtime_checkable
class Declared(Protocol):
    """A plugin referenced from a section or a consumer, never from a profile."""

    kind: str


LLMD_ROUTER_KINDS = {
    "approx-prefix-cache-producer": "producer",
    "precise-prefix-cache-producer": "producer",
    "inflight-load-producer": "producer",
    "session-id-producer": "producer",
    "tokenizer": "producer",
    "token-producer": "producer",
    "p2p-source-producer": "producer",
    "mm-embeddings-cache-producer": "producer",
    "openai-parser": "parser",
    "anthropic-parser": "parser",
    "vllmhttp-parser": "parser",
    "sglanghttp-parser": "parser",
    "passthrough-parser": "parser",
    "vllmgrpc-parser": "parser",
    "vertexai-parser": "parser",
    "metrics-data-source": "data-source",
    "models-data-source": "data-source",
    "endpoint-notification-source": "data-source",
    "k8s-notification-source": "data-source",
    "dcgm-data-source": "data-source",
    "core-metrics-extractor": "data-extractor",
    "models-data-extractor": "data-extractor",
    "dcgm-extractor": "data-extractor",
    "topology-extractor": "data-extractor",
    "file-discovery": "discovery",
    "round-robin-fairness-policy": "fairness-policy",
    "global-strict-fairness-policy": "fairness-policy",
    "program-aware-fairness": "fairness-policy",
    "fcfs-ordering-policy": "ordering-policy",
    "edf-ordering-policy": "ordering-policy",
    "slo-deadline-ordering-policy": "ordering-policy",
    "static-usage-limit-policy": "usage-limit-policy",
    "soft-reflective-ceiling-policy": "usage-limit-policy",
    "priority-holdback-policy": "usage-limit-policy",
    "sheddable-eviction-filter": "eviction-policy",
    "priority-then-time-eviction-order-policy": "eviction-policy",
    "probabilistic-admitter": "admitter",
    "agent-identity": "request-control",
    "request-attribute-reporter": "request-control",
    "disaggregatedset-rollout-screener": "request-control",
    "multicluster-metrics-data-source": "data-source",
    "multicluster-metrics-extractor": "data-extractor",
    "multicluster-file-discovery": "discovery",
}
"""The non-scheduling kinds of llm-d's current router (issue 17) and what each is."""
REQUIRED: dict[str, dict[str, Any]] = {
    "session-id-producer": {"headerName": "x-session-id"},
    "file-discovery": {"path": "f"},
    "multicluster-file-discovery": {"path": "f"},
    "by-label": {"label": "role", "validValues": ["decode"]},
    "utilization-filter": {"conditions": [{"metric": "waiting-queue", "maxValue": 0}]},
    "header-label-affinity-scorer": {"headerName": "x-zone", "labelKey": "zone"},
    "endpoint-attribute-filter": {
        "attribute": "GPUUtilization",
        "algorithm": {"type": "threshold", "threshold": {"operator": "LessThan", "value": 1}},
    },
    "endpoint-attribute-scorer": {"attributeKey": "GPUUtilization", "algorithm": {}},
}
"""Parameters without a default: the smallest valid set."""

BUILTIN_TYPES: dict[str, type] = {
    "queue-scorer": Scorer,
    "kv-cache-utilization-scorer": Scorer,
    "kv-cache-scorer": Scorer,
    "running-requests-size-scorer": Scorer,
    "active-request-scorer": Scorer,
    "load-aware-scorer": Scorer,
    "token-load-scorer": Scorer,
    "lora-affinity-scorer": Scorer,
    "prefix-cache-scorer": Scorer,
    "precise-prefix-cache-scorer": Scorer,
    "no-hit-lru-scorer": Scorer,
    "session-affinity-scorer": Scorer,
    "prefix-cache-affinity-filter": Filter,
    "label-selector-filter": Filter,
    "by-label-selector": Filter,
    "decode-filter": Filter,
    "prefill-filter": Filter,
    "fresh-metrics-filter": Filter,
    "utilization-detector": Filter,
    "concurrency-detector": Filter,
    "max-score-picker": Picker,
    "random-picker": Picker,
    "weighted-random-picker": Picker,
    "round-robin-picker": Picker,
    "single-profile-handler": ProfileHandler,
    "disagg-profile-handler": ProfileHandler,
    "pd-profile-handler": ProfileHandler,
    "data-parallel-profile-handler": ProfileHandler,
    "prefix-based-pd-decider": PDDecider,
    "always-disagg-pd-decider": PDDecider,
    "disagg-headers-handler": DisaggHeadersHandler,
    "prefill-header-handler": DisaggHeadersHandler,
    **dict.fromkeys(LLMD_ROUTER_KINDS, Declared),
    "burst-prefix-cache-producer": Declared,
    "by-label": Filter,
    "encode-filter": Filter,
    "utilization-filter": Filter,
    "session-affinity-filter": Filter,
    "multicluster-session-affinity-filter": Filter,
    "endpoint-attribute-filter": Filter,
    "topology-affinity-filter": Filter,
    "context-length-aware": Scorer,
    "header-label-affinity-scorer": Scorer,
    "endpoint-attribute-scorer": Scorer,
    "topology-affinity-scorer": Scorer,
    "mm-embeddings-cache-scorer": Scorer,
    "multicluster-queue-scorer": Scorer,
    "multicluster-kv-cache-utilization-scorer": Scorer,
    "header-profile-handler": ProfileHandler,
    "always-disagg-multimodal-decider": PDDecider,
    # predicted-latency routing
    "predicted-latency-producer": Filter,
    "latency-scorer": Scorer,
    "slo-headroom-tier-filter": Filter,
    "predicted-latency-scorer": Scorer,
    "latency-slo-admitter": LatencySloAdmitter,
}
ALIASES = {
    "kv-cache-scorer": "kv-cache-utilization-scorer",
    "by-label-selector": "label-selector-filter",
    "prefill-header-handler": "disagg-headers-handler",
}


def test_registry_lists_exactly_the_builtin_types() -> None:
    assert set(builtin_registry()) == set(BUILTIN_TYPES)


def test_registry_is_a_fresh_dict_each_time() -> None:
    first = builtin_registry()
    first.pop("queue-scorer")
    assert "queue-scorer" in builtin_registry()


@pytest.mark.parametrize("plugin_type", sorted(BUILTIN_TYPES))
def test_every_builtin_builds_with_defaults_and_keeps_its_name(plugin_type: str) -> None:
    plugin = builtin_registry()[plugin_type](
        "my-name", REQUIRED.get(plugin_type, {}), PluginContext()
    )
    assert isinstance(plugin, Plugin)
    assert isinstance(plugin, BUILTIN_TYPES[plugin_type])
    assert plugin.name == "my-name"
    assert plugin.type == ALIASES.get(plugin_type, plugin_type)
    if plugin_type in LLMD_ROUTER_KINDS:
        assert getattr(plugin, "kind", None) == LLMD_ROUTER_KINDS[plugin_type]
        assert not isinstance(plugin, Filter | Scorer | Picker | ProfileHandler)


@pytest.mark.parametrize("plugin_type", sorted(BUILTIN_TYPES))
def test_every_builtin_rejects_unknown_parameters(plugin_type: str) -> None:
    with pytest.raises(PluginParameterError) as info:
        builtin_registry()[plugin_type](
            "p", {**REQUIRED.get(plugin_type, {}), "bogusKey": 1}, PluginContext()
        )
    assert "unknown parameter 'bogusKey'" in str(info.value)
    assert info.value.name == "p"


class Sample(Parameters):
    block_size: int = Field(64, alias="blockSizeTokens", gt=0)
    ratio: float = 0.5


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(None, (64, 0.5), id="none-is-defaults"),
        pytest.param({}, (64, 0.5), id="empty-is-defaults"),
        pytest.param({"blockSizeTokens": 16, "ratio": 1}, (16, 1.0), id="int-for-float-ok"),
    ],
)
def test_decode_parameters(raw: dict[str, Any] | None, expected: tuple[int, float]) -> None:
    params = decode_parameters(Sample, "sample", "sample", raw)
    assert (params.block_size, params.ratio) == expected


@pytest.mark.parametrize(
    ("raw", "fragments"),
    [
        pytest.param(
            {"block_size": 3},
            ["unknown parameter 'block_size'", "accepted parameters: blockSizeTokens, ratio"],
            id="python-name-is-not-the-parameter-name",
        ),
        pytest.param({"blockSizeTokens": "64"}, ["'blockSizeTokens'", "got '64'"], id="str"),
        pytest.param({"blockSizeTokens": 0}, ["greater than 0"], id="range"),
        pytest.param({"ratio": "x", "extra": 1}, ["'ratio'", "'extra'"], id="every-problem"),
        pytest.param([1, 2], ["`parameters` must be a mapping, got list"], id="not-a-mapping"),
    ],
)
def test_decode_parameter_errors(raw: Any, fragments: list[str]) -> None:
    with pytest.raises(PluginParameterError) as info:
        decode_parameters(Sample, "sample", "mine", raw)
    message = str(info.value)
    assert message.startswith("plugin 'mine' (type 'sample'): ")
    for fragment in fragments:
        assert fragment in message


def test_parameter_error_label_is_just_the_type_when_unnamed() -> None:
    with pytest.raises(PluginParameterError, match=r"^sample: unknown parameter 'x'"):
        decode_parameters(Sample, "sample", "sample", {"x": 1})


def test_parameters_are_frozen() -> None:
    params = decode_parameters(Sample, "sample", "sample", {})
    with pytest.raises(ValueError, match="frozen"):
        params.ratio = 0.9


class Index:
    pass


def test_plugin_context_carries_shared_services() -> None:
    index = Index()
    ctx = PluginContext(staleness_s=3.0, services={"prefix-index": index})
    assert ctx.staleness_s == 3.0
    assert ctx.service("prefix-index", Index) is index
    with pytest.raises(LookupError, match=r"no shared service 'tokenizer'.*prefix-index"):
        ctx.service("tokenizer", Index)
    with pytest.raises(TypeError, match="is a Index, expected str"):
        ctx.service("prefix-index", str)


def test_plugin_context_defaults() -> None:
    ctx = PluginContext()
    assert ctx.staleness_s == 2.0
    assert dict(ctx.services) == {}
    with pytest.raises(LookupError, match=r"\(available: none\)"):
        ctx.service("x", object)
