"""Filters: label selectors, P/D roles, metric freshness."""

from __future__ import annotations

import random
from typing import Any

import pytest

from servegate.pool.endpoint import ROLE_LABEL, Role
from servegate.scheduling.factory import PluginContext, PluginParameterError
from servegate.scheduling.filters import (
    DecodeFilter,
    FreshMetricsFilter,
    LabelSelectorFilter,
    PrefillFilter,
    role_of,
)
from servegate.scheduling.framework import CycleState
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.testing.endpoints import addresses, endpoint_state

REQUEST = LLMRequest("r1", RequestKind.CHAT, "m", "m", "m")


def cycle(now: float = 100.0) -> CycleState:
    return CycleState(now=now, rng=random.Random(0))


def selector(parameters: dict[str, Any]) -> LabelSelectorFilter:
    return LabelSelectorFilter.from_config("sel", parameters, PluginContext())


@pytest.mark.parametrize(
    ("parameters", "labels", "matches"),
    [
        pytest.param({}, {"a": "1"}, True, id="empty-selector-matches-all"),
        pytest.param({"matchLabels": {"app": "x"}}, {"app": "x", "o": "1"}, True, id="labels"),
        pytest.param({"matchLabels": {"app": "x"}}, {"app": "y"}, False, id="labels-other"),
        pytest.param({"matchLabels": {"app": "x"}}, {}, False, id="labels-missing"),
        pytest.param(
            {"matchExpressions": [{"key": "env", "operator": "In", "values": ["a", "b"]}]},
            {"env": "b"},
            True,
            id="in",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "env", "operator": "In", "values": ["a"]}]},
            {"env": "c"},
            False,
            id="in-other",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "env", "operator": "In", "values": ["a"]}]},
            {},
            False,
            id="in-missing",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "env", "operator": "NotIn", "values": ["a"]}]},
            {"env": "b"},
            True,
            id="notin",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "env", "operator": "NotIn", "values": ["a"]}]},
            {},
            True,
            id="notin-missing-matches",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "env", "operator": "NotIn", "values": ["a"]}]},
            {"env": "a"},
            False,
            id="notin-excluded",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]},
            {"gpu": ""},
            True,
            id="exists-empty-value",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, {}, False, id="exists"
        ),
        pytest.param(
            {"matchExpressions": [{"key": "canary", "operator": "DoesNotExist"}]},
            {},
            True,
            id="does-not-exist",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "canary", "operator": "DoesNotExist"}]},
            {"canary": "1"},
            False,
            id="does-not-exist-present",
        ),
        pytest.param(
            {
                "matchLabels": {"app": "x"},
                "matchExpressions": [{"key": "env", "operator": "In", "values": ["a"]}],
            },
            {"app": "x", "env": "b"},
            False,
            id="all-requirements-must-hold",
        ),
    ],
)
def test_label_selector(parameters: dict[str, Any], labels: dict[str, str], matches: bool) -> None:
    flt = selector(parameters)
    assert flt.matches(labels) is matches
    eps = [endpoint_state(labels=labels)]
    assert flt.filter(cycle(), REQUEST, eps) == (eps if matches else [])


def test_label_selector_keeps_order_and_handles_many_endpoints() -> None:
    # more endpoints than the memo holds: every verdict must still be right
    eps = [
        endpoint_state(address, labels={"shard": str(i % 3)})
        for i, address in enumerate(addresses(5000))
    ]
    flt = selector({"matchLabels": {"shard": "1"}})
    for _ in range(2):
        kept = flt.filter(cycle(), REQUEST, eps)
        assert kept == [s for i, s in enumerate(eps) if i % 3 == 1]


@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [
        pytest.param(
            {"matchExpressions": [{"key": "k", "operator": "In"}]},
            "operator In needs a non-empty `values` list",
            id="in-without-values",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "k", "operator": "Exists", "values": ["v"]}]},
            "operator Exists takes no `values`",
            id="exists-with-values",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "k", "operator": "Equals", "values": ["v"]}]},
            "matchExpressions[0].operator",
            id="unknown-operator",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "k", "operator": "In", "value": ["v"]}]},
            "unknown key 'matchExpressions[0].value'",
            id="nested-typo",
        ),
        pytest.param({"matchLabel": {"a": "b"}}, "unknown parameter 'matchLabel'", id="typo"),
        pytest.param({"matchLabels": {"a": 1}}, "matchLabels.a", id="non-string-label"),
    ],
)
def test_label_selector_parameter_errors(parameters: dict[str, Any], fragment: str) -> None:
    with pytest.raises(PluginParameterError) as info:
        selector(parameters)
    assert "plugin 'sel' (type 'label-selector-filter')" in str(info.value)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("labels", "role", "expected_role", "decode", "prefill"),
    [
        pytest.param({}, Role.BOTH, None, True, False, id="unlabelled"),
        pytest.param({ROLE_LABEL: "decode"}, Role.BOTH, "decode", True, False, id="decode"),
        pytest.param({ROLE_LABEL: "prefill"}, Role.BOTH, "prefill", False, True, id="prefill"),
        pytest.param(
            {ROLE_LABEL: "prefill-decode"}, Role.BOTH, "prefill-decode", True, True, id="both-new"
        ),
        pytest.param({ROLE_LABEL: "both"}, Role.BOTH, "both", True, True, id="both-legacy"),
        pytest.param(
            {ROLE_LABEL: "encode-prefill"}, Role.BOTH, "encode-prefill", False, True, id="ep"
        ),
        pytest.param({ROLE_LABEL: "encode"}, Role.BOTH, "encode", False, False, id="encode"),
        pytest.param({}, Role.PREFILL, "prefill", False, True, id="static-role-prefill"),
        pytest.param({}, Role.DECODE, "decode", True, False, id="static-role-decode"),
        pytest.param({ROLE_LABEL: "decode"}, Role.PREFILL, "decode", True, False, id="label-wins"),
    ],
)
def test_role_filters(
    labels: dict[str, str], role: Role, expected_role: str | None, decode: bool, prefill: bool
) -> None:
    state = endpoint_state(labels=labels, role=role)
    assert role_of(state.endpoint) == expected_role
    assert DecodeFilter().filter(cycle(), REQUEST, [state]) == ([state] if decode else [])
    assert PrefillFilter().filter(cycle(), REQUEST, [state]) == ([state] if prefill else [])


@pytest.mark.parametrize(
    ("scraped", "max_age", "kept"),
    [
        pytest.param([99.0, 97.0, 0.0], 2.0, [0], id="drops-stale-and-never-scraped"),
        pytest.param([98.0, 99.5], 2.0, [0, 1], id="exactly-at-limit-is-fresh"),  # 100-98 <= 2
        pytest.param([90.0, 0.0], 2.0, [0, 1], id="none-fresh-fails-open"),
        pytest.param([90.0, 99.0], 20.0, [0, 1], id="longer-max-age"),
    ],
)
def test_fresh_metrics_filter(scraped: list[float], max_age: float, kept: list[int]) -> None:
    eps = [
        endpoint_state(a, scraped_at=t)
        for a, t in zip(addresses(len(scraped)), scraped, strict=True)
    ]
    flt = FreshMetricsFilter.from_config("f", {"maxAgeSeconds": max_age}, PluginContext())
    assert flt.filter(cycle(100.0), REQUEST, eps) == [eps[i] for i in kept]


def test_fresh_metrics_filter_defaults_to_the_pool_staleness() -> None:
    assert FreshMetricsFilter.from_config("f", {}, PluginContext(staleness_s=7.5)).max_age == 7.5


def test_role_filters_take_no_parameters() -> None:
    with pytest.raises(PluginParameterError, match="unknown parameter 'role'"):
        DecodeFilter.from_config("decode-filter", {"role": "x"}, PluginContext())


def test_filters_do_not_mutate_their_input() -> None:
    eps = [endpoint_state(a, labels={ROLE_LABEL: "prefill"}) for a in addresses(3)]
    before = list(eps)
    assert DecodeFilter().filter(cycle(), REQUEST, eps) == []
    assert eps == before
