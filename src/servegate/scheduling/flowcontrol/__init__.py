"""Flow control: saturation detectors, priority/fairness queues, and the controller that gates dispatch.

    detector (saturation.py) ──▶ controller (controller.py) ◀── queues (queues.py)
                                     ▲ settings.py (servegate's and llm-d's config)

The gateway side (waiting per HTTP request, headers, metrics) is
`servegate.gateway.admission`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from servegate.scheduling.factory import PluginContext
from servegate.scheduling.flowcontrol.controller import (
    DROPPED_REASONS,
    Admission,
    FlowController,
    FlowStats,
    Outcome,
    Rejected,
)
from servegate.scheduling.flowcontrol.queues import BandLimits, FlowQueues, QueueFull, Ticket
from servegate.scheduling.flowcontrol.saturation import (
    SATURATED,
    ConcurrencyDetector,
    ConcurrencyParameters,
    SaturationDetector,
    UtilizationDetector,
    UtilizationParameters,
)
from servegate.scheduling.flowcontrol.settings import (
    OBJECTIVE_HEADERS,
    FlowControlSectionError,
    FlowControlSettings,
    from_picker_sections,
)
from servegate.scheduling.framework import Plugin

__all__ = [
    "DROPPED_REASONS",
    "OBJECTIVE_HEADERS",
    "SATURATED",
    "Admission",
    "BandLimits",
    "ConcurrencyDetector",
    "ConcurrencyParameters",
    "FlowControlSectionError",
    "FlowControlSettings",
    "FlowController",
    "FlowQueues",
    "FlowStats",
    "Outcome",
    "QueueFull",
    "Rejected",
    "SaturationDetector",
    "Ticket",
    "UtilizationDetector",
    "UtilizationParameters",
    "detector_from_settings",
    "from_picker_sections",
    "queues_from_settings",
    "resolve_detector",
]

DETECTOR_TYPES: dict[str, Callable[[str, Mapping[str, Any], PluginContext], SaturationDetector]] = {
    UtilizationDetector.type: UtilizationDetector.from_config,
    ConcurrencyDetector.type: ConcurrencyDetector.from_config,
}


def detector_from_settings(
    settings: FlowControlSettings, ctx: PluginContext | None = None
) -> SaturationDetector:
    spec = settings.saturation_detector
    factory = DETECTOR_TYPES.get(spec.type)
    if factory is None:
        raise FlowControlSectionError(
            f"flow_control.saturation_detector.type: unknown detector {spec.type!r}; "
            f"known: {', '.join(sorted(DETECTOR_TYPES))}"
        )
    return factory(spec.type, spec.parameters, ctx or PluginContext())


def resolve_detector(plugin_ref: str, plugins: Mapping[str, Plugin]) -> SaturationDetector:
    """The detector an EndpointPickerConfig names by `pluginRef`, from its declared plugins."""
    plugin = plugins.get(plugin_ref)
    if plugin is None:
        declared = ", ".join(plugins) or "none"
        raise FlowControlSectionError(
            f"saturationDetector.pluginRef {plugin_ref!r} names no plugin; declared: {declared}. "
            "Declare a utilization-detector or concurrency-detector under `plugins`"
        )
    if not isinstance(plugin, SaturationDetector):
        raise FlowControlSectionError(
            f"saturationDetector.pluginRef {plugin_ref!r} is a {plugin.type!r}, "
            "not a saturation detector"
        )
    return plugin


def queues_from_settings(settings: FlowControlSettings) -> FlowQueues:
    negative = settings.default_negative_priority_band
    return FlowQueues(
        bands=settings.bands(),
        default_band=settings.default_priority_band.limits(),
        default_negative_band=negative.limits() if negative is not None else None,
        max_requests=settings.max_requests,
        max_bytes=settings.max_bytes,
    )
