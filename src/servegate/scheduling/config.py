"""`EndpointPickerConfig`: llm-d's picker configuration, loaded into a `Scheduler`.

The document names plugins (`type`, optional `name` defaulting to the type,
optional `parameters`) and scheduling profiles that reference them by name with
an optional weight. Defaults follow llm-d: no profiles → one `default` profile
with every filter and scorer in declaration order plus the picker; a profile
without a picker gets `max-score-picker`; no profile handler →
`single-profile-handler`. Every mistake is a `PickerConfigError` whose message
names the plugin or profile, the field, and how to fix it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servegate.scheduling.framework import (
    Filter,
    Picker,
    Plugin,
    ProfileHandler,
    SchedulerProfile,
    Scorer,
    WeightedScorer,
)
from servegate.scheduling.pickers import MaxScorePicker
from servegate.scheduling.profiles import ProfileSetCheck, SingleProfileHandler
from servegate.scheduling.registry import (
    PluginContext,
    PluginFactory,
    builtin_registry,
    location,
)
from servegate.scheduling.scheduler import Scheduler

API_VERSIONS = ("llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1")
DEFAULT_PROFILE = "default"

DEFAULT_PICKER_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
- type: prefix-cache-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: active-request-scorer
- type: lora-affinity-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: precise-prefix-cache-scorer, weight: 1}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: active-request-scorer, weight: 2}
  - {pluginRef: lora-affinity-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""
"""The picker config used when none is given, chosen by measurement
(`bench/bench_cache_routing.py`; the candidates and their numbers are in
docs/cache-routing.md).

Prefix affinity (weight 4 in all) against load (weight 6). The approximate
prefix scorer needs nothing configured: it remembers what was routed where
(token blocks when a tokenizer is configured, character blocks otherwise). The
precise one adds the replicas' own KV events when they are configured and
contributes nothing otherwise. Load is queue length and KV usage from the
replicas' metrics (global, one scrape old) and this router's in-flight counts
(exact, local), equally weighted, so a burst between two scrapes is spread.
Because the load scorers can outvote a full prefix match (6 > 4), a popular
prefix spreads to more replicas when its replica is the busiest on every load
signal, instead of pinning one replica at saturation; with the load roughly
even, the prefix match decides. No filter: every replica stays a fallback.
`lora-affinity-scorer` (weight 1) only speaks for requests that name an adapter
(it scores every replica 1.0 for the base model): a replica already running the
adapter, then one with a free adapter slot.
"""

KNOWN_UNIMPLEMENTED: dict[str, str] = {
    "pending-tokens-scorer": "token-load-scorer scores the router's in-flight tokens",
    "latency-scorer": "",
    "context-length-aware": "",
    "by-label": "label-selector-filter with a matchExpressions `In` requirement does the same",
    "approx-prefix-cache-producer": "",
    "precise-prefix-based-pd-decider": (
        "prefix-based-pd-decider reads precise-prefix-cache-scorer's tier-weighted match"
    ),
    "inflight-load-producer": (
        "servegate's pool counts in-flight requests and tokens itself; remove this plugin"
    ),
}
"""llm-d / Gateway API Inference Extension plugin types servegate does not implement yet."""

UNSUPPORTED_SECTIONS = ("data", "dataLayer")


class PickerConfigError(ValueError):
    """The picker configuration cannot be used; the message says where and how to fix it."""


@runtime_checkable
class PluginBinder(Protocol):
    """A plugin that reads another declared plugin (a filter reading a prefix scorer)."""

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        """Find the plugins it needs; ValueError says which is missing and how to fix it."""
        ...


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=False)


class PluginSpec(_Strict):
    type: str = Field(min_length=1)
    name: str | None = Field(None, min_length=1)
    parameters: dict[str, Any] | None = None


class PluginRef(_Strict):
    plugin_ref: str = Field(alias="pluginRef", min_length=1)
    weight: float | None = None


class SchedulingProfileSpec(_Strict):
    name: str = Field(min_length=1)
    plugins: list[PluginRef] = Field(default_factory=list)


class EndpointPickerConfig(_Strict):
    api_version: Literal["llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1"] = Field(
        alias="apiVersion"
    )
    kind: Literal["EndpointPickerConfig"]
    plugins: list[PluginSpec] = Field(default_factory=list)
    scheduling_profiles: list[SchedulingProfileSpec] = Field(
        default_factory=list, alias="schedulingProfiles"
    )
    feature_gates: list[str] = Field(default_factory=list, alias="featureGates")
    flow_control: dict[str, Any] | None = Field(None, alias="flowControl")
    """llm-d's flow-control section; translated by `scheduling.flowcontrol.settings`."""
    saturation_detector: dict[str, Any] | None = Field(None, alias="saturationDetector")


def _validation_message(exc: ValidationError) -> str:
    problems = []
    for err in exc.errors(include_url=False):
        where = location(err["loc"])
        kind = err["type"]
        if kind == "missing":
            problems.append(f"{where}: required field is missing")
        elif kind == "extra_forbidden":
            problems.append(f"{where}: unknown field; remove it or fix its spelling")
        elif where == "apiVersion":
            problems.append(
                f"apiVersion: {err.get('input')!r} is not supported; use one of "
                + ", ".join(API_VERSIONS)
            )
        elif where == "kind":
            problems.append(f"kind: {err.get('input')!r}; set `kind: EndpointPickerConfig`")
        else:
            message = err["msg"].removeprefix("Value error, ")
            problems.append(f"{where}: {message} (got {err.get('input')!r})")
    return "invalid EndpointPickerConfig: " + "; ".join(problems)


def parse_picker_config(doc: Mapping[str, Any] | str) -> EndpointPickerConfig:
    """Decode (YAML text or an already-parsed mapping) into the typed document."""
    if isinstance(doc, str):
        try:
            loaded = yaml.safe_load(doc)
        except yaml.YAMLError as exc:
            raise PickerConfigError(f"picker config is not valid YAML: {exc}") from exc
    else:
        loaded = doc
    if not isinstance(loaded, Mapping):
        raise PickerConfigError(
            "picker config must be a mapping with apiVersion, kind, plugins and "
            f"schedulingProfiles; got {type(loaded).__name__}"
        )
    for section in UNSUPPORTED_SECTIONS:
        if section in loaded:
            raise PickerConfigError(
                f"{section}: this EndpointPickerConfig section is not supported by "
                "servegate's picker config; remove it"
            )
    try:
        return EndpointPickerConfig.model_validate(dict(loaded))
    except ValidationError as exc:
        raise PickerConfigError(_validation_message(exc)) from exc


def _label(plugin_type: str, name: str) -> str:
    return f"{name!r} (type {plugin_type!r})" if name != plugin_type else repr(name)


def _instantiate(
    spec: PluginSpec, index: int, ctx: PluginContext, registry: Mapping[str, PluginFactory]
) -> Plugin:
    name = spec.name or spec.type
    factory = registry.get(spec.type)
    if factory is None:
        if spec.type in KNOWN_UNIMPLEMENTED:
            hint = KNOWN_UNIMPLEMENTED[spec.type]
            raise PickerConfigError(
                f"plugins[{index}] {_label(spec.type, name)}: {spec.type!r} is a known llm-d "
                "plugin that servegate does not implement yet"
                + (f" ({hint})" if hint else "")
                + "; remove it from plugins and from every profile that references it"
            )
        raise PickerConfigError(
            f"plugins[{index}]: unknown plugin type {spec.type!r}; known types: "
            + ", ".join(sorted(registry))
        )
    try:
        plugin = factory(name, spec.parameters or {}, ctx)
    except ValueError as exc:
        raise PickerConfigError(f"plugins[{index}]: {exc}") from exc
    return plugin


def _is_profile_member(plugin: Plugin) -> bool:
    return isinstance(plugin, (Filter, Scorer, Picker))


def _default_picker(plugins: Mapping[str, Plugin]) -> Picker:
    name = MaxScorePicker.type
    while name in plugins:
        name = f"default-{name}"
    return MaxScorePicker(name)


def _build_profile(
    spec: SchedulingProfileSpec, index: int, plugins: Mapping[str, Plugin], fallback: Picker
) -> tuple[SchedulerProfile, bool]:
    where = f"schedulingProfiles[{index}] {spec.name!r}"
    filters: list[Filter] = []
    scorers: list[WeightedScorer] = []
    picker: Picker | None = None
    seen: set[str] = set()
    for j, ref in enumerate(spec.plugins):
        at = f"{where}: plugins[{j}] pluginRef {ref.plugin_ref!r}"
        plugin = plugins.get(ref.plugin_ref)
        if plugin is None:
            declared = ", ".join(plugins) or "none"
            raise PickerConfigError(
                f"{at} names no plugin; declared plugin names: {declared}. Declare it under "
                "`plugins` (its name defaults to its type) or fix the reference"
            )
        if ref.plugin_ref in seen:
            raise PickerConfigError(f"{at} is listed twice in this profile; keep one entry")
        seen.add(ref.plugin_ref)
        if isinstance(plugin, ProfileHandler):
            raise PickerConfigError(
                f"{at} is a profile handler; handlers are declared under `plugins` only, "
                "not referenced from a profile"
            )
        if not _is_profile_member(plugin):
            raise PickerConfigError(
                f"{at} is not a filter, scorer or picker, so it cannot be part of a profile; "
                "declare it under `plugins` only"
            )
        if ref.weight is not None:
            if not isinstance(plugin, Scorer):
                raise PickerConfigError(f"{at}: weight applies to scorers only; remove the weight")
            if not math.isfinite(ref.weight) or ref.weight < 0:
                raise PickerConfigError(
                    f"{at}: weight must be a finite number >= 0, got {ref.weight!r}"
                )
        if isinstance(plugin, Filter):
            filters.append(plugin)
        if isinstance(plugin, Scorer):
            scorers.append(WeightedScorer(plugin, 1.0 if ref.weight is None else ref.weight))
        if isinstance(plugin, Picker):
            if picker is not None:
                raise PickerConfigError(
                    f"{at}: the profile already has picker {picker.name!r}; "
                    "a profile has at most one picker"
                )
            picker = plugin
    used_fallback = picker is None
    return SchedulerProfile(spec.name, filters, scorers, picker or fallback), used_fallback


def _check_flow_control(config: EndpointPickerConfig, plugins: Mapping[str, Plugin]) -> None:
    """Fail at load time, not at serve time, when llm-d's flow-control sections cannot be used."""
    from servegate.scheduling.flowcontrol import (
        FlowControlSectionError,
        FlowControlSettings,
        from_picker_sections,
        resolve_detector,
    )

    try:
        _, plugin_ref = from_picker_sections(
            FlowControlSettings(),
            config.feature_gates,
            config.flow_control,
            config.saturation_detector,
        )
        if plugin_ref:
            resolve_detector(plugin_ref, plugins)
    except FlowControlSectionError as exc:
        raise PickerConfigError(str(exc)) from exc


def load_picker_config(
    doc: Mapping[str, Any] | str,
    ctx: PluginContext,
    registry: Mapping[str, PluginFactory] | None = None,
) -> Scheduler:
    """Build a `Scheduler` from an `EndpointPickerConfig` (YAML text or a mapping)."""
    config = parse_picker_config(doc)
    factories = builtin_registry() if registry is None else registry

    plugins: dict[str, Plugin] = {}
    declared_at: dict[str, int] = {}
    for i, spec in enumerate(config.plugins):
        name = spec.name or spec.type
        if name in declared_at:
            raise PickerConfigError(
                f"plugins[{i}]: duplicate plugin name {name!r} (also "
                f"plugins[{declared_at[name]}]); give one of them a distinct `name`"
            )
        declared_at[name] = i
        plugins[name] = _instantiate(spec, i, ctx, factories)

    for i, spec in enumerate(config.plugins):
        plugin = plugins[spec.name or spec.type]
        if isinstance(plugin, PluginBinder):
            try:
                plugin.bind_plugins(plugins)
            except ValueError as exc:
                raise PickerConfigError(
                    f"plugins[{i}] {_label(spec.type, plugin.name)}: {exc}"
                ) from exc

    handlers = [p for p in plugins.values() if isinstance(p, ProfileHandler)]
    if len(handlers) > 1:
        raise PickerConfigError(
            "plugins: more than one profile handler ("
            + ", ".join(_label(h.type, h.name) for h in handlers)
            + "); keep exactly one"
        )

    fallback = _default_picker(plugins)
    profiles: dict[str, SchedulerProfile] = {}
    needs_fallback = False
    if not config.scheduling_profiles:
        members = [p for p in plugins.values() if _is_profile_member(p)]
        pickers = [p for p in members if isinstance(p, Picker)]
        if len(pickers) > 1:
            raise PickerConfigError(
                "plugins: several pickers ("
                + ", ".join(_label(p.type, p.name) for p in pickers)
                + ") but no schedulingProfiles; add profiles that say which picker each uses, "
                "or keep one picker"
            )
        needs_fallback = not pickers
        profiles[DEFAULT_PROFILE] = SchedulerProfile(
            DEFAULT_PROFILE,
            [p for p in members if isinstance(p, Filter)],
            [WeightedScorer(p, 1.0) for p in members if isinstance(p, Scorer)],
            pickers[0] if pickers else fallback,
        )
    else:
        for i, profile_spec in enumerate(config.scheduling_profiles):
            if profile_spec.name in profiles:
                raise PickerConfigError(
                    f"schedulingProfiles[{i}]: duplicate profile name {profile_spec.name!r}; "
                    "profile names must be unique"
                )
            profile, used = _build_profile(profile_spec, i, plugins, fallback)
            profiles[profile_spec.name] = profile
            needs_fallback = needs_fallback or used
    if needs_fallback:
        plugins[fallback.name] = fallback

    if handlers:
        handler = handlers[0]
    else:
        handler = SingleProfileHandler()
        if len(profiles) != 1:
            raise PickerConfigError(
                f"schedulingProfiles: {len(profiles)} profiles ({', '.join(profiles)}) but no "
                "profile handler that runs several; the default single-profile-handler runs "
                "exactly one. Keep one profile, or declare disagg-profile-handler for "
                "prefill/decode profiles"
            )
        while handler.name in plugins:
            handler = SingleProfileHandler(f"default-{handler.name}")
    _check_flow_control(config, plugins)
    if isinstance(handler, ProfileSetCheck):
        try:
            handler.check_profiles(profiles)
        except ValueError as exc:
            raise PickerConfigError(
                f"profile handler {_label(handler.type, handler.name)}: {exc}"
            ) from exc
    return Scheduler(profiles, handler, plugins)
