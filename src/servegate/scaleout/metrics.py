"""Endpoint metrics, health and served models: scraped by one worker, applied by the others.

The leader (worker 0) runs the data layer as a single process would and
publishes what it learns: the endpoints written since the last message
(coalesced), and every endpoint every `heartbeat_s` (with the served models,
which change rarely). Followers start no scrapes or health probes and apply
these instead. A leader that has just (re)started withholds an endpoint until it
has probed it healthy and scraped it, for at most `leader_takeover_s`: its blank
state would otherwise mark every endpoint down in followers that still know better.
A follower that hears nothing for `leader_takeover_s` (the leader
died and is being restarted) starts its own data layer, and stops it again when
the leader is back. Metrics stay on the host: every replica scrapes for itself.

Followers apply reports only from their own host's leader: origin
`<replica>/w0.<generation>` of their own replica id, not carried by a bridge
(hops 0). Anything else is counted in `rejected` and ignored. The values are
clamped where they enter the pool (`Pool.set_metrics`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from servegate.pool.endpoint import EndpointState
from servegate.pool.pool import Pool
from servegate.scaleout.bus import Bus
from servegate.scaleout.coalesce import Coalescer
from servegate.scaleout.codec import METRICS, EndpointReport, Message
from servegate.scaleout.settings import ScaleOutSettings

log = logging.getLogger("servegate.scaleout")

METRICS_COALESCE_S = 0.01
TAKEOVER_CHECK_S = 0.25


def report(pool: Pool, state: EndpointState) -> EndpointReport:
    return EndpointReport(
        state.address, state.healthy, state.metrics, pool.served_entries(state.address)
    )


def apply(pool: Pool, r: EndpointReport) -> None:
    state = pool.get(r.address)
    if state is None:
        return
    if state.healthy != r.healthy:
        pool.set_health(r.address, r.healthy)
    pool.set_metrics(r.address, r.metrics)
    if set(pool.served_entries(r.address)) != set(r.served):
        pool.set_served_models(r.address, r.served)


class MetricsSharing:
    def __init__(
        self,
        bus: Bus,
        settings: ScaleOutSettings,
        leader: bool,
        pools: Callable[[], Iterable[Pool]],
        set_scraping: Callable[[bool], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
        *,
        share: bool = True,
    ) -> None:
        """`share=False`: a single-process replica, which scrapes for itself and tells no one."""
        self.share = share
        self.bus = bus
        self.settings = settings
        self.leader = leader
        self._pools = pools
        self._set_scraping = set_scraping
        self._clock = clock
        self.last_heard = self._started = clock()
        self.applied = 0
        self.rejected = 0
        """METRICS messages ignored because they did not come from this host's leader."""
        self.leader_prefix = f"{bus.origin.split('/', 1)[0]}/w0."
        self.taken_over = False
        self.takeovers = 0
        self._attached: set[int] = set()
        self._dirty: dict[str, set[str]] = {}
        self._coalesce = Coalescer(METRICS_COALESCE_S, self.flush)
        self._task: asyncio.Task[None] | None = None
        if not leader:
            bus.on(METRICS, self.on_reports)

    @property
    def scrapes(self) -> bool:
        return self.leader or self.taken_over

    def attach(self) -> None:
        if not (self.leader and self.share):
            return
        for pool in self._pools():
            if id(pool) not in self._attached:
                self._attached.add(id(pool))
                pool.watch_state(self._changed(pool.name))

    def start(self) -> None:
        if self.leader and not self.share:
            return
        self.attach()
        loop = asyncio.get_running_loop()
        work = self._heartbeat() if self.leader else self._watch_leader()
        self._task = loop.create_task(work, name="shared metrics")

    async def stop(self) -> None:
        self._coalesce.cancel()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # -- leader -----------------------------------------------------------------------
    def _changed(self, pool_name: str) -> Callable[[EndpointState], None]:
        def changed(state: EndpointState) -> None:
            self._dirty.setdefault(pool_name, set()).add(state.address)
            self._coalesce.poke()

        return changed

    def flush(self) -> None:
        dirty, self._dirty = self._dirty, {}
        for pool in self._pools():
            addresses = dirty.get(pool.name)
            if addresses:
                states = [s for s in (pool.get(a) for a in sorted(addresses)) if s is not None]
                self.publish(pool, states)

    def publish(self, pool: Pool, states: Iterable[EndpointState]) -> None:
        warm = self._clock() - self._started >= self.settings.leader_takeover_s
        body = tuple(
            report(pool, s) for s in states if warm or (s.healthy and s.metrics.scraped_at > 0)
        )
        self.bus.publish(Message(METRICS, self.bus.origin, pool.name, body))

    async def _heartbeat(self) -> None:
        while True:
            for pool in self._pools():
                self.publish(pool, pool)
            await asyncio.sleep(self.settings.heartbeat_s)

    # -- follower ---------------------------------------------------------------------
    def on_reports(self, msg: Message) -> None:
        if msg.hops or not msg.origin.startswith(self.leader_prefix):
            self.rejected += 1
            return
        pool = next((p for p in self._pools() if p.name == msg.pool), None)
        if pool is None:
            return
        self.last_heard = self._clock()
        for r in msg.body or ():
            assert isinstance(r, EndpointReport)
            apply(pool, r)
            self.applied += 1

    async def _watch_leader(self) -> None:
        while True:
            await asyncio.sleep(TAKEOVER_CHECK_S)
            await self.check_leader()

    async def check_leader(self) -> None:
        silent = self._clock() - self.last_heard
        if not self.taken_over and silent > self.settings.leader_takeover_s:
            log.warning("no shared metrics for %.1fs: this worker scrapes on its own", silent)
            self.taken_over = True
            self.takeovers += 1
            await self._set_scraping(True)
        elif self.taken_over and silent < self.settings.leader_takeover_s:
            log.info("shared metrics are back: this worker stops scraping")
            self.taken_over = False
            await self._set_scraping(False)
