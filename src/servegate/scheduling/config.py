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

import difflib
import logging
import math
from collections.abc import Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servegate.scheduling.declared import StartupWarnings
from servegate.scheduling.factory import PluginContext, PluginFactory, location
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
from servegate.scheduling.registry import builtin_registry
from servegate.scheduling.scheduler import Scheduler

log = logging.getLogger(__name__)
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader when PyYAML has it (the same documents, several times faster)."""

API_VERSIONS = ("llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1")
OLDER_API_VERSIONS = (
    "llm-d.ai/v1",
    "config.apix.gateway-api-inference-extension.sigs.k8s.io/v1alpha1",
    "config.x-k8s.io/v1alpha1",
)
"""apiVersions of the same document that llm-d's guides and the Gateway API Inference
Extension's docs have used; accepted with a startup warning."""
DEFAULT_PROFILE = "default"
PRECISE_SCORER_TYPES = ("precise-prefix-cache-scorer",)
"""A scorer llm-d lets a data source feed directly (`dataLayer` extractors)."""

DEFAULT_PICKER_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-affinity-filter
  parameters: {maxInFlightRequestsDelta: 3, prefixMatchInfoProducerName: prefix-cache-scorer}
- type: precise-prefix-cache-scorer
- type: prefix-cache-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: active-request-scorer
- type: lora-affinity-scorer
- type: no-hit-lru-scorer
  parameters: {prefixPluginName: prefix-cache-scorer}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-affinity-filter}
  - {pluginRef: precise-prefix-cache-scorer, weight: 1}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: active-request-scorer, weight: 2}
  - {pluginRef: lora-affinity-scorer, weight: 1}
  - {pluginRef: no-hit-lru-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""
"""The picker config used when none is given, chosen by measurement
(`bench/bench_chat_pressure.py` on simulated replicas, `bench/bench_real_peers.py` on
real vLLM; the candidates and their numbers are in docs/cache-routing.md).

Sticky until saturated, llm-d's shape with the scorers servegate measured best:

- `prefix-cache-affinity-filter` keeps only the replicas the approximate index says
  hold at least 80 % of the prompt, until the least loaded of them has 3 more
  requests in flight than the least loaded other replica; then those join too. The
  replicas it removes stay in the decision as last-resort fallbacks
  (`framework.KEEPS_FALLBACKS`), so a sticky replica that dies mid-request still has
  somewhere to retry.
- Among the survivors: prefix affinity (the approximate index 3, the precise one 1:
  KV events when a replica publishes them, nothing otherwise) against load (queue
  length and KV usage from the replicas' metrics, one scrape old, and this router's
  in-flight counts, exact: 2 each).
- `no-hit-lru-scorer` (1) places a prompt that matches nothing anywhere (a new
  prefix or conversation) on the replica least recently given one, instead of the
  random tie-break between idle replicas, which could pile several new prefixes onto
  one replica and overfill its cache. For prompts with a match it scores everyone
  0.5 (no preference). Weight 1: it breaks ties between equally loaded replicas and
  never outvotes the LoRA scorer for an adapter request.
- `lora-affinity-scorer` (1) only speaks for requests that name an adapter (it scores
  every replica 1.0 for the base model): a replica already running the adapter, then
  one with a free adapter slot.
"""

KNOWN_UNIMPLEMENTED: dict[str, str] = {
    "pending-tokens-scorer": "token-load-scorer scores the router's in-flight tokens",
    "precise-prefix-based-pd-decider": (
        "prefix-based-pd-decider reads precise-prefix-cache-scorer's tier-weighted match"
    ),
}
"""llm-d / Gateway API Inference Extension plugin types servegate does not implement yet."""

GATE_MEANINGS: dict[str, tuple[str, str]] = {
    "dataLayer": ("", ""),
    "prepareDataPlugins": ("", ""),
    "enableLegacyMetrics": (
        "the metric names servegate exports do not depend on this gate",
        "the metric names servegate exports do not depend on this gate",
    ),
    "haPopulateNonLeaderDatastore": (
        "",
        "servegate has no leader election: every replica of the gateway keeps its own "
        "endpoint state, as with this gate on",
    ),
}
"""Per feature gate other than flowControl: (warning when on, warning when off); empty =
servegate behaves as llm-d does with that value. `dataLayer` and `prepareDataPlugins`
switched on llm-d's pluggable data layer and producers, which servegate always runs."""


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


class SectionRef(_Strict):
    plugin_ref: str = Field(alias="pluginRef", min_length=1)


class DataLayerSource(_Strict):
    plugin_ref: str = Field(alias="pluginRef", min_length=1)
    extractors: list[SectionRef] = Field(default_factory=list)


class DataLayerSection(_Strict):
    """llm-d's `dataLayer` (formerly `data`): sources, their extractors, discovery."""

    inject_defaults: bool | None = Field(None, alias="injectDefaults")
    sources: list[DataLayerSource] = Field(default_factory=list)
    discovery: SectionRef | None = None
    peer_discovery: SectionRef | None = Field(None, alias="peerDiscovery")
    cross_replica_syncer_plugin_ref: str = Field("", alias="crossReplicaSyncerPluginRef")
    cross_replica_sync_interval: str | None = Field(None, alias="crossReplicaSyncInterval")


class RequestHandlerSection(_Strict):
    parsers: list[SectionRef] = Field(default_factory=list)


class EndpointPickerConfig(_Strict):
    api_version: Literal[
        "llm-d.ai/v1alpha1",
        "inference.networking.x-k8s.io/v1alpha1",
        "llm-d.ai/v1",
        "config.apix.gateway-api-inference-extension.sigs.k8s.io/v1alpha1",
        "config.x-k8s.io/v1alpha1",
    ] = Field(alias="apiVersion")
    kind: Literal["EndpointPickerConfig"]
    plugins: list[PluginSpec] = Field(default_factory=list)
    scheduling_profiles: list[SchedulingProfileSpec] = Field(
        default_factory=list, alias="schedulingProfiles"
    )
    feature_gates: list[str] = Field(default_factory=list, alias="featureGates")
    flow_control: dict[str, Any] | None = Field(None, alias="flowControl")
    """llm-d's flow-control section; translated by `scheduling.flowcontrol.settings`."""
    saturation_detector: dict[str, Any] | None = Field(None, alias="saturationDetector")
    data_layer: DataLayerSection | None = Field(None, alias="dataLayer")
    data: DataLayerSection | None = None
    """The older name of `dataLayer`."""
    request_handler: RequestHandlerSection | None = Field(None, alias="requestHandler")
    parser: SectionRef | None = None
    """Deprecated in llm-d: one parser; `requestHandler.parsers` wins when both are set."""


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
                + ", ".join((*API_VERSIONS, *OLDER_API_VERSIONS))
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
            loaded = yaml.load(doc, Loader=_YAML_LOADER)
        except yaml.YAMLError as exc:
            raise PickerConfigError(f"picker config is not valid YAML: {exc}") from exc
    else:
        loaded = doc
    if not isinstance(loaded, Mapping):
        raise PickerConfigError(
            "picker config must be a mapping with apiVersion, kind, plugins and "
            f"schedulingProfiles; got {type(loaded).__name__}"
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
        close = difflib.get_close_matches(spec.type, list(registry), n=3)
        hint = (
            f"did you mean {' or '.join(repr(c) for c in close)}?"
            if close
            else f"docs/plugins.md lists the {len(registry)} known types"
        )
        raise PickerConfigError(f"plugins[{index}]: unknown plugin type {spec.type!r}; {hint}")
    try:
        plugin = factory(name, spec.parameters or {}, ctx)
    except ValueError as exc:
        raise PickerConfigError(f"plugins[{index}]: {exc}") from exc
    return plugin


def _is_profile_member(plugin: Plugin) -> bool:
    if getattr(plugin, "kind", None) is not None:  # parsers, producers, data layer, policies
        return False
    return isinstance(plugin, (Filter, Scorer, Picker))


def _default_picker(plugins: Mapping[str, Plugin]) -> Picker:
    name = MaxScorePicker.type
    while name in plugins:
        name = f"default-{name}"
    return MaxScorePicker(name)


def _build_profile(
    spec: SchedulingProfileSpec,
    index: int,
    plugins: Mapping[str, Plugin],
    fallback: Picker,
    notes: list[str],
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
        kind = getattr(plugin, "kind", None)
        if kind is not None:
            if ref.weight is not None:
                raise PickerConfigError(f"{at} is a {kind}; a weight applies to scorers only")
            notes.append(
                f"{at} is a {kind}, not a filter, scorer or picker: as in llm-d, listing it "
                "in a profile has no effect (it runs for every request); remove the reference"
            )
            continue
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


def _referenced(
    plugins: Mapping[str, Plugin], ref: str, where: str, kinds: tuple[str, ...], what: str
) -> Plugin:
    plugin = plugins.get(ref)
    if plugin is None:
        declared = ", ".join(plugins) or "none"
        raise PickerConfigError(
            f"{where}: pluginRef {ref!r} names no declared plugin (declared: {declared}); "
            f"declare {what} under `plugins` or fix the reference"
        )
    if getattr(plugin, "kind", None) not in kinds and not (
        "scorer" in kinds and plugin.type in PRECISE_SCORER_TYPES
    ):
        raise PickerConfigError(f"{where}: pluginRef {ref!r} is a {plugin.type!r}, not {what}")
    return plugin


def _check_sections(config: EndpointPickerConfig, plugins: Mapping[str, Plugin]) -> list[str]:
    """Resolve the references of `requestHandler`/`parser` and `dataLayer`/`data`;
    return what they mean for servegate as warnings (empty when nothing differs)."""
    from servegate.scheduling.datasources import DISCOVERY_KIND, EXTRACTOR_KIND, SOURCE_KIND
    from servegate.scheduling.parsers import PARSER_KIND
    from servegate.scheduling.prefix.lookup import PRODUCER_KIND

    warnings: list[str] = []
    parsers = config.request_handler.parsers if config.request_handler else []
    where = "requestHandler.parsers"
    if not parsers and config.parser is not None:
        parsers, where = [config.parser], "parser"
    for i, ref in enumerate(parsers):
        _referenced(plugins, ref.plugin_ref, f"{where}[{i}]", (PARSER_KIND,), "a parser plugin")
    if parsers and not any(plugins[r.plugin_ref].type == "openai-parser" for r in parsers):
        warnings.append(
            f"{where}: no openai-parser is listed, but servegate's gateway serves and parses "
            "its OpenAI routes regardless of the parser list"
        )
    if config.data_layer is not None and config.data is not None:
        raise PickerConfigError("dataLayer and data are the same section; keep dataLayer")
    layer = config.data_layer or config.data
    name = "dataLayer" if config.data_layer is not None else "data"
    if layer is None:
        return warnings
    for i, source in enumerate(layer.sources):
        at = f"{name}.sources[{i}]"
        _referenced(plugins, source.plugin_ref, at, (SOURCE_KIND,), "a data source")
        for j, extractor in enumerate(source.extractors):
            _referenced(
                plugins,
                extractor.plugin_ref,
                f"{at}.extractors[{j}]",
                (EXTRACTOR_KIND, PRODUCER_KIND, "scorer"),
                "an extractor (or a producer that reads this source)",
            )
    discoveries = {"discovery": layer.discovery, "peerDiscovery": layer.peer_discovery}
    for field_name, found in discoveries.items():
        if found is not None:
            _referenced(
                plugins, found.plugin_ref, f"{name}.{field_name}", (DISCOVERY_KIND,), "a discovery"
            )
    if layer.inject_defaults is False and not layer.sources:
        warnings.append(
            f"{name}.injectDefaults: false with no sources turns llm-d's metrics collection "
            "off; servegate's pool scrapes its endpoints' metrics regardless"
        )
    if layer.cross_replica_syncer_plugin_ref or layer.cross_replica_sync_interval:
        warnings.append(
            f"{name}.crossReplicaSyncerPluginRef: servegate shares state between gateway "
            "replicas with its own `scaleout` settings, not a syncer plugin"
        )
    return warnings


def _flow_control_warnings(
    config: EndpointPickerConfig, plugins: Mapping[str, Plugin]
) -> list[str]:
    """Resolve `flowControl`'s policy references; warn where servegate's queue differs."""
    from servegate.scheduling.flowcontrol.policies import (
        FAIRNESS_KIND,
        ORDERING_KIND,
        USAGE_LIMIT_KIND,
    )
    from servegate.scheduling.flowcontrol.settings import (
        FlowControlSectionError,
        picker_flow_control,
    )

    if config.flow_control is None:
        return []
    try:
        section = picker_flow_control(config.flow_control)
    except FlowControlSectionError as exc:
        raise PickerConfigError(str(exc)) from exc
    warnings: list[str] = []
    bands = [("defaultPriorityBand", section.default_priority_band)]
    bands.append(("defaultNegativePriorityBand", section.default_negative_priority_band))
    bands.extend((f"priorityBands[{i}]", b) for i, b in enumerate(section.priority_bands))
    for where, band in bands:
        if band is None:
            continue
        at = f"flowControl.{where}"
        if band.fairness_policy_ref:
            _referenced(
                plugins,
                band.fairness_policy_ref,
                f"{at}.fairnessPolicyRef",
                (FAIRNESS_KIND,),
                "a fairness policy",
            )
        if band.ordering_policy_ref:
            _referenced(
                plugins,
                band.ordering_policy_ref,
                f"{at}.orderingPolicyRef",
                (ORDERING_KIND,),
                "an ordering policy",
            )
        if band.default_request_ttl is not None and where.startswith("default"):
            warnings.append(
                f"{at}.defaultRequestTTL: only listed priorityBands take their own TTL in "
                "servegate; this band uses flowControl.defaultRequestTTL"
            )
    if section.usage_limit_policy_plugin_ref:
        _referenced(
            plugins,
            section.usage_limit_policy_plugin_ref,
            "flowControl.usageLimitPolicyPluginRef",
            (USAGE_LIMIT_KIND,),
            "a usage-limit policy",
        )
    if section.no_endpoint_request_ttl is not None:
        warnings.append(
            "flowControl.noEndpointRequestTTL: servegate refuses a request at once when no "
            "endpoint takes requests (503) instead of queueing it for this long"
        )
    if section.enable_eviction:
        warnings.append(
            "flowControl.enableEviction: servegate does not evict dispatched requests to make "
            "room for higher priorities; queued ones leave only by TTL or client disconnect"
        )
    return warnings


def _gate_warnings(config: EndpointPickerConfig) -> list[str]:
    from servegate.scheduling.flowcontrol.settings import FlowControlSectionError, parse_gates

    try:
        gates = parse_gates(config.feature_gates)
    except FlowControlSectionError as exc:
        raise PickerConfigError(str(exc)) from exc
    out = []
    for gate, value in gates.items():
        on, off = GATE_MEANINGS.get(gate, ("", ""))
        reason = on if value else off
        if reason:
            out.append(f"featureGates: {gate}={str(value).lower()}: {reason}")
    return out


def _check_flow_control(
    config: EndpointPickerConfig, plugins: dict[str, Plugin], ctx: PluginContext
) -> None:
    """Fail at load time, not at serve time, when llm-d's flow-control sections cannot be used.

    As llm-d, a `pluginRef: utilization-detector` that names no declared plugin gets one
    with default parameters (added to `plugins`)."""
    from servegate.scheduling.flowcontrol import (
        FlowControlSectionError,
        FlowControlSettings,
        from_picker_sections,
        resolve_detector,
    )
    from servegate.scheduling.flowcontrol.saturation import UtilizationDetector

    try:
        _, plugin_ref = from_picker_sections(
            FlowControlSettings(),
            config.feature_gates,
            config.flow_control,
            config.saturation_detector,
        )
        if plugin_ref == UtilizationDetector.type and plugin_ref not in plugins:
            plugins[plugin_ref] = UtilizationDetector.from_config(plugin_ref, {}, ctx)
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
    notes: list[str] = []
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
            profile, used = _build_profile(profile_spec, i, plugins, fallback, notes)
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
    _check_flow_control(config, plugins, ctx)
    if isinstance(handler, ProfileSetCheck):
        try:
            handler.check_profiles(profiles)
        except ValueError as exc:
            raise PickerConfigError(
                f"profile handler {_label(handler.type, handler.name)}: {exc}"
            ) from exc
    warnings = notes
    if config.api_version in OLDER_API_VERSIONS:
        warnings.append(
            f"apiVersion {config.api_version!r} is an older spelling; read as {API_VERSIONS[0]}"
        )
    warnings.extend(_gate_warnings(config))
    warnings.extend(_check_sections(config, plugins))
    warnings.extend(_flow_control_warnings(config, plugins))
    for plugin in plugins.values():
        if isinstance(plugin, StartupWarnings):
            warnings.extend(plugin.startup_warnings())
    scheduler = Scheduler(profiles, handler, plugins)
    scheduler.warnings = tuple(warnings)
    for warning in warnings:
        log.warning("picker config: %s", warning)
    return scheduler
