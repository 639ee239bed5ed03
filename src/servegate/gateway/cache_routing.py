"""The gateway's side of cache-aware routing, built once at startup.

Three things the pure scheduler cannot do itself: tokenise a request before
`schedule()` (the `engine` tokenizer does I/O), run the KV-event subscribers
that feed the precise prefix indexes, and add the response headers some
plugins ask for (`x-session-token`). Nothing runs when nothing needs it: no
tokenizer configured, no precise scorer, no header plugin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client import CollectorRegistry

from servegate.config import ServegateConfig
from servegate.datalayer.kvevents import KVEventsCollector, KVEventsManager
from servegate.datalayer.kvevents.settings import kv_events_settings
from servegate.gateway.routing_signals import IndexJanitor, RoutingSignals, SignalsCollector
from servegate.gateway.triton_tokens import TritonTokenCounts
from servegate.pool.endpoint import EndpointState
from servegate.pool.pool import Pool
from servegate.scheduling.affinity import ResponseHeaders
from servegate.scheduling.framework import Decision
from servegate.scheduling.prefix.precise import precise_indexes
from servegate.scheduling.request import LLMRequest
from servegate.scheduling.scheduler import Scheduler
from servegate.tokenization.routing import RoutingTokenizers
from servegate.tokenization.settings import TokenizerSettings


@dataclass(slots=True)
class CacheRouting:
    tokenizers: RoutingTokenizers | None = None
    kv_events: KVEventsManager | None = None
    header_plugins: tuple[ResponseHeaders, ...] = field(default_factory=tuple)
    signals: RoutingSignals | None = None
    janitor: IndexJanitor | None = None

    def needs_prepare(self, request: LLMRequest) -> bool:
        """Whether `prepare` could do anything for `request`, so that the caller need not
        create and await its coroutine when it could not (nearly every request)."""
        tokenizers = self.tokenizers
        return tokenizers is not None and tokenizers.needs_prepare(request)

    async def prepare(self, request: LLMRequest, candidates: Sequence[EndpointState]) -> None:
        tokenizers = self.tokenizers
        if tokenizers is not None and tokenizers.needs_prepare(request):
            await tokenizers.prepare(request, candidates)

    def headers(self, request: LLMRequest, decision: Decision, out: dict[str, str]) -> None:
        for plugin in self.header_plugins:
            out.update(plugin.response_headers(request, decision))

    async def start(self, session: aiohttp.ClientSession) -> None:
        if self.tokenizers is not None:
            self.tokenizers.bind_session(session)
        if self.kv_events is not None:
            await self.kv_events.start()
        if self.signals is not None:
            self.signals.start()

    async def stop(self) -> None:
        if self.signals is not None:
            await self.signals.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self.tokenizers is not None:
            await self.tokenizers.close()
            self.tokenizers.bind_session(None)


def build_cache_routing(
    config: ServegateConfig,
    pool: Pool,
    scheduler: Scheduler,
    registry: CollectorRegistry,
    triton_tokens: TritonTokenCounts | None = None,
) -> CacheRouting:
    pool_cfg = config.pool
    per_model = {m.id: m.tokenizer for m in pool_cfg.models if m.tokenizer is not None}
    tokenizers = RoutingTokenizers(pool_cfg.tokenizer or TokenizerSettings(), per_model)
    indexes = precise_indexes(scheduler.plugins)
    janitor = IndexJanitor(pool, scheduler.plugins)
    manager = None
    if indexes:
        chosen = kv_events_settings(scheduler.plugins, pool_cfg.kv_events)
        manager = KVEventsManager(
            pool,
            [*indexes.values(), janitor],
            chosen.settings,
            auto=chosen.auto,
            replay_optional=chosen.replay_optional,
        )
        registry.register(KVEventsCollector(manager.stats, indexes))
    headers = tuple(p for p in scheduler.plugins.values() if isinstance(p, ResponseHeaders))
    active = tokenizers if tokenizers.active else None
    signals = None
    if janitor.approx or janitor.precise:
        signals = RoutingSignals(pool, scheduler, active, manager, triton_tokens)
        registry.register(SignalsCollector(signals))
    return CacheRouting(
        tokenizers=active,
        kv_events=manager,
        header_plugins=headers,
        signals=signals,
        janitor=janitor,
    )
