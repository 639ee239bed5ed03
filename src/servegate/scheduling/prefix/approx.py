"""Approximate prefix-cache scoring (the Gateway API Inference Extension's original design).

The router cannot see replicas' caches, so it remembers what it sent where: at
dispatch the prompt's block keys go into the chosen endpoint's LRU (capacity
`lruCapacityPerServer` blocks, or the engine's own block count with `autoTune`).
An endpoint's score is the number of leading blocks of the new prompt found in
its LRU divided by the prompt's block count.

Blocks are `blockSizeTokens` tokens. With token ids in the request (a completion
sent as ids, or a tokenizer that ran earlier) blocks are token blocks; otherwise
they are `blockSizeTokens × 4` characters (the usual ~4 characters per token), or
the legacy `blockSize` characters when that llm-d parameter is given.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

import xxhash
from pydantic import Field, model_validator

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.factory import Parameters, PluginContext, decode_parameters
from servegate.scheduling.framework import CycleState, Decision
from servegate.scheduling.prefix.hashing import (
    RecentChains,
    chain_seed,
    keyed_seed,
    token_block_hashes,
)
from servegate.scheduling.prefix.lookup import already_scored, find_prefix_producer, prefix_scores
from servegate.scheduling.request import LLMRequest
from servegate.scheduling.routing_state import APPROX_INDEX, RoutingState, routing_state

CHARS_PER_TOKEN = 4
HASHES_KEY = "prefix.approx.hashes"
PARTIAL_KEY = "token_ids_partial"
"""`token_ids` are those of a leading part of the prompt; `prompt_tokens` estimates the whole."""


class ApproxPrefixParameters(Parameters):
    auto_tune: bool = Field(True, alias="autoTune")
    block_size_tokens: int = Field(16, alias="blockSizeTokens", ge=1)
    block_size: int | None = Field(None, alias="blockSize", ge=1)
    """Deprecated llm-d field: block size in characters."""
    hash_block_size: int | None = Field(None, alias="hashBlockSize", ge=1)
    """The Gateway API Inference Extension's name of the same: characters per block."""
    max_prefix_blocks_to_match: int = Field(256, alias="maxPrefixBlocksToMatch", ge=1)
    lru_capacity_per_server: int = Field(31250, alias="lruCapacityPerServer", ge=1)
    cold_placement: Literal["none", "hash"] = Field("none", alias="coldPlacement")
    """servegate: `hash` scores 1.0 for one endpoint chosen by the prompt's first block
    (rendezvous hashing) when no endpoint has any of its blocks, so that routers that
    cannot hear each other in time place a new prefix on the same replica."""

    @model_validator(mode="after")
    def _one_char_size(self) -> Self:
        if self.block_size is not None and self.hash_block_size is not None:
            raise ValueError("blockSize and hashBlockSize are the same setting; keep one")
        return self

    def chars_per_block(self) -> int:
        return self.block_size or self.hash_block_size or self.block_size_tokens * CHARS_PER_TOKEN


class ScorerParameters(ApproxPrefixParameters):
    """`prefix-cache-scorer`: its own index's parameters, or the producer it reads."""

    prefix_match_info_producer_name: str | None = Field(
        None, alias="prefixMatchInfoProducerName", min_length=1
    )


INDEX_FIELDS = frozenset(ApproxPrefixParameters.model_fields)
SEEDS_KEPT = 1024
"""Chain seeds a prefix scorer remembers (per model, adapter and scale-out key); past that
it forgets them all and starts again (model names come from clients)."""
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


class PrefixCacheScorer:
    """`prefix-cache-scorer`: matched leading blocks / prompt blocks, from routing history.

    With `prefixMatchInfoProducerName` (or, when it has no parameters, with a producer
    declared under the type name `approx-prefix-cache-producer` /
    `precise-prefix-cache-producer`) it is llm-d's consumer: it scores with the
    producer's match and keeps no index of its own.
    """

    type: ClassVar[str] = "prefix-cache-scorer"

    def __init__(
        self,
        name: str,
        params: ApproxPrefixParameters,
        producer_name: str | None = None,
        own_index_configured: bool = True,
        routing: RoutingState | None = None,
    ) -> None:
        self.name = name
        self.params = params
        self._hashes_key = (
            f"{HASHES_KEY}/{params.block_size_tokens}/{params.chars_per_block()}"
            f"/{params.max_prefix_blocks_to_match}"
        )
        """Where `block_keys` keeps the prompt's keys in `request.cache` (shared by the
        scorers and filters that block the prompt the same way)."""
        self.routing = routing if routing is not None else RoutingState()
        """The pool's learned state, which owns this scorer's index (so it survives a picker
        reload) and tells scale-out about local insertions."""
        self.index = self.routing.shared(
            APPROX_INDEX,
            name,
            params.model_dump_json(),
            ApproxPrefixIndex,
            lambda: ApproxPrefixIndex(params.lru_capacity_per_server),
        )
        self.producer_name = producer_name
        self.producer: Any = None
        """The `PrefixProducer` this scorer reads, once bound; None = its own index."""
        self._may_bind_default = producer_name is None and not own_index_configured
        self._chars_per_block = params.chars_per_block()
        self._recent = RecentChains(self._chars_per_block, params.max_prefix_blocks_to_match)
        self._seeds: dict[tuple[str, str | None, bytes | None], int] = {}

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(ScorerParameters, cls.type, name, parameters)
        index_given = bool(p.model_fields_set & INDEX_FIELDS)
        if p.prefix_match_info_producer_name is not None and index_given:
            raise ValueError(
                f"plugin {name!r}: with prefixMatchInfoProducerName the index parameters "
                "belong to the producer; remove "
                + ", ".join(
                    sorted(
                        str(ApproxPrefixParameters.model_fields[f].alias)
                        for f in p.model_fields_set & INDEX_FIELDS
                    )
                )
            )
        index = ApproxPrefixParameters.model_validate(
            p.model_dump(by_alias=True, exclude={"prefix_match_info_producer_name"})
        )
        return cls(name, index, p.prefix_match_info_producer_name, index_given, routing_state(ctx))

    @property
    def seed_key(self) -> bytes | None:
        """Scale-out's shared secret, when set on the pool's state: keys chain from a keyed seed."""
        return self.routing.seed_key

    def bind_plugins(self, plugins: Mapping[str, Any]) -> None:
        if self.producer_name is None and not self._may_bind_default:
            return
        self.producer = find_prefix_producer(
            plugins, self.producer_name, "prefixMatchInfoProducerName"
        )

    def _seed(self, request: LLMRequest) -> int:
        """The chain's seed for the request's model and adapter, remembered per (model,
        adapter, scale-out key): a handful of values, each computed once."""
        secret = self.routing.seed_key
        memo = (request.base_model, request.lora, secret)
        seed = self._seeds.get(memo)
        if seed is None:
            seed = chain_seed(request.base_model, request.lora)
            if secret is not None:
                seed = keyed_seed(secret, seed)
            if len(self._seeds) >= SEEDS_KEPT:
                self._seeds.clear()
            self._seeds[memo] = seed
        return seed

    def block_keys(self, request: LLMRequest) -> list[int]:
        p = self.params
        cache_key = self._hashes_key
        cached = request.cache.get(cache_key)
        if cached is not None:
            keys: list[int] = cached
            return keys
        seed = self._seed(request)
        tokens = request.cache.get("token_ids")
        if tokens is not None:
            keys = token_block_hashes(
                tokens, p.block_size_tokens, seed, p.max_prefix_blocks_to_match
            )
            if request.cache.get(PARTIAL_KEY):
                keys = self._pad(request, keys)
        else:
            keys = self._recent.keys(request.prompt, seed)
        request.cache[cache_key] = keys
        return keys

    def _pad(self, request: LLMRequest, keys: list[int]) -> list[int]:
        """Ids of a cached leading part only: the rest of the prompt still fills the replica's
        cache, so it gets keys of its own (from the request id) that no other prompt shares."""
        p = self.params
        total = min(request.prompt_tokens // p.block_size_tokens, p.max_prefix_blocks_to_match)
        if total <= len(keys):
            return keys
        out = list(keys)
        prev = xxhash.xxh3_64_intdigest(request.request_id.encode(), out[-1] if out else 0)
        for _ in range(total - len(keys)):
            prev = xxhash.xxh3_64_intdigest(b"pad", prev)
            out.append(prev)
        return out

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> Sequence[float]:
        if self.producer is not None:
            return prefix_scores(cycle, self.producer.source, request, endpoints)
        known = already_scored(cycle, self.name, endpoints)
        if known is not None:
            return known
        return self.match(request, endpoints)

    def match(self, request: LLMRequest, endpoints: list[EndpointState]) -> list[float]:
        """`score` from this scorer's own index, computed anew (no producer, no sharing)."""
        keys = self.block_keys(request)
        if not keys:
            return [0.0] * len(endpoints)
        if self.index.holds(keys[0]):
            addresses = [e.endpoint.address for e in endpoints]
            matched = self.index.match_lengths(keys, addresses, chained=True)
            total = len(keys)
            scores = [matched[a] / total for a in addresses]
        else:  # nobody holds the first block: nothing matches (no pass over the endpoints)
            scores = [0.0] * len(endpoints)
        if self.params.cold_placement == "hash" and endpoints and not any(scores):
            first = keys[0].to_bytes(8, "little", signed=False)
            ranks = [xxhash.xxh3_64_intdigest(first + e.address.encode()) for e in endpoints]
            scores[ranks.index(max(ranks))] = 1.0
        return scores

    def shortlist(self, cycle: CycleState, request: LLMRequest, limit: int) -> list[str] | None:
        """The replicas holding this prompt's longest prefixes; `None` under hashed cold
        placement, whose rendezvous choice needs every candidate."""
        if self.producer is not None:
            ask = getattr(self.producer.source, "shortlist", None)
            return None if ask is None else ask(cycle, request, limit)
        keys = self.block_keys(request)
        holders = self.index.deepest_holders(keys, limit)
        if not holders and self.params.cold_placement == "hash":
            return None
        return holders

    def capacity_for(self, state: EndpointState) -> int | None:
        """The LRU size for `state`: from the engine's block count with `autoTune`, else None
        (the index's default `lruCapacityPerServer`)."""
        if not self.params.auto_tune:
            return None
        m = state.metrics
        if not m.num_blocks or not m.block_size:
            return None
        # engine blocks of block_size tokens → our blocks of block_size_tokens tokens
        return max(1, m.num_blocks * m.block_size // self.params.block_size_tokens)

    def pre_request(self, request: LLMRequest, decision: Decision, now: float) -> None:
        if self.producer is not None:
            return  # the producer records the decision
        keys = self.block_keys(request)
        if not keys:
            return
        routing = self.routing
        for state in (decision.endpoint, decision.prefill):
            if state is not None:
                capacity = self.capacity_for(state)
                address = state.endpoint.address
                self.index.insert(address, keys, capacity, chained=True)
                if routing.listeners:  # (scale-out shares insertions)
                    routing.inserted(self.name, address, keys, capacity)
