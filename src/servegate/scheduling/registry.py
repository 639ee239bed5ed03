"""The one list of built-in plugins: type string → factory.

Every built-in type string is registered explicitly in `builtin_registry()`;
importing a plugin module registers nothing. What factories receive (context,
parameter decoding) lives in `factory.py`.
"""

from __future__ import annotations

from servegate.scheduling.factory import PluginFactory


def builtin_registry() -> dict[str, PluginFactory]:
    """Every built-in plugin type string and its factory, in one explicit list."""
    from servegate.scheduling import affinity, disagg, filters, pickers, profiles, scorers
    from servegate.scheduling.affinity_filter import PrefixCacheAffinityFilter
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
        PrefixCacheAffinityFilter.type: PrefixCacheAffinityFilter.from_config,
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
