"""Which routing signals a pool has, and keeping the prefix indexes true to the pool.

`signals()` answers, per pool, what the prefix scorers can see: where each model's
routing token ids come from, which replicas' KV events arrive, and whether each
replica's block size is known (from its events or `cache_config_info`) or assumed;
and, for models served by Triton, where `usage`'s token counts come from
(`triton_token_count`: a tokenizer folder, or the characters / 4 estimate).
It is in `/admin/pool` (`routing_signals`), in the `servegate_routing_signal`
gauge, in one line at startup, and a scorer of the profile that cannot contribute
gets one warning line (checked again while the gateway runs, said once).

`IndexJanitor` keeps the approximate index (`prefix-cache-scorer`: what the
router sent where) from remembering caches that no longer exist: a replica that
leaves the pool is forgotten, and one whose engine restarted (its KV events say
`AllBlocksCleared`, its publisher's sequence restarts, or its prefix-cache
counters go backwards) starts empty. The precise index already forgets on the
same events (`KVEventsManager`); counters going backwards clear it too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from servegate.pool.endpoint import EndpointState
from servegate.pool.pool import Pool
from servegate.scheduling.framework import Plugin
from servegate.scheduling.prefix.approx import PrefixCacheScorer
from servegate.scheduling.prefix.events import AllBlocksCleared, EventBatch
from servegate.scheduling.prefix.precise import PrecisePrefixCacheScorer
from servegate.scheduling.scheduler import Scheduler

if TYPE_CHECKING:
    from servegate.datalayer.kvevents import KVEventsManager
    from servegate.gateway.triton_tokens import TritonTokenCounts
    from servegate.tokenization.routing import RoutingTokenizers

log = logging.getLogger(__name__)

CHECK_AFTER_S = 15.0
"""The first check for scorers that cannot contribute, after start (KV events need traffic)."""
CHECK_EVERY_S = 60.0


class IndexJanitor:
    """Forgets what the approximate (and precise) indexes believe about departed or
    restarted replicas."""

    def __init__(self, pool: Pool, plugins: Mapping[str, Plugin]) -> None:
        self.pool = pool
        self.approx = [p for p in plugins.values() if isinstance(p, PrefixCacheScorer)]
        self.precise = [p for p in plugins.values() if isinstance(p, PrecisePrefixCacheScorer)]
        self._counters: dict[str, float] = {}
        self.resets: dict[str, int] = {}
        """Per replica: how often its indexes were reset (restarts, removal)."""
        pool.subscribe(self._on_pool_change)
        pool.watch_state(self._on_state)

    def forget(self, address: str, why: str) -> None:
        for scorer in self.approx:
            scorer.index.remove_server(address)
        self.resets[address] = self.resets.get(address, 0) + 1
        log.debug("prefix indexes forget %s: %s", address, why)

    def _on_pool_change(self, event: str, state: EndpointState) -> None:
        if event == "removed":
            self._counters.pop(state.address, None)
            self.forget(state.address, "left the pool")

    def _on_state(self, state: EndpointState) -> None:
        queries = state.metrics.prefix_cache_queries
        if queries is None:
            return
        last = self._counters.get(state.address)
        self._counters[state.address] = queries
        if last is not None and queries < last:
            log.info(
                "%s: prefix-cache counters went backwards (%.0f → %.0f): its engine restarted; "
                "its cache is taken as empty",
                state.address,
                last,
                queries,
            )
            self.forget(state.address, "engine restarted")
            for scorer in self.precise:
                scorer.index.clear(state.address)

    # -- a `BlockIndex` for the KV-event manager ----------------------------------------
    def apply(self, address: str, batch: EventBatch) -> None:
        if any(isinstance(e, AllBlocksCleared) for e in batch.events):
            self.forget(address, "AllBlocksCleared")

    def clear(self, address: str) -> None:
        """The publisher restarted (or the replica left): its cache is gone."""
        self.forget(address, "KV-event publisher restarted")


def _weights(scheduler: Scheduler) -> dict[str, float]:
    """Plugin name → its largest weight over the profiles."""
    out: dict[str, float] = {}
    for profile in scheduler.profiles.values():
        for ws in profile.scorers:
            out[ws.scorer.name] = max(out.get(ws.scorer.name, 0.0), ws.weight)
    return out


class RoutingSignals:
    """What the prefix scorers of one pool can see; see the module docstring."""

    def __init__(
        self,
        pool: Pool,
        scheduler: Scheduler,
        tokenizers: RoutingTokenizers | None,
        kv_events: KVEventsManager | None,
        triton_tokens: TritonTokenCounts | None = None,
    ) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.tokenizers = tokenizers
        self.kv_events = kv_events
        self.triton_tokens = triton_tokens
        self.weights = _weights(scheduler)
        self._warned: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def _default_block_size(self) -> int | None:
        for plugin in self.scheduler.plugins.values():
            if isinstance(plugin, PrecisePrefixCacheScorer):
                return plugin.default_block_size
            if isinstance(plugin, PrefixCacheScorer):
                return plugin.params.block_size_tokens
        return None

    def signals(self) -> dict[str, Any]:
        tokenizer = {} if self.tokenizers is None else self.tokenizers.status()
        if not tokenizer:
            tokenizer = {"*": {"source": "chars", "detail": "tokenizer: {source: chars}"}}
        kv = {} if self.kv_events is None else self.kv_events.status()
        assumed = self._default_block_size()
        endpoints: dict[str, Any] = {}
        for state in self.pool:
            size = None
            origin = "assumed"
            for plugin in self.scheduler.plugins.values():
                if isinstance(plugin, PrecisePrefixCacheScorer):
                    size = plugin.index.block_size(state.address)
                    if size is not None:
                        origin = "kv-events"
                        break
            if size is None and state.metrics.block_size:
                size, origin = state.metrics.block_size, "metrics"
            endpoints[state.address] = {
                "kv_events": kv.get(state.address, {"kv_events": "no precise scorer"}),
                "block_size": size if size is not None else assumed,
                "block_size_origin": origin,
            }
        out = {
            "scorers": {name: w for name, w in self.weights.items() if _is_prefix(name, self)},
            "tokenizer": tokenizer,
            "endpoints": endpoints,
            "problems": self.problems(tokenizer, endpoints),
        }
        triton = {} if self.triton_tokens is None else self.triton_tokens.status()
        if triton:
            out["triton_token_count"] = triton
        return out

    def problems(
        self, tokenizer: Mapping[str, Mapping[str, Any]], endpoints: Mapping[str, Any]
    ) -> list[str]:
        out: list[str] = []
        precise = [
            p.name
            for p in self.scheduler.plugins.values()
            if isinstance(p, PrecisePrefixCacheScorer) and self.weights.get(p.name, 0.0) > 0
        ]
        if not precise:
            return out
        no_ids = [m for m, t in tokenizer.items() if t.get("source") == "chars"]
        if no_ids:
            out.append(
                f"{', '.join(precise)} cannot contribute for model(s) {', '.join(no_ids)}: no "
                "routing token ids (set the pool's `tokenizer`)"
            )
        for address, e in endpoints.items():
            kv = e["kv_events"]
            if kv.get("dropped") and not kv.get("batches"):
                out.append(
                    f"KV events from {address} ({kv.get('kv_events')}) arrive but none "
                    f"decode ({kv['dropped']} dropped so far); {', '.join(precise)} ignores them"
                )
        receiving = [a for a, e in endpoints.items() if e["kv_events"].get("receiving")]
        if endpoints and not receiving:
            out.append(
                f"{', '.join(precise)} cannot contribute: no replica's KV events have arrived "
                "(set each endpoint's `kv_events`, or the pool's `kv_events.port`; replicas "
                "that share a host are not subscribed on llm-d's default port 5557)"
            )
        return out

    def summary(self) -> str:
        s = self.signals()
        tok = ", ".join(f"{m}: {t.get('source')}" for m, t in s["tokenizer"].items())
        kv = sum(1 for e in s["endpoints"].values() if "batches" in e["kv_events"])
        known = sum(1 for e in s["endpoints"].values() if e["block_size_origin"] != "assumed")
        n = len(s["endpoints"])
        return (
            f"routing signals of pool {self.pool.name!r}: tokenizer {tok}; KV events subscribed "
            f"for {kv} of {n} replicas; block size known for {known} of {n}"
        )

    def check(self) -> None:
        for problem in self.signals()["problems"]:
            if problem not in self._warned:
                self._warned.add(problem)
                log.warning("pool %r: %s", self.pool.name, problem)

    async def _watch(self) -> None:
        await asyncio.sleep(CHECK_AFTER_S)
        while True:
            self.check()
            await asyncio.sleep(CHECK_EVERY_S)

    def start(self) -> None:
        log.info("%s", self.summary())
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _is_prefix(name: str, signals: RoutingSignals) -> bool:
    plugin = signals.scheduler.plugins.get(name)
    return isinstance(plugin, (PrefixCacheScorer, PrecisePrefixCacheScorer))


class SignalsCollector(Collector):
    """`servegate_routing_signal{signal, ...}`: 1 when the signal is live, else 0."""

    def __init__(self, signals: RoutingSignals) -> None:
        self._signals = signals

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        tokenizers = self._signals.tokenizers
        if tokenizers is not None:
            st = tokenizers.stats
            for name, value, doc in (
                ("requests", st.requests, "Requests that got routing token ids"),
                ("engine_calls", st.engine_calls, "POST /tokenize calls made for routing"),
                ("cache_hits", st.engine_cache_hits, "Prompts (or prompt chunks) answered "
                 "from the routing tokenizer's caches"),
                ("failures", st.engine_failures, "/tokenize calls that failed or timed out"),
                ("engine_seconds", st.engine_ns / 1e9, "Time spent waiting for /tokenize "
                 "(critical path and background)"),
                ("local_seconds", st.local_ns / 1e9, "Time spent tokenising locally"),
            ):  # fmt: skip
                counter = CounterMetricFamily(f"servegate_routing_tokenize_{name}", doc)
                counter.add_metric([], float(value))
                yield counter
        s = self._signals.signals()
        family = GaugeMetricFamily(
            "servegate_routing_signal",
            "Routing signals of the pool: tokenizer and triton_token_count (per model and "
            "source), kv_events and block_size (per endpoint); 1 = live, 0 = missing or "
            "assumed (triton_token_count: 1 = a tokenizer counts usage, 0 = characters / 4)",
            labels=["signal", "model", "endpoint", "source"],
        )
        for model, tok in s["tokenizer"].items():
            source = str(tok.get("source"))
            live = 0.0 if source in ("chars", "pending") else 1.0
            family.add_metric(["tokenizer", model, "", source], live)
        for model, count in s.get("triton_token_count", {}).items():
            source = str(count.get("source"))
            live = 1.0 if source == "tokenizer" else 0.0
            family.add_metric(["triton_token_count", model, "", source], live)
        for address, ep in s["endpoints"].items():
            kv = ep["kv_events"]
            family.add_metric(
                ["kv_events", "", address, str(kv.get("kv_events"))],
                1.0 if kv.get("receiving") else 0.0,
            )
            origin = ep["block_size_origin"]
            family.add_metric(
                ["block_size", "", address, origin], 0.0 if origin == "assumed" else 1.0
            )
        yield family


def signals_of(runtimes: Sequence[Any]) -> dict[str, Any]:
    return {r.name: r.cache_routing.signals.signals() for r in runtimes if r.cache_routing.signals}
