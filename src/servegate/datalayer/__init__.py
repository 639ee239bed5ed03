"""The data layer: what keeps the pool's live state fresh.

`DataLayer` follows the pool's membership: for every endpoint discovery adds it
starts a `Scraper` task (metrics) and a `HealthChecker` task (readiness and the
model list), and it cancels both when the endpoint is removed. Tasks never die
of an error; an endpoint whose engine is unknown gets no tasks, stays unhealthy
and is logged once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp

from servegate.datalayer.health import HealthChecker, HealthSettings, HealthStats
from servegate.datalayer.metrics_parser import MetricsParser, ParseResult
from servegate.datalayer.scraper import Scraper, ScrapeSettings, ScrapeStats
from servegate.engines.registry import EngineRegistry, UnknownEngineError
from servegate.pool.endpoint import Endpoint, EndpointState
from servegate.pool.pool import Pool

__all__ = [
    "DataLayer",
    "HealthChecker",
    "HealthSettings",
    "HealthStats",
    "MetricsParser",
    "ParseResult",
    "ScrapeSettings",
    "ScrapeStats",
    "Scraper",
]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Watch:
    scraper: Scraper | None
    health: HealthChecker | None
    tasks: tuple[asyncio.Task[None], ...]


class DataLayer:
    def __init__(
        self,
        pool: Pool,
        session: aiohttp.ClientSession,
        engines: EngineRegistry | None = None,
        scrape: ScrapeSettings | None = None,
        health: HealthSettings | None = None,
        *,
        scrape_enabled: bool = True,
        health_enabled: bool = True,
    ) -> None:
        """`health_enabled=False` trusts every endpoint: it is marked healthy when added."""
        self.pool = pool
        self.session = session
        self.engines = engines or EngineRegistry()
        self.scrape_settings = scrape or ScrapeSettings()
        self.health_settings = health or HealthSettings()
        self.scrape_enabled = scrape_enabled
        self.health_enabled = health_enabled
        self.unknown_engine_endpoints = 0
        """Endpoints that got no tasks because their engine is not registered."""
        self._parsers: dict[str, MetricsParser] = {}
        self._watches: dict[str, _Watch] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._running = False
        self._subscribed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Watch every endpoint already in the pool and every one added later."""
        if self._running:
            return
        self._loop = asyncio.get_running_loop()
        self._running = True
        if not self._subscribed:
            self.pool.subscribe(self._on_pool_change)
            self._subscribed = True
        for state in self.pool:
            self._watch(state.endpoint)

    async def stop(self) -> None:
        """Cancel every task and wait for all of them to finish."""
        self._running = False
        tasks = [task for watch in self._watches.values() for task in watch.tasks]
        self._watches.clear()
        for task in tasks:
            task.cancel()
        tasks.extend(self._stopping)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._stopping.clear()

    def scrape_stats(self) -> dict[str, ScrapeStats]:
        return {a: w.scraper.stats for a, w in self._watches.items() if w.scraper is not None}

    def health_stats(self) -> dict[str, HealthStats]:
        return {a: w.health.stats for a, w in self._watches.items() if w.health is not None}

    def watched(self) -> list[str]:
        return sorted(self._watches)

    def _on_pool_change(self, event: str, state: EndpointState) -> None:
        """Called by the pool, on the event loop's thread, inside `add`/`remove`."""
        if not self._running:
            return
        if event == "added":
            self._watch(state.endpoint)
        elif event == "removed":
            self._unwatch(state.address)

    def _watch(self, endpoint: Endpoint) -> None:
        self._unwatch(endpoint.address)
        try:
            spec = self.engines.for_endpoint(endpoint)
        except UnknownEngineError as exc:
            self.unknown_engine_endpoints += 1
            log.error("endpoint %s gets no metrics or health checks: %s", endpoint.address, exc)
            return
        loop = self._loop
        assert loop is not None, "start() sets the loop before any endpoint is watched"
        scraper = health = None
        tasks: list[asyncio.Task[None]] = []
        if self.scrape_enabled:
            parser = self._parsers.get(spec.name)
            if parser is None or parser.spec is not spec:
                parser = self._parsers[spec.name] = MetricsParser(spec)
            scraper = Scraper(self.pool, self.session, endpoint, parser, self.scrape_settings)
            tasks.append(loop.create_task(scraper.run(), name=f"scrape {endpoint.address}"))
        if self.health_enabled:
            health = HealthChecker(self.pool, self.session, endpoint, spec, self.health_settings)
            tasks.append(loop.create_task(health.run(), name=f"health {endpoint.address}"))
        else:
            self.pool.set_health(endpoint.address, True)
        for task in tasks:
            task.add_done_callback(self._task_done)
        self._watches[endpoint.address] = _Watch(scraper, health, tuple(tasks))

    def _unwatch(self, address: str) -> None:
        watch = self._watches.pop(address, None)
        if watch is None:
            return
        for task in watch.tasks:
            task.cancel()
            self._stopping.add(task)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._stopping.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        log.error("data-layer task %s ended: %r", task.get_name(), error)
