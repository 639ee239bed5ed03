"""Changing pools, picker profiles, flow control and traffic splits without a restart.

A reload builds the whole new set of pool runtimes and the routing table first
(config validation, picker plugins, flow control); any error leaves the running
gateway untouched. Then one assignment switches the gateway over. A request in
flight keeps the runtime it started with; runtimes no longer used stop once
their last request ends (or after `gateway.drain_timeout_s`). Pools whose own
settings did not change keep their state: metrics, health, in-flight counts.
The switch is one reference: the `Director`'s `RoutingSnapshot` (config, runtimes,
routing table, tenants); a request reads it once when it begins.

The listening address, probe port, log level and extproc settings are read at
start only; a reload that changes them says so in the log.

A gateway started from a file gets a `ConfigReloader` when it starts (over the running
gateway, which starts and stops the runtimes); one started without a file gets
`FixedConfig`, whose reload refuses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from servegate.config import ConfigError, ServegateConfig, load_config
from servegate.control.snapshot import RoutingSnapshot
from servegate.gateway.pools import PoolRuntime, build_runtimes
from servegate.gateway.tenants import TenantTable

if TYPE_CHECKING:
    from servegate.gateway.app import Gateway
    from servegate.gateway.lifecycle import RunningGateway

log = logging.getLogger("servegate.reload")

RESTART_ONLY = (
    "host",
    "port",
    "probe_port",
    "max_header_bytes",
    "max_line_bytes",
    "max_headers",
    "idle_timeout_s",
    "header_timeout_s",
    "max_connections",
    "max_connections_per_client",
)


@dataclass(frozen=True, slots=True)
class ReloadResult:
    ok: bool
    error: str | None = None
    pools: tuple[str, ...] = ()
    """The pools running after the reload."""
    status: int = 200
    """The admin route's answer: 200, 422 (the new config was rejected) or 409 (nothing to
    reload from)."""


@dataclass(slots=True)
class ConfigSource:
    """Where the configuration comes from: a file, with the env and CLI overrides on top."""

    path: Path | None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    environ: Mapping[str, str] | None = None

    def load(self) -> ServegateConfig:
        return load_config(self.path, self.environ, self.overrides)

    def mtime(self) -> float | None:
        if self.path is None:
            return None
        try:
            return self.path.stat().st_mtime_ns / 1e9
        except OSError:
            return None


class Reloader(Protocol):
    async def reload(self) -> ReloadResult: ...

    def signal(self) -> None: ...

    def watch(self, interval_s: float) -> None: ...

    async def close(self) -> None: ...


NOT_FROM_A_FILE = "this gateway was not started from a file"


class FixedConfig:
    """The reloader of a gateway started without a config file (or embedded, its config
    given by the host's code): nothing to re-read."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def reload(self) -> ReloadResult:
        pools = tuple(r.name for r in self.gw.runtimes)
        return ReloadResult(False, NOT_FROM_A_FILE, pools, status=409)

    def signal(self) -> None:
        pass

    def watch(self, interval_s: float) -> None:
        pass

    async def close(self) -> None:
        pass


RELOADER: web.AppKey[Reloader] = web.AppKey("reloader")
"""The running app's reloader, set when it starts."""


class ConfigReloader:
    """Reloads the running gateway from `source`; one reload at a time."""

    def __init__(self, running: RunningGateway, source: ConfigSource) -> None:
        self.running = running
        self.gw = running.gateway
        self.source = source
        self._lock = asyncio.Lock()
        self._retiring: set[asyncio.Task[Any]] = set()
        self._pending: set[PoolRuntime] = set()
        self._watch: asyncio.Task[None] | None = None

    async def reload(self) -> ReloadResult:
        """Re-read the source and switch over, or keep the running config and say why."""
        try:
            config = self.source.load()
        except ConfigError as exc:
            return self._failed(str(exc))
        return await self.apply(config)

    async def apply(self, config: ServegateConfig) -> ReloadResult:
        async with self._lock:
            gw = self.gw
            old = gw.runtimes
            try:
                tenants = TenantTable.from_config(config, gw.config_dir, previous=gw.tenants)
                runtimes, routing = build_runtimes(
                    config, gw.metrics, gw.transport, gw.budget, gw.config_dir, old
                )
            except Exception as exc:  # any build error keeps the old config
                return self._failed(f"{type(exc).__name__}: {exc}")
            fresh = tuple(r for r in runtimes if r not in old)
            try:
                await self.running.start_runtimes(fresh)
            except Exception as exc:  # e.g. discovery that cannot connect
                await self.running.stop_runtimes(fresh, old)
                return self._failed(f"starting the new pools failed: {type(exc).__name__}: {exc}")
            await _warm_up(fresh, old, config.reload.warmup_s)
            previous_config = gw.config
            gw.swap(RoutingSnapshot(config, runtimes, routing, tenants))
            self._restart_only_changes(previous_config, config)
            retired = tuple(r for r in old if r not in runtimes)
            self._pending.update(retired)
            if retired:
                task = asyncio.create_task(self._retire(retired, runtimes))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)
            gw.metrics.reloads.labels("success").inc()
            names = tuple(r.name for r in runtimes)
            log.info(
                "configuration reloaded",
                extra={"fields": {"pools": list(names), "rebuilt": [r.name for r in fresh]}},
            )
        self.running.reloaded()
        return ReloadResult(True, pools=names)

    def _failed(self, error: str) -> ReloadResult:
        self.gw.metrics.reloads.labels("failure").inc()
        log.error(
            "configuration reload rejected; the running configuration stays",
            extra={"fields": {"error": error}},
        )
        pools = tuple(r.name for r in self.gw.runtimes)
        return ReloadResult(False, error=error, pools=pools, status=422)

    def _restart_only_changes(self, before: ServegateConfig, after: ServegateConfig) -> None:
        changed = [
            f"gateway.{name}"
            for name in RESTART_ONLY
            if getattr(before.gateway, name) != getattr(after.gateway, name)
        ]
        changed += [
            name
            for name in ("extproc", "log_level")
            if getattr(before, name) != getattr(after, name)
        ]
        if changed:
            log.warning("these settings change only at restart: %s", ", ".join(changed))

    async def _retire(
        self, retired: tuple[PoolRuntime, ...], current: tuple[PoolRuntime, ...]
    ) -> None:
        timeout = self.gw.config.gateway.drain_timeout_s
        await asyncio.gather(*(r.drained(timeout) for r in retired))
        self._pending.difference_update(retired)
        await self.running.stop_runtimes(retired, current)

    def signal(self) -> None:
        """For a signal handler: reload in the background."""
        task = asyncio.get_running_loop().create_task(self.reload())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def watch(self, interval_s: float) -> None:
        """Reload whenever the file's modification time changes."""
        if self._watch is None and self.source.path is not None:
            self._watch = asyncio.create_task(self._poll(interval_s, self.source.mtime()))

    async def _poll(self, interval_s: float, seen: float | None) -> None:
        while True:
            await asyncio.sleep(interval_s)
            now = self.source.mtime()
            if now is not None and now != seen:
                seen = now
                await self.reload()

    async def close(self) -> None:
        tasks = list(self._retiring)
        if self._watch is not None:
            tasks.append(self._watch)
            self._watch = None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        pending = tuple(self._pending)
        self._pending.clear()
        await self.running.stop_runtimes(pending, self.gw.runtimes)


async def _warm_up(
    fresh: tuple[PoolRuntime, ...], old: tuple[PoolRuntime, ...], timeout_s: float
) -> None:
    """Give newly created pools a moment to see their first healthy endpoint."""
    known = {id(r.state) for r in old}
    pools = [r.pool for r in fresh if id(r.state) not in known and len(r.pool)]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while pools and loop.time() < deadline:
        if all(p.ready_count() > 0 for p in pools):
            return
        await asyncio.sleep(0.05)
