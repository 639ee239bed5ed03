"""The standard comparison's policies: picker configs that load, availability by registry."""

from __future__ import annotations

import pytest

from servegate.bench.policies import (
    STANDARD_POLICIES,
    Policy,
    picker_config,
    policy_named,
    registered_types,
    split_available,
)
from servegate.scheduling.config import load_picker_config
from servegate.scheduling.factory import PluginContext


def test_picker_config_is_one_profile_with_weights_and_the_picker_last() -> None:
    doc = picker_config((("queue-scorer", 2.0), ("prefix-cache-scorer", 3.0)), "max-score-picker")
    assert doc["apiVersion"] == "llm-d.ai/v1alpha1"
    assert [p["type"] for p in doc["plugins"]] == [
        "queue-scorer",
        "prefix-cache-scorer",
        "max-score-picker",
    ]
    assert doc["schedulingProfiles"] == [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "queue-scorer", "weight": 2.0},
                {"pluginRef": "prefix-cache-scorer", "weight": 3.0},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ]


def test_standard_policies_are_the_four_of_the_comparison_in_order() -> None:
    assert [p.name for p in STANDARD_POLICIES] == [
        "round-robin",
        "load-only",
        "approx-prefix",
        "exact-prefix",
    ]
    assert [p.name for p in STANDARD_POLICIES if p.kv_events] == ["exact-prefix"]


@pytest.mark.parametrize("policy", STANDARD_POLICIES, ids=lambda p: p.name)
def test_every_available_standard_policy_loads_through_the_real_loader(policy: Policy) -> None:
    if policy.missing(registered_types()):
        pytest.skip(f"{policy.name} needs plugins not registered yet")
    scheduler = load_picker_config(policy.picker_config, PluginContext())
    assert scheduler is not None


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param("round-robin", "round-robin-picker", id="picker-only"),
        pytest.param(
            "load-only",
            "queue-scorer ×2 + kv-cache-utilization-scorer ×2 + active-request-scorer ×2"
            " → max-score-picker",
            id="scorers-then-picker",
        ),
    ],
)
def test_description_lists_plugins_with_weights(name: str, expected: str) -> None:
    assert policy_named(name).description == expected


def test_split_available_names_the_missing_plugin_types() -> None:
    registered = {"round-robin-picker", "queue-scorer", "max-score-picker"}
    wanted = [
        Policy("rr", (), picker="round-robin-picker"),
        Policy("queue", (("queue-scorer", 1.0),)),
        Policy("future", (("queue-scorer", 1.0), ("new-scorer", 1.0), ("newer-scorer", 1.0))),
    ]
    runnable, unavailable = split_available(wanted, registered)
    assert [p.name for p in runnable] == ["rr", "queue"]
    assert unavailable == {
        "future": "plugin type `new-scorer`, `newer-scorer` is not registered in this build"
    }


def test_round_robin_is_available_in_this_build() -> None:
    runnable, _ = split_available(STANDARD_POLICIES, registered_types())
    assert {"round-robin", "load-only", "approx-prefix"} <= {p.name for p in runnable}


def test_policy_named_rejects_an_unknown_name_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fastest'; choose from round-robin"):
        policy_named("fastest")
