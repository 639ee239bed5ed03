"""One pool's runtime: its live state, its scheduler, its flow control, its proxy.

The live part (`PoolState`: the Pool, passive health, and what was learned: the latency
predictor, prefix indexes, session bindings, Triton models' tokenizers) outlives a
reload that leaves the pool's own settings alone; the routing part (`PoolRuntime`:
scheduler, admission, cache routing, proxy) is rebuilt when its picker or flow control
change. A request keeps the runtime it started with. What keeps a pool fresh while the
gateway runs (its data layer and discovery) is the running gateway's (`feeds.py`),
built when it starts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from servegate.config import (
    ConfigError,
    PoolEntry,
    PoolSettings,
    ServegateConfig,
    read_picker,
)
from servegate.datalayer.outlier import OutlierDetectionSettings, OutlierDetector
from servegate.engines.registry import EngineRegistry
from servegate.gateway.admission import GatewayAdmission, build_admission
from servegate.gateway.cache_routing import CacheRouting, build_cache_routing
from servegate.gateway.chat_template import ChatTemplateError
from servegate.gateway.clients import transport_for
from servegate.gateway.disagg import Disaggregator, build_disaggregator
from servegate.gateway.latency import LatencyRouting
from servegate.gateway.metrics import GatewayMetrics, PluginDurationCollector, with_aliases
from servegate.gateway.model_routing import RoutingTable
from servegate.gateway.proxy import Proxy
from servegate.gateway.retry import RetryBudget
from servegate.gateway.transport import UpstreamTransport
from servegate.gateway.triton import TritonTranslator
from servegate.gateway.triton_tokens import TritonTokenCounts
from servegate.pool.pool import Pool
from servegate.scheduling.config import DEFAULT_PICKER_CONFIG, load_picker_config
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.latency.predictor import SERVICE_KEY as LATENCY_SERVICE
from servegate.scheduling.latency.predictor import LatencyPredictor
from servegate.scheduling.routing_state import ROUTING_STATE_SERVICE, RoutingState
from servegate.scheduling.scheduler import Scheduler
from servegate.tokenization.sources import TokenizerError

log = logging.getLogger("servegate.gateway")

POOL_LABEL = "inference_pool"


@dataclass(slots=True, eq=False)
class PoolState:
    """The pool and what it learned; shared by the runtimes built over it."""

    settings: PoolSettings
    outlier_settings: OutlierDetectionSettings
    pool: Pool
    engines: EngineRegistry
    outlier: OutlierDetector
    latency: LatencyPredictor = field(default_factory=LatencyPredictor)
    """The pool's latency predictor: learned state that survives picker reloads."""
    routing: RoutingState = field(default_factory=RoutingState)
    """The pool's prefix indexes and session bindings: learned state that survives picker
    reloads; the KV-event manager and scale-out feed it, plugins receive it as a service."""
    triton_tokens: TritonTokenCounts = field(default_factory=TritonTokenCounts)
    """Per model, the tokenizer learned from Triton's model configuration (`usage`)."""

    def same_as(self, settings: PoolSettings, outlier: OutlierDetectionSettings) -> bool:
        return self.settings == settings and self.outlier_settings == outlier


def build_pool_state(
    settings: PoolSettings, outlier: OutlierDetectionSettings, metrics: GatewayMetrics
) -> PoolState:
    pool = Pool(settings.name, staleness=settings.metrics_staleness_s)
    engines = EngineRegistry()
    for doc in settings.engines:
        engines.add_custom(doc)
    for declared in settings.models:
        pool.declare_model(declared.id, declared.parent)
    for endpoint_cfg in settings.endpoints:
        endpoint = endpoint_cfg.to_endpoint(settings.name)
        engines.get(endpoint.engine)
        pool.add(endpoint)
    detector = OutlierDetector(
        pool, outlier, on_eject=lambda state, _s: metrics.ejections.labels(state.address).inc()
    )
    state = PoolState(
        settings, outlier, pool, engines, detector,
        latency=settings.latency.predictor(),
        triton_tokens=TritonTokenCounts.from_pool(settings),
    )  # fmt: skip
    predictor = state.latency
    pool.subscribe(lambda event, s: predictor.forget([s.address]) if event == "removed" else None)
    return state


@dataclass(slots=True, eq=False)
class PoolRuntime:
    """Everything the request path needs for one pool."""

    entry: PoolEntry
    state: PoolState
    scheduler: Scheduler
    admission: GatewayAdmission
    cache_routing: CacheRouting
    picker_doc: Mapping[str, Any] | str | None
    registry: CollectorRegistry
    key: tuple[Any, ...]
    proxy: Proxy
    disagg: Disaggregator
    latency: LatencyRouting
    in_flight: int = 0
    """Requests holding a `Lease` on this runtime (a retired runtime stops at 0)."""
    started: bool = False
    _idle: asyncio.Event | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def pool(self) -> Pool:
        return self.state.pool

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0 and self._idle is not None:
            self._idle.set()

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Start what runs in the background for routing: the tokenizers."""
        if self.started:
            return
        self.started = True
        await self.cache_routing.start(session)

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request uses this runtime (or the timeout); True when idle."""
        if self.in_flight <= 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        self.started = False
        self.admission.close()
        await self.cache_routing.stop()


def build_runtimes(
    config: ServegateConfig,
    metrics: GatewayMetrics,
    transport: UpstreamTransport,
    budget: RetryBudget,
    config_dir: Path | None = None,
    previous: tuple[PoolRuntime, ...] = (),
) -> tuple[tuple[PoolRuntime, ...], RoutingTable]:
    """Every pool's runtime and the model routing table; raises before starting anything."""
    runtimes = tuple(
        build_runtime(
            config, entry, metrics, config_dir, previous, transport=transport, budget=budget
        )
        for entry in config.pool_entries()
    )
    routing = RoutingTable.from_config(config.model_rewrites)
    known = {m for r in runtimes for m in r.pool.models}
    unknown = sorted(routing.targets() - known)
    if unknown:
        log.warning(
            "rewrite targets no pool declares yet (expected from replicas' /v1/models): %s",
            ", ".join(unknown),
        )
    return runtimes, routing


def build_runtime(
    config: ServegateConfig,
    entry: PoolEntry,
    metrics: GatewayMetrics,
    config_dir: Path | None = None,
    previous: Iterable[PoolRuntime] = (),
    *,
    transport: UpstreamTransport | None = None,
    budget: RetryBudget | None = None,
) -> PoolRuntime:
    """A runtime for `entry`, complete (its proxy over `transport`, aiohttp by default),
    reusing a previous one (or its live state) when nothing it depends on changed.
    Raises on bad settings before anything is started."""
    settings = entry.base()
    picker_doc = read_picker(entry.picker, config_dir)
    state: PoolState | None = None
    for old in previous:
        if old.name != entry.name or not old.state.same_as(settings, config.outlier_detection):
            continue
        state = old.state
        key = _runtime_key(config, entry, picker_doc)
        if old.key == key:
            return old
    if state is None:
        state = build_pool_state(settings, config.outlier_detection, metrics)
    scheduler = load_picker_config(
        picker_doc if picker_doc is not None else DEFAULT_PICKER_CONFIG,
        PluginContext(
            staleness_s=settings.metrics_staleness_s,
            services={LATENCY_SERVICE: state.latency, ROUTING_STATE_SERVICE: state.routing},
        ),
    )
    try:
        triton = TritonTranslator.from_pool(settings, config_dir, state.triton_tokens)
    except (ChatTemplateError, TokenizerError) as exc:
        raise ConfigError(f"pool {entry.name!r}: {exc}") from exc
    registry = CollectorRegistry(auto_describe=True)
    registry.register(PluginDurationCollector(scheduler))
    flow = entry.flow_control or config.flow_control
    admission = build_admission(flow, state.pool, registry, picker_doc, scheduler.plugins)
    cache = build_cache_routing(
        config.model_copy(update={"pool": settings}), state.pool, scheduler, registry,
        state.triton_tokens,
    )  # fmt: skip
    transport = transport or transport_for(config.gateway.upstream_client)
    proxy = Proxy(transport, config.gateway, metrics, state.outlier, budget, triton, state.engines)
    disagg = build_disaggregator(
        config.gateway, config.disaggregation, scheduler.plugins, proxy, transport, state.pool,
        metrics,
    )  # fmt: skip
    return PoolRuntime(
        entry=entry,
        state=state,
        scheduler=scheduler,
        admission=admission,
        cache_routing=cache,
        picker_doc=picker_doc,
        registry=registry,
        key=_runtime_key(config, entry, picker_doc),
        proxy=proxy,
        disagg=disagg,
        latency=LatencyRouting(state.latency, scheduler.plugins, registry),
    )


def _runtime_key(
    config: ServegateConfig, entry: PoolEntry, picker_doc: Mapping[str, Any] | str | None
) -> tuple[Any, ...]:
    return (entry, repr(picker_doc), config.gateway, config.disaggregation)


class RuntimeCollector(Collector):
    """Each runtime's own metrics (flow control, plugin timings, KV events), labelled with
    its pool; the families the Inference Extension names differently come twice."""

    def __init__(self, runtimes: Any) -> None:
        self._runtimes = runtimes

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        runtimes: Iterable[PoolRuntime] = self._runtimes()
        for runtime in runtimes:
            for family in runtime.registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for sample in family.samples:
                    labels = sample.labels
                    if POOL_LABEL not in labels:
                        labels = {**labels, POOL_LABEL: runtime.name}
                    merged.samples.append(sample._replace(labels=labels))
        yield from with_aliases(families.values())
