"""Approximate-prefix insertions shared between processes.

After each routing decision the `prefix-cache-scorer` inserts the prompt's block
keys into its index, which the pool's `RoutingState` owns, and the state tells its
subscribers; this module subscribes to each pool's state (no plugin is patched), buffers
the insertion (coalesced over `coalesce_s`) and publishes it. A receiver inserts the
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
from servegate.scheduling.prefix.approx import PrefixCacheScorer
from servegate.scheduling.routing_state import InsertListener, RoutingState
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
        self._subscribed: dict[int, tuple[RoutingState, InsertListener]] = {}
        """id(state) → (the pool's routing state, the listener subscribed to it)."""
        self._coalesce = Coalescer(settings.coalesce_s, self.flush)
        bus.on(PREFIX, self.on_insertions)

    def attach(self, runtimes: Iterable[tuple[str, Pool, Scheduler]]) -> None:
        """Follow every approximate prefix scorer of each pool's scheduler (again after a
        reload): subscribe to the routing state that owns its index, and key its seed."""
        scorers: dict[tuple[str, str], PrefixCacheScorer] = {}
        pools: dict[str, Pool] = {}
        states: dict[int, tuple[str, RoutingState]] = {}
        for pool_name, pool, scheduler in runtimes:
            pools[pool_name] = pool
            for name, plugin in scheduler.plugins.items():
                inner = getattr(plugin, "source", None)  # approx-prefix-cache-producer
                if isinstance(inner, PrefixCacheScorer):
                    plugin = inner
                elif not isinstance(plugin, PrefixCacheScorer) or plugin.producer is not None:
                    continue
                states[id(plugin.routing)] = (pool_name, plugin.routing)
                scorers[(pool_name, name)] = plugin
        self.scorers = scorers
        self.pools = pools
        for key in [k for k in self._subscribed if k not in states]:
            state, listener = self._subscribed.pop(key)
            state.unsubscribe(listener)
        for key, (pool_name, state) in states.items():
            state.seed_key = self.seed_key
            if key not in self._subscribed:
                listener = self._listener(pool_name)
                state.subscribe(listener)
                self._subscribed[key] = (state, listener)

    def stop(self) -> None:
        self._coalesce.cancel()
        for state, listener in self._subscribed.values():
            state.unsubscribe(listener)
        self._subscribed.clear()

    def _listener(self, pool_name: str) -> InsertListener:
        def inserted(plugin: str, address: str, keys: Sequence[int], capacity: int | None) -> None:
            if (pool_name, plugin) not in self.scorers:
                return  # an index no peer shares (a filter's own): nothing to publish
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
            # a peer's keys come from the same scorer's `block_keys`: a hash chain
            scorer.index.insert(item.address, item.keys, scorer.capacity_for(state), chained=True)
            self.applied += 1
