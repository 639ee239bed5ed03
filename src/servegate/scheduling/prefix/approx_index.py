"""The approximate prefix index: per-endpoint LRUs of the block keys the router sent there.

Apart from `approx.py` (the scorer and its llm-d parameters, pydantic models, which mypyc
cannot compile) so that mypyc compiles it (native.txt): `insert` and `match_lengths` run
per request over every block of the prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

CHAIN_RECORD_BLOCKS = 4096
"""Blocks of recently inserted chains an endpoint's LRU remembers whole (`ServerLRU.chains`):
16 prompts of 256 blocks. A hash chain's record is a few counters; only a list that is
not one keeps a copy of its keys, to compare."""


class ServerLRU:
    """Block keys one endpoint is believed to hold, least recently used first.

    Besides the keys it remembers the chains recently inserted whole (`chains`, by last
    key), so that matching a prompt sent here before need not walk its blocks: a chain
    is still held whole while nothing could have pushed its oldest block out of the LRU
    (`holds_whole`).
    """

    __slots__ = ("capacity", "chains", "evictions", "keys", "recorded", "touches")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()
        self.touches = 0
        """Keys inserted or refreshed so far (each may move an older key behind others)."""
        self.evictions = 0
        """Insertions that may have dropped keys for capacity (those that left the LRU full;
        counted per call, not per key, to keep the insertion loop as it was)."""
        self.chains: OrderedDict[int, _Chain] = OrderedDict()
        self.recorded = 0
        """Blocks the chains in `chains` cover, kept under `CHAIN_RECORD_BLOCKS` and
        `capacity` (oldest chains go first)."""

    def record(self, keys: Sequence[int], chained: bool) -> None:
        """Remember that `keys` were all just inserted or refreshed, in order; `chained`:
        they are a hash chain (`hashing.py`), whose last key stands for the whole chain."""
        n = len(keys)
        bound = min(self.capacity, CHAIN_RECORD_BLOCKS)
        if not n or n > bound:
            return  # (a chain longer than the LRU lost its first blocks while it went in)
        chains = self.chains
        last = keys[-1]
        old = chains.get(last)
        if old is not None and chained and old.keys is None and old.length == n:
            # the same hash chain again: its record, updated in place, becomes the newest
            old.touches = self.touches
            old.evictions = self.evictions
            old.ahead = len(self.keys) - n
            chains.move_to_end(last)
        else:
            if old is not None:
                del chains[last]
                self.recorded -= old.length
            kept = None if chained else list(keys)
            chains[last] = _Chain(kept, n, self.touches, self.evictions, len(self.keys) - n)
            self.recorded += n
        while self.recorded > bound:
            self.recorded -= chains.popitem(last=False)[1].length

    def holds_whole(
        self, keys: Sequence[int], chained: bool = False, length: int | None = None
    ) -> bool:
        """Whether the first `length` (default: all) of `keys` are certainly all still held,
        as a chain inserted whole (False = unknown: walk them).

        Right after `record`, the chain's keys are the newest in the LRU, with at least
        `ahead` keys older than all of them. Only an eviction removes a key, and it takes
        the oldest, so the chain loses a key only once every older key has been evicted
        or refreshed to the back, and one eviction more. Each eviction follows the
        insertion of a new key, so that takes more than `ahead` insertions and refreshes:
        the chain is whole while no insertion since could have evicted, or while there
        were at most `ahead` of them.

        Two hash chains with the same last key and length are the same chain (the index
        already takes equal keys for equal prefixes); anything else is compared key by key.
        """
        n = len(keys) if length is None else length
        chain = self.chains.get(keys[n - 1])
        if chain is None or chain.length != n:
            return False
        if self.evictions != chain.evictions and self.touches - chain.touches > chain.ahead:
            return False
        if chain.keys is None:
            return chained
        return chain.keys == list(keys[:n])


@dataclass(slots=True)
class _Chain:
    """One chain inserted whole into one endpoint's LRU, and the LRU's counters just after
    (updated in place when the same chain is inserted again with nothing in between)."""

    keys: list[int] | None
    """The chain's keys, kept only when it was not a hash chain (to compare key by key)."""
    length: int
    touches: int
    evictions: int
    ahead: int
    """Keys the LRU held that are not in the chain (a lower bound, with repeated keys)."""


class ApproxPrefixIndex:
    """Per-endpoint LRUs plus a reverse map key → endpoints, for one pass per prompt.

    A key one endpoint holds alone (most keys: a prompt's blocks go where it was routed)
    maps to that endpoint's one shared `frozenset`, so recording a new block allocates no
    set (and leaves the garbage collector no container per block to walk); a second
    holder turns it into a set of its own.
    """

    def __init__(self, default_capacity: int) -> None:
        self.default_capacity = default_capacity
        self._servers: dict[str, ServerLRU] = {}
        self._where: dict[int, set[str] | frozenset[str]] = {}
        self._alone: dict[str, frozenset[str]] = {}
        """address → `frozenset({address})`, the holders of each key it holds alone."""

    def __len__(self) -> int:
        return sum(len(s.keys) for s in self._servers.values())

    def insert(
        self,
        address: str,
        keys: Sequence[int],
        capacity: int | None = None,
        *,
        chained: bool = False,
    ) -> None:
        """Record `keys` as held by `address`, most recent last; `chained`: they are a hash
        chain from `hashing.py` (see `ServerLRU.holds_whole`)."""
        lru = self._servers.get(address)
        if lru is None:
            lru = self._servers[address] = ServerLRU(capacity or self.default_capacity)
        elif capacity is not None:
            lru.capacity = capacity
        held = lru.keys
        again = lru.chains.get(keys[-1]) if chained and keys else None
        if (
            again is not None
            and again.touches == lru.touches
            and again.length == len(keys)
            and again.keys is None
        ):
            # this chain was the last thing inserted here and nothing touched the LRU since:
            # its keys are already the newest, in this order, so refreshing them would move
            # nothing (the same prompt sent to the same replica again); counters as below
            pass
        else:
            where = self._where
            setdefault, pop = where.setdefault, where.pop
            limit = lru.capacity
            refresh = held.move_to_end
            alone = self._alone.get(address)
            if alone is None:
                alone = self._alone[address] = frozenset((address,))
            evict = held.popitem
            room = limit - len(held)  # `limit - len(held)` throughout, without a call per key
            for key in keys:
                if key in held:
                    refresh(key)  # held already, so `where` names this address for it
                    continue
                held[key] = None
                # one look-up: `alone` is this address's, and it does not hold `key` yet
                holders = setdefault(key, alone)
                if holders is not alone:
                    if type(holders) is set:
                        holders.add(address)
                    else:
                        where[key] = {*holders, address}
                room -= 1
                if room < 0:
                    # one look-up for the usual key held alone (by this address); a shared
                    # key's set goes back without this address
                    room += 1
                    evicted = evict(last=False)[0]
                    gone = pop(evicted, None)
                    if type(gone) is set:
                        gone.discard(address)
                        if gone:
                            where[evicted] = gone
        if len(held) >= lru.capacity:
            lru.evictions += 1  # this call may have evicted: every eviction leaves it full
        lru.touches += len(keys)
        lru.record(keys, chained)

    def remove_server(self, address: str) -> None:
        lru = self._servers.pop(address, None)
        if lru is None:
            return
        self._alone.pop(address, None)
        where = self._where
        for key in lru.keys:
            holders = where.get(key)
            if holders is None:
                continue
            if type(holders) is set:
                holders.discard(address)
                if not holders:
                    del where[key]
            else:  # held alone, by this address
                del where[key]

    def deepest_holders(self, keys: Sequence[int], limit: int) -> list[str]:
        """Up to `limit` endpoints holding the longest leading runs of `keys`, deepest first.

        A chain is stored whole, so the deepest held block is found by bisection;
        then levels are walked back towards the first block at doubling strides
        until `limit` endpoints are named. No pass over the pool.
        """
        where = self._where
        if not keys or not where.get(keys[0]):
            return []
        out: dict[str, None] = {}
        i, stride = self._held_run(keys) - 1, 1
        while i >= 0:
            for address in where.get(keys[i], ()):
                out[address] = None
                if len(out) >= limit:
                    return list(out)
            if i == 0:
                break
            i, stride = max(0, i - stride), stride * 2
        return list(out)

    def _held_run(self, keys: Sequence[int]) -> int:
        """A length `n` (by bisection; `keys[0]` must be held) such that some endpoint holds
        `keys[n - 1]` and, unless `n` is all of them, no endpoint holds `keys[n]`."""
        where = self._where
        lo, hi = 1, len(keys)
        while lo < hi:
            mid = (lo + hi) // 2
            if where.get(keys[mid]):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def holds(self, key: int) -> bool:
        """Whether any endpoint holds block `key`."""
        return bool(self._where.get(key))

    def match_lengths(
        self, keys: Sequence[int], addresses: Sequence[str], *, chained: bool = False
    ) -> dict[str, int]:
        """Leading blocks of `keys` (a hash chain when `chained`) each address holds.

        Bisection (or, when someone holds the last block, the whole length) finds a length
        `n` whose last block someone holds and whose next block nobody does, so no match is
        longer. An address that had the first `n` blocks
        inserted as a chain, and cannot have lost any of them since
        (`ServerLRU.holds_whole`), matches exactly `n` without a walk: a prompt sent again
        to the replicas that hold it, or one that continues the conversation they were
        sent, costs a dict look-up per holder. The others are walked with one set
        operation per block while the holders stay the same (a subset check, in C);
        addresses are written out only when they drop off or at the end.
        """
        matched = dict.fromkeys(addresses, 0)
        where = self._where
        if not keys:
            return matched
        alive = set(addresses).intersection(where.get(keys[0], ()))
        if not alive:
            return matched
        servers = self._servers
        # someone holds the last block: no match is longer than all of it (the same prompt
        # sent again), so no bisection; any `n` with this property gives the same matches
        run = len(keys) if where.get(keys[-1]) else self._held_run(keys)
        whole = [a for a in alive if servers[a].holds_whole(keys, chained, run)]
        if whole:
            for address in whole:
                matched[address] = run
            alive.difference_update(whole)
            if not alive:  # every holder answered from its record: no walk
                return matched
        depth = 1
        for key in keys[1:]:
            if not alive:
                return matched
            holders = where.get(key)
            if holders is None:
                break
            if not alive <= holders:
                still = alive & holders
                for address in alive - still:
                    matched[address] = depth
                alive = still
            depth += 1
        for address in alive:
            matched[address] = depth
        return matched
