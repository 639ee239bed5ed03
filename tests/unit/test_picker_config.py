"""EndpointPickerConfig loading: defaults, every error message, and the docs' examples."""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from servegate.pool.endpoint import ROLE_LABEL
from servegate.scheduling.config import (
    DEFAULT_PICKER_CONFIG,
    KNOWN_UNIMPLEMENTED,
    PickerConfigError,
    load_picker_config,
    parse_picker_config,
)
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.filters import DecodeFilter, LabelSelectorFilter
from servegate.scheduling.framework import CycleState
from servegate.scheduling.pickers import MaxScorePicker, WeightedRandomPicker
from servegate.scheduling.profiles import SingleProfileHandler
from servegate.scheduling.registry import builtin_registry
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.scheduler import Scheduler
from servegate.scheduling.scorers import LoadAwareScorer, QueueScorer
from servegate.testing.endpoints import random_endpoint_states

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
CTX = PluginContext(staleness_s=2.0)
REQUEST = LLMRequest("r1", RequestKind.CHAT, "m", "m", "m")


def load(text: str) -> Scheduler:
    return load_picker_config(text, CTX)


def summary(scheduler: Scheduler) -> dict[str, Any]:
    return {
        name: (
            [f.name for f in p.filters],
            [(ws.scorer.name, ws.weight) for ws in p.scorers],
            p.picker.name,
        )
        for name, p in scheduler.profiles.items()
    }


def test_default_picker_config() -> None:
    scheduler = load(DEFAULT_PICKER_CONFIG)
    assert summary(scheduler) == {
        "default": (
            ["prefix-cache-affinity-filter"],
            [
                ("precise-prefix-cache-scorer", 1.0),
                ("prefix-cache-scorer", 3.0),
                ("queue-scorer", 2.0),
                ("kv-cache-utilization-scorer", 2.0),
                ("active-request-scorer", 2.0),
                ("lora-affinity-scorer", 1.0),
                ("no-hit-lru-scorer", 1.0),
            ],
            "max-score-picker",
        )
    }
    assert isinstance(scheduler.handler, SingleProfileHandler)
    decision = scheduler.schedule(
        REQUEST, random_endpoint_states(20), CycleState(100.0, random.Random(0))
    )
    assert len(decision.targets) == 20


@pytest.mark.parametrize(
    "api_version", ["llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1"]
)
def test_both_api_versions_load(api_version: str) -> None:
    doc = {"apiVersion": api_version, "kind": "EndpointPickerConfig", "plugins": []}
    assert summary(load_picker_config(doc, CTX)) == {"default": ([], [], "max-score-picker")}


def test_no_profiles_builds_default_profile_in_declaration_order() -> None:
    scheduler = load(
        HEAD
        + """plugins:
- type: queue-scorer
- type: decode-filter
- type: load-aware-scorer
  name: la
  parameters: {threshold: 8}
- type: label-selector-filter
  parameters: {matchLabels: {a: b}}
- type: weighted-random-picker
"""
    )
    assert summary(scheduler) == {
        "default": (
            ["decode-filter", "label-selector-filter"],
            [("queue-scorer", 1.0), ("la", 1.0)],
            "weighted-random-picker",
        )
    }
    profile = scheduler.profiles["default"]
    assert isinstance(profile.picker, WeightedRandomPicker)
    assert isinstance(profile.filters[0], DecodeFilter)
    assert isinstance(profile.filters[1], LabelSelectorFilter)
    la = profile.scorers[1].scorer
    assert isinstance(la, LoadAwareScorer)
    assert la.threshold == 8.0


def test_one_type_twice_under_two_names_with_weights() -> None:
    scheduler = load(
        HEAD
        + """plugins:
- {type: load-aware-scorer, name: short, parameters: {threshold: 4}}
- {type: load-aware-scorer, name: long, parameters: {threshold: 400}}
schedulingProfiles:
- name: main
  plugins:
  - {pluginRef: short, weight: 3}
  - {pluginRef: long, weight: 0.5}
"""
    )
    assert summary(scheduler) == {"main": ([], [("short", 3.0), ("long", 0.5)], "max-score-picker")}
    assert set(scheduler.plugins) == {"short", "long", "max-score-picker"}
    assert isinstance(scheduler.profiles["main"].picker, MaxScorePicker)


def test_profile_without_picker_gets_max_score_picker_even_when_that_name_is_taken() -> None:
    scheduler = load(
        HEAD
        + """plugins:
- {type: queue-scorer, name: max-score-picker}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: max-score-picker}]
"""
    )
    picker = scheduler.profiles["default"].picker
    assert isinstance(picker, MaxScorePicker)
    assert picker.name == "default-max-score-picker"


def test_declared_handler_is_used() -> None:
    scheduler = load(HEAD + "plugins:\n- {type: single-profile-handler, name: h}\n")
    assert isinstance(scheduler.handler, SingleProfileHandler)
    assert scheduler.handler.name == "h"


def test_unreferenced_plugins_still_load_like_llm_d() -> None:
    scheduler = load(
        HEAD
        + """plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
"""
    )
    assert "kv-cache-utilization-scorer" in scheduler.plugins
    assert summary(scheduler)["default"][1] == [("queue-scorer", 1.0)]


def test_mapping_input_and_custom_registry() -> None:
    registry = {"queue-scorer": QueueScorer.from_config}
    doc = yaml.safe_load(HEAD + "plugins:\n- type: queue-scorer\n")
    scheduler = load_picker_config(doc, CTX, registry=registry)
    assert summary(scheduler)["default"][1] == [("queue-scorer", 1.0)]
    with pytest.raises(
        PickerConfigError, match=r"'decode-filter'; docs/plugins.md lists the 1 known types$"
    ):
        load_picker_config(HEAD + "plugins:\n- type: decode-filter\n", CTX, registry=registry)


def test_parse_gives_the_typed_document() -> None:
    config = parse_picker_config(DEFAULT_PICKER_CONFIG)
    assert config.api_version == "llm-d.ai/v1alpha1"
    assert config.plugins[0].type == "prefix-cache-affinity-filter"
    assert config.plugins[1].type == "precise-prefix-cache-scorer"
    assert config.scheduling_profiles[0].plugins[3].weight == 2


PROFILE = """schedulingProfiles:
- name: default
  plugins:
"""

ERRORS = [
    pytest.param("plugins: [", ["picker config is not valid YAML"], id="bad-yaml"),
    pytest.param("- a\n- b\n", ["must be a mapping", "got list"], id="not-a-mapping"),
    pytest.param("", ["must be a mapping", "got NoneType"], id="empty"),
    pytest.param(
        "kind: EndpointPickerConfig\nplugins: []\n",
        ["apiVersion: required field is missing"],
        id="missing-api-version",
    ),
    pytest.param(
        "apiVersion: v1\nkind: EndpointPickerConfig\n",
        ["apiVersion: 'v1' is not supported", "llm-d.ai/v1alpha1"],
        id="wrong-api-version",
    ),
    pytest.param(
        "apiVersion: llm-d.ai/v1alpha1\nkind: PickerConfig\n",
        ["kind: 'PickerConfig'", "set `kind: EndpointPickerConfig`"],
        id="wrong-kind",
    ),
    pytest.param(HEAD + "plugin: []\n", ["plugin: unknown field"], id="unknown-top-level"),
    pytest.param(
        HEAD + "dataLayer: {sources: [{pluginRef: metrics}]}\n",
        ["dataLayer.sources[0]: pluginRef 'metrics' names no declared plugin"],
        id="data-layer-unknown-source",
    ),
    pytest.param(
        HEAD + "plugins:\n- {type: queue-scorer, name: 5}\n",
        ["plugins[0].name", "valid string"],
        id="name-not-string",
    ),
    pytest.param(
        HEAD + "plugins:\n- {type: queue-scorer, params: {}}\n",
        ["plugins[0].params: unknown field"],
        id="plugin-unknown-field",
    ),
    pytest.param(
        HEAD + "plugins:\n- type: queue-scorrer\n",
        ["plugins[0]: unknown plugin type 'queue-scorrer'", "did you mean 'queue-scorer'"],
        id="unknown-type",
    ),
    pytest.param(
        HEAD + "plugins:\n- type: pending-tokens-scorer\n",
        ["'pending-tokens-scorer' is a known llm-d plugin that servegate does not implement"],
        id="known-unimplemented-prefix",
    ),
    pytest.param(
        HEAD + "plugins:\n- type: prefix-cache-scorer\n  parameters: {blockSizeTokens: 0}\n",
        ["parameter 'blockSizeTokens'", "greater than or equal to 1"],
        id="prefix-block-size",
    ),
    pytest.param(
        HEAD + "plugins:\n- {type: pending-tokens-scorer, name: pts}\n",
        ["plugins[0] 'pts' (type 'pending-tokens-scorer')", "does not implement yet"],
        id="known-unimplemented-named",
    ),
    pytest.param(
        HEAD + "plugins:\n- type: precise-prefix-based-pd-decider\n",
        ["'precise-prefix-based-pd-decider' is a known llm-d plugin", "tier-weighted match"],
        id="known-unimplemented-decider",
    ),
    pytest.param(
        HEAD + "plugins:\n- type: queue-scorer\n- type: queue-scorer\n",
        ["plugins[1]: duplicate plugin name 'queue-scorer' (also plugins[0])", "distinct `name`"],
        id="duplicate-names",
    ),
    pytest.param(
        HEAD + "plugins:\n- {type: load-aware-scorer, parameters: {treshold: 4}}\n",
        ["plugins[0]: load-aware-scorer: unknown parameter 'treshold'", "accepted parameters"],
        id="parameter-unknown-key",
    ),
    pytest.param(
        HEAD + "plugins:\n- {type: load-aware-scorer, name: la, parameters: {threshold: x}}\n",
        ["plugin 'la' (type 'load-aware-scorer'): parameter 'threshold'", "valid integer"],
        id="parameter-wrong-type",
    ),
    pytest.param(
        HEAD + "plugins:\n- type: queue-scorer\n" + PROFILE + "  - {pluginRef: queue}\n",
        [
            "schedulingProfiles[0] 'default': plugins[0] pluginRef 'queue' names no plugin",
            "declared plugin names: queue-scorer",
        ],
        id="undefined-plugin-ref",
    ),
    pytest.param(
        HEAD + "plugins:\n- type: queue-scorer\n" + PROFILE + "  - {pluginRef: queue-scorer, "
        "weight: -1}\n",
        ["pluginRef 'queue-scorer': weight must be a finite number >= 0, got -1.0"],
        id="negative-weight",
    ),
    pytest.param(
        HEAD + "plugins:\n- type: queue-scorer\n" + PROFILE + "  - {pluginRef: queue-scorer, "
        "weight: .nan}\n",
        ["weight must be a finite number >= 0, got nan"],
        id="nan-weight",
    ),
    pytest.param(
        HEAD + "plugins:\n- type: queue-scorer\n" + PROFILE + "  - {pluginRef: queue-scorer, "
        "weight: '2'}\n",
        ["schedulingProfiles[0].plugins[0].weight", "valid number"],
        id="string-weight",
    ),
    pytest.param(
        HEAD + "plugins:\n- type: random-picker\n" + PROFILE + "  - {pluginRef: random-picker, "
        "weight: 2}\n",
        ["weight applies to scorers only"],
        id="weight-on-picker",
    ),
    pytest.param(
        HEAD
        + "plugins:\n- type: random-picker\n- type: max-score-picker\n"
        + PROFILE
        + "  - {pluginRef: random-picker}\n  - {pluginRef: max-score-picker}\n",
        ["already has picker 'random-picker'", "at most one picker"],
        id="two-pickers-in-profile",
    ),
    pytest.param(
        HEAD
        + "plugins:\n- type: single-profile-handler\n"
        + PROFILE
        + "  - {pluginRef: single-profile-handler}\n",
        ["is a profile handler; handlers are declared under `plugins` only"],
        id="handler-in-profile",
    ),
    pytest.param(
        HEAD
        + "plugins:\n- type: queue-scorer\n"
        + PROFILE
        + "  - {pluginRef: queue-scorer}\n  - {pluginRef: queue-scorer}\n",
        ["is listed twice in this profile"],
        id="same-plugin-twice",
    ),
    pytest.param(
        HEAD + "plugins:\n- type: queue-scorer\nschedulingProfiles:\n- {name: a}\n- {name: a}\n",
        ["schedulingProfiles[1]: duplicate profile name 'a'"],
        id="duplicate-profiles",
    ),
    pytest.param(
        HEAD + "plugins:\n- type: queue-scorer\nschedulingProfiles:\n- {name: a}\n- {name: b}\n",
        ["2 profiles (a, b) but no profile handler that runs several", "Keep one profile"],
        id="two-profiles-no-handler",
    ),
    pytest.param(
        HEAD + "plugins:\n- type: single-profile-handler\nschedulingProfiles:\n- {name: a}\n"
        "- {name: b}\n",
        ["profile handler 'single-profile-handler': single-profile-handler runs exactly one"],
        id="two-profiles-single-handler",
    ),
    pytest.param(
        HEAD + "plugins:\n- {type: single-profile-handler, name: h1}\n"
        "- {type: single-profile-handler, name: h2}\n",
        ["more than one profile handler ('h1' (type 'single-profile-handler'), 'h2'"],
        id="two-handlers",
    ),
    pytest.param(
        HEAD + "plugins:\n- type: random-picker\n- type: max-score-picker\n",
        ["several pickers", "but no schedulingProfiles"],
        id="two-pickers-no-profiles",
    ),
]


@pytest.mark.parametrize(("text", "fragments"), ERRORS)
def test_config_errors_say_where_and_how_to_fix(text: str, fragments: list[str]) -> None:
    with pytest.raises(PickerConfigError) as info:
        load(text)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_a_non_scheduling_plugin_cannot_sit_in_a_profile() -> None:
    class HookOnly:
        type = "hook-only"

        def __init__(self, name: str) -> None:
            self.name = name

        def pre_request(self, request: object, decision: object, now: float) -> None:
            return None

    registry = {**builtin_registry(), "hook-only": lambda name, params, ctx: HookOnly(name)}
    text = HEAD + "plugins:\n- type: hook-only\n" + PROFILE + "  - {pluginRef: hook-only}\n"
    with pytest.raises(PickerConfigError, match="is not a filter, scorer or picker"):
        load_picker_config(text, CTX, registry=registry)  # type: ignore[arg-type]
    scheduler = load_picker_config(HEAD + "plugins:\n- type: hook-only\n", CTX, registry)  # type: ignore[arg-type]
    assert "hook-only" in scheduler.plugins


def test_known_unimplemented_types_are_not_registered() -> None:
    assert not set(KNOWN_UNIMPLEMENTED) & set(builtin_registry())


def _docs_examples() -> list[str]:
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(encoding="utf-8"), flags=re.S)
    return [b for b in blocks if "kind: EndpointPickerConfig" in b]


def test_docs_have_an_example_per_builtin_plugin() -> None:
    examples = "\n".join(_docs_examples())
    for plugin_type in builtin_registry():
        if plugin_type in ("kv-cache-scorer", "by-label-selector"):
            continue  # aliases, documented with their canonical names
        assert f"type: {plugin_type}" in examples, plugin_type


@pytest.mark.parametrize(
    "example", _docs_examples(), ids=lambda text: text.split("type: ")[1].split()[0]
)
def test_docs_examples_load_through_the_real_loader(example: str) -> None:
    scheduler = load(example)
    roles = ["prefill", "decode", "prefill-decode"]
    eps = random_endpoint_states(9)
    for i, s in enumerate(eps):
        labels = {"accelerator": "h100", ROLE_LABEL: roles[i % 3]}
        s.endpoint = replace(s.endpoint, labels=labels)
    decision = scheduler.schedule(REQUEST, eps, CycleState(100.0, random.Random(0)))
    assert decision.endpoint in eps
