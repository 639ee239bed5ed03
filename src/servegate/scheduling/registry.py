"""The one list of built-in plugins, and what their factories receive.

A factory turns `(name, parameters, context)` from an `EndpointPickerConfig`
into a plugin. Parameters are decoded strictly with llm-d's camelCase names:
an unknown key or a wrong type is a `PluginParameterError` naming the plugin,
the key and what is accepted. Every built-in type string is registered
explicitly in `builtin_registry()`; importing a plugin module registers nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Self, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from servegate.scheduling.framework import Plugin

T = TypeVar("T")
P = TypeVar("P", bound="Parameters")

_NO_SERVICES: Mapping[str, object] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class PluginContext:
    """What a factory may need besides its own parameters, shared by every plugin.

    `services` carries shared, process-wide objects by well-known key (for
    example a prefix index fed by KV events) so that plugins added later can
    receive them without changing the factory signature.
    """

    staleness_s: float = 2.0
    """Age in seconds after which an endpoint's scraped metrics count as stale."""
    services: Mapping[str, object] = field(default_factory=lambda: _NO_SERVICES)

    def service(self, key: str, kind: type[T]) -> T:
        """The shared service under `key`, checked to be a `kind`."""
        value = self.services.get(key)
        if value is None:
            known = ", ".join(sorted(self.services)) or "none"
            raise LookupError(f"no shared service {key!r} is available (available: {known})")
        if not isinstance(value, kind):
            raise TypeError(
                f"shared service {key!r} is a {type(value).__name__}, expected {kind.__name__}"
            )
        return value


PluginFactory = Callable[[str, Mapping[str, Any], PluginContext], Plugin]


class Parameters(BaseModel):
    """Base of every plugin's parameters: frozen, strict, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=False)


class NoParameters(Parameters):
    """For plugins that take none: any key given is an error."""


class ParameterlessPlugin:
    """Constructor, factory and repr shared by plugins without parameters."""

    __slots__ = ("name",)
    type: ClassVar[str]

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.type

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        decode_parameters(NoParameters, cls.type, name, parameters)
        return cls(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class PluginParameterError(ValueError):
    """A plugin's `parameters` block does not decode; the message says how to fix it."""

    def __init__(self, plugin_type: str, name: str, problems: list[str]) -> None:
        self.plugin_type = plugin_type
        self.name = name
        self.problems = problems
        label = f"plugin {name!r} (type {plugin_type!r})" if name != plugin_type else plugin_type
        super().__init__(f"{label}: " + "; ".join(problems))


def location(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a path: `matchExpressions[0].values`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _accepted(model: type[BaseModel]) -> list[str]:
    return [info.alias or field_name for field_name, info in model.model_fields.items()]


def decode_parameters(
    model: type[P], plugin_type: str, name: str, raw: Mapping[str, Any] | None
) -> P:
    """Decode `raw` into `model`, or raise `PluginParameterError` listing every problem."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise PluginParameterError(
            plugin_type,
            name,
            [f"`parameters` must be a mapping, got {type(raw).__name__}"],
        )
    try:
        return model.model_validate(dict(raw))
    except ValidationError as exc:
        accepted = _accepted(model)
        known = ", ".join(accepted) if accepted else "none (remove `parameters`)"
        problems: list[str] = []
        for err in exc.errors(include_url=False):
            where = location(err["loc"])
            if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
                problems.append(f"unknown parameter {where!r}; accepted parameters: {known}")
            elif err["type"] == "extra_forbidden":
                problems.append(f"unknown key {where!r}; remove it or fix its spelling")
            elif err["type"] == "missing":
                problems.append(f"parameter {where!r} is required")
            else:
                message = err["msg"].removeprefix("Value error, ")
                problems.append(f"parameter {where!r}: {message} (got {err.get('input')!r})")
        raise PluginParameterError(plugin_type, name, problems) from exc


def builtin_registry() -> dict[str, PluginFactory]:
    """Every built-in plugin type string and its factory, in one explicit list."""
    from servegate.scheduling import affinity, disagg, filters, pickers, profiles, scorers
    from servegate.scheduling.flowcontrol import saturation
    from servegate.scheduling.prefix import approx, precise

    registry: dict[str, PluginFactory] = {
        # scorers
        scorers.QueueScorer.type: scorers.QueueScorer.from_config,
        scorers.KVCacheUtilizationScorer.type: scorers.KVCacheUtilizationScorer.from_config,
        scorers.LEGACY_KV_CACHE_TYPE: scorers.KVCacheUtilizationScorer.from_config,
        scorers.RunningRequestsSizeScorer.type: scorers.RunningRequestsSizeScorer.from_config,
        scorers.ActiveRequestScorer.type: scorers.ActiveRequestScorer.from_config,
        scorers.LoadAwareScorer.type: scorers.LoadAwareScorer.from_config,
        scorers.TokenLoadScorer.type: scorers.TokenLoadScorer.from_config,
        scorers.LoraAffinityScorer.type: scorers.LoraAffinityScorer.from_config,
        approx.PrefixCacheScorer.type: approx.PrefixCacheScorer.from_config,
        precise.PrecisePrefixCacheScorer.type: precise.PrecisePrefixCacheScorer.from_config,
        affinity.NoHitLRUScorer.type: affinity.NoHitLRUScorer.from_config,
        affinity.SessionAffinityScorer.type: affinity.SessionAffinityScorer.from_config,
        # filters
        filters.LabelSelectorFilter.type: filters.LabelSelectorFilter.from_config,
        filters.LEGACY_LABEL_SELECTOR_TYPE: filters.LabelSelectorFilter.from_config,
        filters.DecodeFilter.type: filters.DecodeFilter.from_config,
        filters.PrefillFilter.type: filters.PrefillFilter.from_config,
        filters.FreshMetricsFilter.type: filters.FreshMetricsFilter.from_config,
        affinity.PrefixCacheAffinityFilter.type: affinity.PrefixCacheAffinityFilter.from_config,
        # saturation detectors (flow control's gate; also filters)
        saturation.UtilizationDetector.type: saturation.UtilizationDetector.from_config,
        saturation.ConcurrencyDetector.type: saturation.ConcurrencyDetector.from_config,
        # pickers
        pickers.MaxScorePicker.type: pickers.MaxScorePicker.from_config,
        pickers.RandomPicker.type: pickers.RandomPicker.from_config,
        pickers.WeightedRandomPicker.type: pickers.WeightedRandomPicker.from_config,
        pickers.RoundRobinPicker.type: pickers.RoundRobinPicker.from_config,
        # profile handlers
        profiles.SingleProfileHandler.type: profiles.SingleProfileHandler.from_config,
        disagg.DisaggProfileHandler.type: disagg.DisaggProfileHandler.from_config,
        disagg.PdProfileHandler.type: disagg.PdProfileHandler.from_config,
        disagg.DataParallelProfileHandler.type: disagg.DataParallelProfileHandler.from_config,
        # prefill/decode deciders and llm-d's sidecar-header plugins
        disagg.PrefixBasedPDDecider.type: disagg.PrefixBasedPDDecider.from_config,
        disagg.AlwaysDisaggPDDecider.type: disagg.AlwaysDisaggPDDecider.from_config,
        disagg.DisaggHeadersHandler.type: disagg.DisaggHeadersHandler.from_config,
        disagg.LEGACY_HEADERS_HANDLER_TYPE: disagg.DisaggHeadersHandler.from_config,
    }
    registry.update(_llmd_router_types())
    registry.update(_latency_plugins())
    return registry


def _llmd_router_types() -> dict[str, PluginFactory]:
    """The plugin kinds of llm-d's current router that are not filters, scorers or pickers
    (issue 17): producers, parsers, data layer, flow-control policies. Kept in one block so
    that other additions (the latency predictor's types, issue 21) merge beside it."""
    from servegate.scheduling import (
        admitters,
        affinity,
        datasources,
        disagg,
        filters,
        parsers,
        producers,
        profiles,
        scorers,
        unsupported,
    )
    from servegate.scheduling.flowcontrol import policies

    out: dict[str, PluginFactory] = {
        filters.ByLabelFilter.type: filters.ByLabelFilter.from_config,
        filters.EncodeFilter.type: filters.EncodeFilter.from_config,
        filters.UtilizationFilter.type: filters.UtilizationFilter.from_config,
        affinity.SessionAffinityFilter.type: affinity.SessionAffinityFilter.from_config,
        scorers.ContextLengthAware.type: scorers.ContextLengthAware.from_config,
        scorers.HeaderLabelAffinityScorer.type: scorers.HeaderLabelAffinityScorer.from_config,
        profiles.HeaderProfileHandler.type: profiles.HeaderProfileHandler.from_config,
        disagg.AlwaysDisaggMultimodalDecider.type: (
            disagg.AlwaysDisaggMultimodalDecider.from_config
        ),
        admitters.ProbabilisticAdmitter.type: admitters.ProbabilisticAdmitter.from_config,
        producers.ApproxPrefixCacheProducer.type: producers.ApproxPrefixCacheProducer.from_config,
        producers.PrecisePrefixCacheProducer.type: (
            producers.PrecisePrefixCacheProducer.from_config
        ),
        producers.BurstPrefixCacheProducer.type: producers.BurstPrefixCacheProducer.from_config,
    }
    for family in (
        producers.PRODUCERS,
        parsers.PARSERS,
        datasources.SOURCES,
        datasources.EXTRACTORS,
        (datasources.FileDiscovery,),
        policies.POLICIES,
        unsupported.SCHEDULING,
        unsupported.DECLARED,
    ):
        for cls in family:
            out[cls.type] = cls.from_config
    return out


# -- predicted-latency routing (scheduling/latency/) --------------------------------------
def _latency_plugins() -> dict[str, PluginFactory]:
    """llm-d's predicted-latency plugin types, over the in-process predictor."""
    from servegate.scheduling.latency import plugins as latency

    return {
        latency.PredictedLatencyProducer.type: latency.PredictedLatencyProducer.from_config,
        latency.LatencyScorer.type: latency.LatencyScorer.from_config,
        latency.PredictedLatencyScorer.type: latency.PredictedLatencyScorer.from_config,
        latency.SloHeadroomTierFilter.type: latency.SloHeadroomTierFilter.from_config,
        latency.LatencySloAdmitter.type: latency.LatencySloAdmitter.from_config,
    }


# -- end of predicted-latency routing ------------------------------------------------------
