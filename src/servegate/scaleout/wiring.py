"""Starting and stopping scale-out inside one gateway process.

A process shares state when a supervisor started it as a worker (the
`SERVEGATE_WORKER` environment variable: the host hub's bus) or when
`scaleout.bind` is set (a single-process replica: its own bus to its peers).
Otherwise `start_scaleout` returns None and nothing changes.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from servegate.pool.pool import Pool
from servegate.scaleout.bus import Bus
from servegate.scaleout.codec import GONE, Message
from servegate.scaleout.inflight import InFlightSharing
from servegate.scaleout.metrics import MetricsSharing
from servegate.scaleout.prefix import PrefixSharing
from servegate.scaleout.replica import ReplicaLink
from servegate.scaleout.report import NOT_SHARED, ScaleOutCollector
from servegate.scaleout.settings import ScaleOutSettings, WorkerIdentity
from servegate.scheduling.scheduler import Scheduler

if TYPE_CHECKING:
    from servegate.gateway.app import Gateway

log = logging.getLogger("servegate.scaleout")


def default_replica_id() -> str:
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())
    return f"{host[:40] or 'replica'}-{secrets.token_hex(3)}"


def _runtimes(gw: Gateway) -> list[tuple[str, Pool, Scheduler]]:
    """Every pool runtime's name, pool and scheduler: the one place that reads them."""
    return [(rt.name, rt.pool, rt.scheduler) for rt in gw.pool_runtimes()]


def _pools(gw: Gateway) -> list[Pool]:
    unique = {id(pool): pool for _, pool, _ in _runtimes(gw)}
    return list(unique.values())


class ScaleOut:
    def __init__(
        self,
        gw: Gateway,
        settings: ScaleOutSettings,
        bus: Bus,
        mode: str,
        leader: bool,
        set_scraping: Callable[[bool], Awaitable[None]],
        link: ReplicaLink | None = None,
    ) -> None:
        """`set_scraping`: turns every pool's scrapes and health checks on or off (a
        follower worker's are off while its leader's reports arrive)."""
        self.gw = gw
        self.settings = settings
        self.bus = bus
        self.mode = mode
        self.link = link

        def pools() -> list[Pool]:
            return _pools(gw)

        self.inflight = InFlightSharing(bus, settings, pools)
        self.prefix = PrefixSharing(bus, settings)
        self._set_scraping = set_scraping
        self.metrics = MetricsSharing(
            bus, settings, leader, pools, set_scraping, share=mode == "worker"
        )
        self._collector = ScaleOutCollector(self)

    @property
    def origin(self) -> str:
        return self.bus.origin

    @property
    def leads_scrapes(self) -> bool:
        """False for a follower worker: its data layer stays idle while the leader's arrive."""
        return self.metrics.scrapes

    async def start(self) -> None:
        if not self.metrics.leader:
            await self._set_scraping(False)  # before any pool starts: it scrapes nothing
        if self.link is not None:
            await self.link.start()
        self.prefix.attach(_runtimes(self.gw))
        self.bus.start()
        self.inflight.start()
        self.metrics.start()
        self.gw.metrics.registry.register(self._collector)
        log.info(
            "scale-out started",
            extra={"fields": {"origin": self.origin, "mode": self.mode,
                              "scrapes": self.leads_scrapes}},
        )  # fmt: skip

    def reattach(self, gw: Gateway) -> None:
        """After a config reload swapped schedulers or pools: hook the new ones (new pools'
        data layers follow the scraping switch as they start)."""
        self.prefix.attach(_runtimes(gw))
        self.inflight.attach()
        self.metrics.attach()

    async def stop(self) -> None:
        self.gw.metrics.registry.unregister(self._collector)
        self.prefix.stop()
        await self.metrics.stop()
        await self.inflight.stop()
        self.bus.publish(Message(GONE, self.origin, "*"))
        await self.bus.stop()
        if self.link is not None:
            await self.link.stop()

    def describe(self, now: float) -> dict[str, Any]:
        pools: dict[str, Any] = {}
        for pool in _pools(self.gw):
            pools[pool.name] = {
                s.address: {
                    "local": [s.local_in_flight_requests, s.local_in_flight_tokens],
                    "peer": [s.peer_in_flight_requests, s.peer_in_flight_tokens],
                    "total": [s.in_flight_requests, s.in_flight_tokens],
                }
                for s in pool
            }
        return {
            "enabled": True,
            "pid": os.getpid(),
            "origin": self.origin,
            "mode": self.mode,
            "leader": self.metrics.leader,
            "scrapes": self.metrics.scrapes,
            "takeovers": self.metrics.takeovers,
            "peers": {
                origin: {"age_s": round(now - view.last_seen, 3)}
                for origin, view in sorted(self.inflight.peers.items())
            },
            "replica_peers": sorted(self.link.connected) if self.link is not None else [],
            "in_flight": pools,
            "prefix": {
                f"{pool}/{plugin}": {"blocks": len(scorer.index)}
                for (pool, plugin), scorer in sorted(self.prefix.scorers.items())
            },
            "prefix_applied": self.prefix.applied,
            "prefix_unmatched": self.prefix.unmatched,
            "rejected": {
                "in_flight": dict(self.inflight.rejected),
                "prefix": dict(self.prefix.rejected),
                "metrics": self.metrics.rejected,
                "curve_refused": self.link.refused if self.link is not None else 0,
            },
            "authenticated": self.link is None or self.link.keys is not None,
            "released": {"expired": self.inflight.expired, "gone": self.inflight.departed},
            "bus": self.bus.stats.as_dict(),
            "not_shared": list(NOT_SHARED),
        }


async def start_scaleout(
    gw: Gateway, set_scraping: Callable[[bool], Awaitable[None]]
) -> ScaleOut | None:
    """Join the host's workers and/or peer replicas; None when this process runs alone.
    Call it before any pool starts: a follower worker's pools must not scrape."""
    settings = gw.config.scaleout
    identity = WorkerIdentity.from_env()
    if identity is not None:
        bus = Bus.worker(identity.origin, identity.hub_in, identity.hub_out)
        scaleout = ScaleOut(gw, settings, bus, "worker", identity.leader, set_scraping)
    elif settings.replicates:
        link = ReplicaLink(settings)
        replica_id = settings.replica_id or default_replica_id()
        bus = Bus(f"{replica_id}/0", link.pub, link.sub)
        scaleout = ScaleOut(gw, settings, bus, "replica", True, set_scraping, link)
    else:
        return None
    await scaleout.start()
    return scaleout
