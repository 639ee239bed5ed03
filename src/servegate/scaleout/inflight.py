"""In-flight requests and tokens, shared between processes as absolute snapshots.

Each process publishes its own per-endpoint counts (what `Pool.acquire`/`release`
moved here) when they change, coalesced over `coalesce_s`, and again every
`heartbeat_s`. A receiver replaces its view of that origin and pool, and feeds
the sum over origins to `Pool.set_peer_in_flight`. A snapshot is self-contained,
so a lost message is corrected by the next one. An origin that stops
heartbeating for `expiry_s`, or that its supervisor reports gone, is dropped:
its counts are released.

What peers send is input from other processes: a snapshot for a pool this
process does not have is ignored, entries for addresses that are not pool
members are dropped, and at most `max_peers` origins are tracked (each origin's
state is one count pair per pool member, so memory stays bounded). Every
rejection is counted in `rejected` by reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from servegate.pool.endpoint import EndpointState
from servegate.pool.pool import Pool
from servegate.scaleout.bus import Bus
from servegate.scaleout.coalesce import Coalescer
from servegate.scaleout.codec import GONE, INFLIGHT, InFlight, Message
from servegate.scaleout.settings import ScaleOutSettings

log = logging.getLogger("servegate.scaleout")

Counts = dict[str, tuple[int, int]]


@dataclass(slots=True)
class PeerView:
    last_seen: float
    pools: dict[str, Counts] = field(default_factory=dict)


class InFlightSharing:
    def __init__(
        self,
        bus: Bus,
        settings: ScaleOutSettings,
        pools: Callable[[], Iterable[Pool]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus = bus
        self.settings = settings
        self._pools = pools
        self._clock = clock
        self.peers: dict[str, PeerView] = {}
        self.expired = 0
        self.departed = 0
        self.rejected: Counter[str] = Counter()
        """Snapshots or entries ignored: `pool` (unknown pool), `address` (not a pool member),
        `peers` (over `max_peers` origins)."""
        self._attached: set[int] = set()
        self._dirty: set[str] = set()
        self._coalesce = Coalescer(settings.coalesce_s, self.flush)
        self._task: asyncio.Task[None] | None = None
        bus.on(INFLIGHT, self.on_snapshot)
        bus.on(GONE, self.on_gone)

    def attach(self) -> None:
        """Watch every current pool's local counts (again after a reload: new pools only)."""
        for pool in self._pools():
            if id(pool) not in self._attached:
                self._attached.add(id(pool))
                pool.watch_in_flight(self._local_changed(pool.name))

    def start(self) -> None:
        self.attach()
        self._task = asyncio.get_running_loop().create_task(self._heartbeat(), name="inflight")

    async def stop(self) -> None:
        self._coalesce.cancel()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # -- local → bus ------------------------------------------------------------------
    def _local_changed(self, pool_name: str) -> Callable[[EndpointState], None]:
        def changed(_state: EndpointState) -> None:
            self._dirty.add(pool_name)
            self._coalesce.poke()

        return changed

    def flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for pool in self._pools():
            if pool.name in dirty:
                self.publish(pool)

    def publish(self, pool: Pool) -> None:
        entries = tuple(
            InFlight(s.address, s.local_in_flight_requests, s.local_in_flight_tokens)
            for s in pool
            if s.local_in_flight_requests or s.local_in_flight_tokens
        )
        self.bus.publish(Message(INFLIGHT, self.bus.origin, pool.name, entries))

    async def _heartbeat(self) -> None:
        while True:
            for pool in self._pools():
                self.publish(pool)
            self.expire()
            await asyncio.sleep(self.settings.heartbeat_s)

    # -- bus → pool -------------------------------------------------------------------
    def on_snapshot(self, msg: Message) -> None:
        pool = self._pool(msg.pool)
        if pool is None:
            self.rejected["pool"] += 1
            return
        view = self.peers.get(msg.origin)
        if view is None:
            if len(self.peers) >= self.settings.max_peers:
                self.rejected["peers"] += 1
                return
            view = self.peers[msg.origin] = PeerView(self._clock())
            log.info("scale-out peer joined: %s", msg.origin)
        view.last_seen = self._clock()
        new: Counts = {}
        for e in msg.body or ():
            assert isinstance(e, InFlight)
            if pool.get(e.address) is None:
                self.rejected["address"] += 1
                continue
            new[e.address] = (e.requests, e.tokens)
        old = view.pools.get(msg.pool, {})
        view.pools[msg.pool] = new
        if new or old:
            self._recompute(msg.pool, old.keys() | new.keys())

    def on_gone(self, msg: Message) -> None:
        if self.drop(msg.origin):
            self.departed += 1
            log.info("scale-out peer left: %s", msg.origin)

    def expire(self) -> None:
        now = self._clock()
        for origin, view in list(self.peers.items()):
            if now - view.last_seen > self.settings.expiry_s:
                self.drop(origin)
                self.expired += 1
                log.warning("scale-out peer %s silent for %.1fs: released its counts", origin,
                            now - view.last_seen)  # fmt: skip

    def drop(self, origin: str) -> bool:
        view = self.peers.pop(origin, None)
        if view is None:
            return False
        for pool_name, counts in view.pools.items():
            self._recompute(pool_name, counts.keys())
        return True

    def peer_totals(self, pool_name: str, address: str) -> tuple[int, int]:
        requests = tokens = 0
        for view in self.peers.values():
            r, t = view.pools.get(pool_name, {}).get(address, (0, 0))
            requests += r
            tokens += t
        return requests, tokens

    def _pool(self, name: str) -> Pool | None:
        return next((p for p in self._pools() if p.name == name), None)

    def _recompute(self, pool_name: str, addresses: Iterable[str]) -> None:
        pool = self._pool(pool_name)
        if pool is None:
            return
        for address in addresses:
            pool.set_peer_in_flight(address, *self.peer_totals(pool_name, address))
