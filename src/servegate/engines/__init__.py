"""Model-server engines as data: one `EngineSpec` per engine, looked up by name."""

from servegate.engines.registry import (
    DEFAULT_ENGINE,
    EngineConfigError,
    EngineRegistry,
    UnknownEngineError,
    builtin_engines,
    decode_engine_config,
    engine_for_labels,
)
from servegate.engines.spec import SIGNALS, Aggregation, EngineSpec, MetricSpec, Signal

__all__ = [
    "DEFAULT_ENGINE",
    "SIGNALS",
    "Aggregation",
    "EngineConfigError",
    "EngineRegistry",
    "EngineSpec",
    "MetricSpec",
    "Signal",
    "UnknownEngineError",
    "builtin_engines",
    "decode_engine_config",
    "engine_for_labels",
]
