"""Approximate-prefix insertions shared between processes.

After each routing decision the `prefix-cache-scorer` inserts the prompt's block
keys into its index and calls its `on_insert` hook; here the insertion is
buffered (coalesced over `coalesce_s`) and published. A receiver inserts the
same keys into the scorer of the same pool and plugin name, without publishing
them again. Insertions made before a process joined are not replayed: a new
worker or replica warms up from live traffic.

Remote insertions are checked before they touch an index: the address must be a
member of the pool, an insertion holds at most the scorer's
`maxPrefixBlocksToMatch` keys (what one routing decision inserts), and the
capacity a peer sends is not trusted: the receiver sizes the endpoint's LRU as
its own scorer would (its own view of the engine's block count, else the
configured `lruCapacityPerServer`). So memory per scorer stays within pool
members x capacity, whatever peers send. Rejections are counted in `rejected`.

With `scaleout.prefix_key_file`, every prefix scorer hashes with a seed derived
from that secret (`keyed_seed`), so the keys on the bus cannot be matched against
the hashes of guessed prompts by anyone without the secret.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from servegate.pool.pool import Pool
from servegate.scaleout.bus import Bus
from servegate.scaleout.coalesce import Coalescer
from servegate.scaleout.codec import PREFIX, Message, PrefixInsert
from servegate.scaleout.settings import ScaleOutSettings
from servegate.scheduling.prefix.approx import InsertHook, PrefixCacheScorer
from servegate.scheduling.scheduler import Scheduler

MAX_BATCH = 64
MIN_KEY_BYTES = 16


def load_prefix_key(path: str) -> bytes:
    """The shared secret in `path` (surrounding whitespace stripped); ValueError when short."""
    key = Path(path).read_bytes().strip()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"scaleout.prefix_key_file {path}: at least {MIN_KEY_BYTES} bytes")
    return key


class PrefixSharing:
    def __init__(self, bus: Bus, settings: ScaleOutSettings) -> None:
        self.bus = bus
        self.settings = settings
        self.scorers: dict[tuple[str, str], PrefixCacheScorer] = {}
        self.pools: dict[str, Pool] = {}
        self.applied = 0
        self.unmatched = 0
        self.rejected: Counter[str] = Counter()
        """Remote insertions ignored: `address` (not a pool member), `keys` (too many)."""
        self.seed_key = (
            load_prefix_key(settings.prefix_key_file) if settings.prefix_key_file else None
        )
        self._pending: dict[str, list[PrefixInsert]] = {}
        self._coalesce = Coalescer(settings.coalesce_s, self.flush)
        bus.on(PREFIX, self.on_insertions)

    def attach(self, runtimes: Iterable[tuple[str, Pool, Scheduler]]) -> None:
        """Hook every approximate prefix scorer of each pool's scheduler (again after a reload)."""
        scorers: dict[tuple[str, str], PrefixCacheScorer] = {}
        pools: dict[str, Pool] = {}
        for pool_name, pool, scheduler in runtimes:
            pools[pool_name] = pool
            for name, plugin in scheduler.plugins.items():
                inner = getattr(plugin, "source", None)  # approx-prefix-cache-producer
                if isinstance(inner, PrefixCacheScorer):
                    plugin = inner
                elif not isinstance(plugin, PrefixCacheScorer) or plugin.producer is not None:
                    continue
                plugin.on_insert = self._hook(pool_name, name)
                plugin.seed_key = self.seed_key
                scorers[(pool_name, name)] = plugin
        self.scorers = scorers
        self.pools = pools

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
            pool = self.pools.get(msg.pool)
            if scorer is None or pool is None:
                self.unmatched += 1
                continue
            state = pool.get(item.address)
            if state is None:
                self.rejected["address"] += 1
                continue
            if len(item.keys) > scorer.params.max_prefix_blocks_to_match:
                self.rejected["keys"] += 1
                continue
            scorer.index.insert(item.address, item.keys, scorer.capacity_for(state))
            self.applied += 1
