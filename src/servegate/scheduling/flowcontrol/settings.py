"""Flow-control settings: servegate's `flow_control:` section and llm-d's `flowControl:` section.

servegate's own section (snake_case, seconds and plain integers)::

    flow_control:
      enabled: true
      saturation_detector: {type: utilization-detector, parameters: {queueDepthThreshold: 5}}
      default_request_ttl_s: 60
      max_requests: 0          # whole queue; 0 = unbounded
      max_bytes: 0
      default_priority_band: {max_requests: 5000, max_bytes: 1000000000}
      priority_bands: [{priority: 10, max_requests: 1000}]
      objectives: [{name: critical, priority: 10}, {name: batch, priority: -1}]

An `EndpointPickerConfig` may carry llm-d's spelling instead (`featureGates:
[flowControl]`, `flowControl:` with quantities and Go durations,
`saturationDetector.pluginRef`); `from_picker_sections` translates it onto
these settings, so an llm-d file loads unchanged where servegate implements
the fields, and names the field it cannot honour otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servegate.scheduling.flowcontrol.queues import BandLimits
from servegate.scheduling.flowcontrol.units import parse_duration, parse_quantity

FLOW_CONTROL_GATE = "flowControl"
OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BandSettings(_Strict):
    max_requests: int = Field(5000, gt=0)
    max_bytes: int = Field(1_000_000_000, gt=0)

    def limits(self) -> BandLimits:
        return BandLimits(self.max_requests, self.max_bytes)


class PriorityBandSettings(BandSettings):
    priority: int
    request_ttl_s: float | None = Field(None, ge=0)
    """This band's longest wait in the queue; None = `default_request_ttl_s`."""


class DetectorSettings(_Strict):
    type: str = "utilization-detector"
    parameters: dict[str, Any] = Field(default_factory=dict)


class Objective(_Strict):
    """llm-d's InferenceObjective: a name clients send, and the priority it stands for."""

    name: str = Field(min_length=1)
    priority: int = 0


class FlowControlSettings(_Strict):
    enabled: bool = False
    """Queue requests while the pool is saturated (llm-d's `flowControl` feature gate).

    Off: requests pass, but negative priorities are still shed under saturation."""
    saturation_detector: DetectorSettings = DetectorSettings()
    default_request_ttl_s: float = Field(60.0, ge=0)
    """Longest wait in the queue; 0 = until the client leaves."""
    max_requests: int = Field(0, ge=0)
    max_bytes: int = Field(0, ge=0)
    default_priority_band: BandSettings = BandSettings()
    default_negative_priority_band: BandSettings | None = None
    priority_bands: tuple[PriorityBandSettings, ...] = ()
    objectives: tuple[Objective, ...] = ()

    def bands(self) -> dict[int, BandLimits]:
        return {b.priority: b.limits() for b in self.priority_bands}

    def band_ttls(self) -> dict[int, float]:
        """Priority → queue TTL for the bands that set their own."""
        return {
            b.priority: b.request_ttl_s for b in self.priority_bands if b.request_ttl_s is not None
        }

    def priorities(self) -> dict[str, int]:
        return {o.name: o.priority for o in self.objectives}


class FlowControlSectionError(ValueError):
    """llm-d's flow-control sections do not translate; the message says which field and why."""


class _Camel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False)


_C = TypeVar("_C", bound=_Camel)


class _PluginRef(_Camel):
    plugin_ref: str = Field("", alias="pluginRef")


class _TopLevelDetector(_PluginRef):
    """The deprecated top-level section; its threshold fields configure a utilization-detector."""

    queue_depth_threshold: int | None = Field(None, alias="queueDepthThreshold")
    kv_cache_util_threshold: float | None = Field(None, alias="kvCacheUtilThreshold")
    metrics_staleness_threshold: str | float | None = Field(None, alias="metricsStalenessThreshold")

    def legacy_parameters(self) -> dict[str, Any]:
        names = {
            "queueDepthThreshold": self.queue_depth_threshold,
            "kvCacheUtilThreshold": self.kv_cache_util_threshold,
            "metricsStalenessThreshold": self.metrics_staleness_threshold,
        }
        return {k: v for k, v in names.items() if v is not None}


class _PickerBand(_Camel):
    priority: int = 0
    max_bytes: str | int | None = Field(None, alias="maxBytes")
    max_requests: str | int | None = Field(None, alias="maxRequests")
    fairness_policy_ref: str = Field("", alias="fairnessPolicyRef")
    ordering_policy_ref: str = Field("", alias="orderingPolicyRef")
    default_request_ttl: str | float | None = Field(None, alias="defaultRequestTTL")
    """An older llm-d field: this band's queue TTL (see `band_ttls`)."""


class _PickerFlowControl(_Camel):
    max_bytes: str | int | None = Field(None, alias="maxBytes")
    max_requests: str | int | None = Field(None, alias="maxRequests")
    default_request_ttl: str | float | None = Field(None, alias="defaultRequestTTL")
    default_priority_band: _PickerBand | None = Field(None, alias="defaultPriorityBand")
    default_negative_priority_band: _PickerBand | None = Field(
        None, alias="defaultNegativePriorityBand"
    )
    priority_bands: list[_PickerBand] = Field(default_factory=list, alias="priorityBands")
    saturation_detector: _PluginRef | None = Field(None, alias="saturationDetector")
    no_endpoint_request_ttl: str | float | None = Field(None, alias="noEndpointRequestTTL")
    usage_limit_policy_plugin_ref: str = Field("", alias="usageLimitPolicyPluginRef")
    enable_eviction: bool = Field(False, alias="enableEviction")


def picker_flow_control(raw: Mapping[str, Any] | None) -> _PickerFlowControl:
    """llm-d's `flowControl` section, decoded (for the loader's reference checks)."""
    return _decode(_PickerFlowControl, raw, "flowControl")


def _decode(model: type[_C], raw: Mapping[str, Any] | None, section: str) -> _C:
    if raw is not None and not isinstance(raw, Mapping):
        raise FlowControlSectionError(f"{section}: must be a mapping, got {type(raw).__name__}")
    try:
        return model.model_validate(dict(raw or {}))
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            where = ".".join([section, *(str(p) for p in err["loc"])])
            if err["type"] == "extra_forbidden":
                problems.append(f"{where}: not supported by servegate; remove it")
            else:
                problems.append(f"{where}: {err['msg']}")
        raise FlowControlSectionError("; ".join(problems)) from exc


FEATURE_GATES: dict[str, str] = {
    FLOW_CONTROL_GATE: "",
    "dataLayer": "",
    "prepareDataPlugins": "",
    "enableLegacyMetrics": "",
    "haPopulateNonLeaderDatastore": "",
}
"""Every feature gate llm-d has registered, current or past; the loader says what each
means in servegate (`scheduling.config.gate_warnings`). Anything else is a typo."""


def parse_gates(gates: list[str] | None) -> dict[str, bool]:
    """llm-d's `featureGates` list (`name`, `name=true`, `name=false`) as name → value."""
    out: dict[str, bool] = {}
    for gate in gates or []:
        name, _, setting = gate.partition("=")
        name = name.strip()
        if name not in FEATURE_GATES:
            raise FlowControlSectionError(
                f"featureGates: {name!r} is not a feature gate; known gates: "
                + ", ".join(FEATURE_GATES)
            )
        setting = setting.strip().lower()
        if setting not in ("", "true", "false"):
            raise FlowControlSectionError(
                f"featureGates: {gate!r}; write {name!r}, '{name}=true' or '{name}=false'"
            )
        out[name] = setting != "false"
    return out


def gate_enabled(gates: list[str] | None) -> bool | None:
    """The flowControl gate's value in llm-d's `featureGates` list; None when not named."""
    return parse_gates(gates).get(FLOW_CONTROL_GATE)


def _quantity(value: str | int | None, where: str) -> int | None:
    if value is None:
        return None
    try:
        return parse_quantity(value)
    except ValueError as exc:
        raise FlowControlSectionError(f"flowControl.{where}: {exc}") from exc


def _band(band: _PickerBand, where: str, base: BandSettings) -> dict[str, Any]:
    max_bytes = _quantity(band.max_bytes, f"{where}.maxBytes") or base.max_bytes
    max_requests = _quantity(band.max_requests, f"{where}.maxRequests") or base.max_requests
    return {"max_bytes": max_bytes, "max_requests": max_requests}


def from_picker_sections(
    base: FlowControlSettings,
    feature_gates: list[str] | None,
    flow_control: Mapping[str, Any] | None,
    saturation_detector: Mapping[str, Any] | None,
    detector_plugin: str | None = None,
) -> tuple[FlowControlSettings, str | None]:
    """`base` with llm-d's sections applied, and the detector plugin name they reference.

    A detector named by `pluginRef` must be declared under the picker's `plugins`;
    the caller resolves the name. `flowControl.saturationDetector` wins over the
    deprecated top-level `saturationDetector`, as in llm-d.
    """
    update: dict[str, Any] = {}
    gate = gate_enabled(feature_gates)
    if gate is not None:
        update["enabled"] = gate
    plugin_ref = detector_plugin
    top = _decode(_TopLevelDetector, saturation_detector, "saturationDetector")
    section = _decode(_PickerFlowControl, flow_control, "flowControl")
    if top.plugin_ref:
        plugin_ref = top.plugin_ref
    legacy = top.legacy_parameters()
    if legacy:
        if top.plugin_ref:
            raise FlowControlSectionError(
                "saturationDetector: give either pluginRef or the deprecated threshold fields, "
                "not both"
            )
        update["saturation_detector"] = DetectorSettings(
            type="utilization-detector", parameters=legacy
        )
    if section.saturation_detector is not None and section.saturation_detector.plugin_ref:
        plugin_ref = section.saturation_detector.plugin_ref
    if flow_control is not None:
        if section.max_bytes is not None:
            update["max_bytes"] = _quantity(section.max_bytes, "maxBytes")
        if section.max_requests is not None:
            update["max_requests"] = _quantity(section.max_requests, "maxRequests")
        if section.default_request_ttl is not None:
            try:
                update["default_request_ttl_s"] = parse_duration(section.default_request_ttl)
            except ValueError as exc:
                raise FlowControlSectionError(f"flowControl.defaultRequestTTL: {exc}") from exc
        default_band = base.default_priority_band
        if section.default_priority_band is not None:
            default_band = BandSettings(
                **_band(section.default_priority_band, "defaultPriorityBand", default_band)
            )
            update["default_priority_band"] = default_band
        if section.default_negative_priority_band is not None:
            update["default_negative_priority_band"] = BandSettings(
                **_band(
                    section.default_negative_priority_band,
                    "defaultNegativePriorityBand",
                    default_band,
                )
            )
        if section.priority_bands:
            bands = []
            seen: set[int] = set()
            for i, band in enumerate(section.priority_bands):
                if band.priority in seen:
                    raise FlowControlSectionError(
                        f"flowControl.priorityBands[{i}]: priority {band.priority} is listed twice"
                    )
                seen.add(band.priority)
                ttl: float | None = None
                if band.default_request_ttl is not None:
                    try:
                        ttl = parse_duration(band.default_request_ttl)
                    except ValueError as exc:
                        raise FlowControlSectionError(
                            f"flowControl.priorityBands[{i}].defaultRequestTTL: {exc}"
                        ) from exc
                bands.append(
                    PriorityBandSettings(
                        priority=band.priority,
                        request_ttl_s=ttl,
                        **_band(band, f"priorityBands[{i}]", default_band),
                    )
                )
            update["priority_bands"] = tuple(bands)
    return base.model_copy(update=update), plugin_ref
