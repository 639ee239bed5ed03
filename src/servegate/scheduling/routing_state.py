"""A pool's learned routing state: prefix indexes, session bindings and no-hit-lru's cold
placements, with one owner.

What the prefix scorers and session affinity learn (what was routed where, which blocks
each replica holds, which session sticks to which replica) belongs to the pool, not to
the plugin instances that read it: a picker reload builds new plugins, and they must
find what the old ones learned. The pool's state (`gateway/pools.py`, `PoolState`)
owns one `RoutingState` and hands it to every plugin through
`PluginContext.services[ROUTING_STATE_SERVICE]`; a plugin built without it (a test, a
benchmark) gets a private one.

Each piece is kept under its plugin's name and a fingerprint of the settings that shape
it (an index's capacity and block size, a session table's size): a reload that keeps
both gets the same object, one that changes them gets a fresh one. Writers outside the
scheduler go through this object too: the KV-event manager feeds the precise indexes it
is given from here, and scale-out subscribes to approximate-prefix insertions
(`subscribe`) and sets the keyed seed (`seed_key`) instead of patching plugins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from servegate.scheduling.factory import PluginContext

T = TypeVar("T")

ROUTING_STATE_SERVICE = "routing-state"
"""`PluginContext.services` key of the pool's `RoutingState`."""
APPROX_INDEX = "approx-prefix-index"
PRECISE_INDEX = "precise-prefix-index"
SESSION_BINDINGS = "session-bindings"
NO_HIT_PLACEMENTS = "no-hit-placements"

InsertListener = Callable[[str, str, Sequence[int], int | None], None]
"""`listener(plugin name, address, keys, capacity)` after a routing decision inserts
block keys into an approximate prefix index."""


class RoutingState:
    """One pool's prefix indexes and session bindings, by plugin name; see the module."""

    __slots__ = ("_pieces", "listeners", "seed_key")

    def __init__(self) -> None:
        self._pieces: dict[tuple[str, str], tuple[str, object]] = {}
        self.listeners: list[InsertListener] = []
        """Who hears of local insertions (`subscribe`); read-only outside this class (a
        plugin skips `inserted` while it is empty)."""
        self.seed_key: bytes | None = None
        """Scale-out's shared secret (`scaleout.prefix_key_file`): approximate block keys
        chain from a seed keyed with it, so keys on the bus reveal no prompt."""

    def shared(
        self, kind: str, name: str, fingerprint: str, cls: type[T], build: Callable[[], T]
    ) -> T:
        """The `kind` piece of plugin `name` (an index, a session table): the one kept when
        its `fingerprint` is unchanged, else a fresh one from `build`, kept from now on."""
        key = (kind, name)
        found = self._pieces.get(key)
        if found is not None and found[0] == fingerprint and isinstance(found[1], cls):
            return found[1]
        piece = build()
        self._pieces[key] = (fingerprint, piece)
        return piece

    def subscribe(self, listener: InsertListener) -> None:
        """Call `listener` after every local approximate-prefix insertion (scale-out)."""
        if listener not in self.listeners:
            self.listeners.append(listener)

    def unsubscribe(self, listener: InsertListener) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    def inserted(self, plugin: str, address: str, keys: Sequence[int], cap: int | None) -> None:
        """A routing decision inserted `keys` for `address` into `plugin`'s index."""
        for listener in self.listeners:
            listener(plugin, address, keys, cap)


def routing_state(ctx: PluginContext) -> RoutingState:
    """The pool's `RoutingState` from `ctx.services`, else a private one (a plugin built
    outside a gateway: a test, a benchmark)."""
    found = ctx.services.get(ROUTING_STATE_SERVICE)
    return found if isinstance(found, RoutingState) else RoutingState()
