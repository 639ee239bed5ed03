"""Approximate-prefix insertions shared between processes.

After each routing decision the `prefix-cache-scorer` inserts the prompt's block
keys into its index and calls its `on_insert` hook; here the insertion is
buffered (coalesced over `coalesce_s`) and published. A receiver inserts the
same keys into the scorer of the same pool and plugin name, without publishing
them again. Insertions made before a process joined are not replayed: a new
worker or replica warms up from live traffic.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from servegate.scaleout.bus import Bus
from servegate.scaleout.coalesce import Coalescer
from servegate.scaleout.codec import PREFIX, Message, PrefixInsert
from servegate.scaleout.settings import ScaleOutSettings
from servegate.scheduling.prefix.approx import InsertHook, PrefixCacheScorer
from servegate.scheduling.scheduler import Scheduler

MAX_BATCH = 64


class PrefixSharing:
    def __init__(self, bus: Bus, settings: ScaleOutSettings) -> None:
        self.bus = bus
        self.settings = settings
        self.scorers: dict[tuple[str, str], PrefixCacheScorer] = {}
        self.applied = 0
        self.unmatched = 0
        self._pending: dict[str, list[PrefixInsert]] = {}
        self._coalesce = Coalescer(settings.coalesce_s, self.flush)
        bus.on(PREFIX, self.on_insertions)

    def attach(self, runtimes: Iterable[tuple[str, Scheduler]]) -> None:
        """Hook every approximate prefix scorer of each pool's scheduler (again after a reload)."""
        scorers: dict[tuple[str, str], PrefixCacheScorer] = {}
        for pool_name, scheduler in runtimes:
            for name, plugin in scheduler.plugins.items():
                inner = getattr(plugin, "source", None)  # approx-prefix-cache-producer
                if isinstance(inner, PrefixCacheScorer):
                    plugin = inner
                elif not isinstance(plugin, PrefixCacheScorer) or plugin.producer is not None:
                    continue
                plugin.on_insert = self._hook(pool_name, name)
                scorers[(pool_name, name)] = plugin
        self.scorers = scorers

    def stop(self) -> None:
        self._coalesce.cancel()
        for scorer in self.scorers.values():
            scorer.on_insert = None

    def _hook(self, pool_name: str, plugin: str) -> InsertHook:
        def inserted(address: str, keys: Sequence[int], capacity: int | None) -> None:
            batch = self._pending.setdefault(pool_name, [])
            batch.append(PrefixInsert(plugin, address, capacity, tuple(keys)))
            if len(batch) >= MAX_BATCH:
                self._coalesce.now()
            else:
                self._coalesce.poke()

        return inserted

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for pool_name, batch in pending.items():
            self.bus.publish(Message(PREFIX, self.bus.origin, pool_name, tuple(batch)))

    def on_insertions(self, msg: Message) -> None:
        for item in msg.body or ():
            assert isinstance(item, PrefixInsert)
            scorer = self.scorers.get((msg.pool, item.plugin))
            if scorer is None:
                self.unmatched += 1
                continue
            scorer.index.insert(item.address, item.keys, item.capacity)
            self.applied += 1
