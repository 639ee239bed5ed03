"""Exact prefix-cache scoring from the engines' own KV events (llm-d's precise producer).

The index learns what every replica holds from its `BlockStored`, `BlockRemoved`
and `AllBlocksCleared` events. It never interprets an engine's block hash: when
`BlockStored` arrives, it computes its *own* key for each stored block, a chained
xxh3 hash of the block's token ids (`hashing.token_block_hashes`) continuing from
the key it gave the parent block (or from a seed of the LoRA adapter for a
first block), and remembers engine hash → own key for that replica. A prompt's
keys, computed the same way from its token ids, then find the replicas holding
each block. So the engine's hash algorithm and seed never matter, only that the
router's token ids equal the engine's (same tokenizer, same chat template).

Scoring follows llm-d's longest-prefix scorer: walking the prompt's blocks from
the first, each replica adds the weight of the best tier holding the block
(`GPU` 1.0, `CPU` 0.8 by default) until its first miss; score = that sum / the
prompt's full blocks. Keys are seeded per LoRA adapter and not per model: every
entry belongs to one replica and only replicas serving the request's model are
candidates, so models cannot mix.

Memory is bounded: each replica keeps at most `maxBlocksPerEndpoint` engine
blocks, least recently stored dropped first (the engine evicts its own cache in
about that order). With `speculativeIndexing`, the blocks of a routed prompt
count as held by its replica for `speculativeTTL`, or until an event about the
block on that replica (stored, removed, cleared) replaces the guess; this closes
the gap between a decision and the events it causes.
"""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from pydantic import Field, field_validator, model_validator

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.factory import Parameters, PluginContext, decode_parameters
from servegate.scheduling.framework import CycleState, Decision, Plugin
from servegate.scheduling.prefix.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from servegate.scheduling.prefix.hashing import chain_seed, token_block_hashes
from servegate.scheduling.request import LLMRequest
from servegate.scheduling.routing_state import PRECISE_INDEX, RoutingState, routing_state

DEFAULT_TIER_WEIGHTS = {"gpu": 1.0, "cpu": 0.8}
MAX_TIERS = 8
KEYS_KEY = "prefix.precise.keys"
_UNLIMITED = 1 << 30


# -- parameters (llm-d's names; see docs/plugins.md) ---------------------------------


class TokenProcessorConfig(Parameters):
    block_size: int = Field(16, alias="blockSize", ge=1)
    """Tokens per block when a replica has published neither events nor its geometry."""
    block_size_tokens: int | None = Field(None, alias="blockSizeTokens", ge=1)
    """The current llm-d name of `blockSize`."""
    hash_seed: str = Field("", alias="hashSeed")
    """Accepted for llm-d compatibility; unused (servegate computes its own keys)."""

    @model_validator(mode="after")
    def _one_size(self) -> Self:
        if self.block_size_tokens is not None and "block_size" in self.model_fields_set:
            raise ValueError("blockSize and blockSizeTokens are the same setting; keep one")
        return self

    @property
    def tokens_per_block(self) -> int:
        return self.block_size_tokens or self.block_size


def _go_duration(value: str | int | None) -> str | int | None:
    """A Go `time.Duration`: a string (`60s`) or, as Go's JSON writes it, integer nanoseconds."""
    if value is None:
        return None
    if isinstance(value, int):
        if value <= 0:
            raise ValueError("a duration in nanoseconds must be > 0")
        return value
    parse_duration(value)
    return value


class InMemoryConfig(Parameters):
    size: int = Field(100_000_000, ge=1)
    pod_cache_size: int = Field(10, alias="podCacheSize", ge=1)


class KVBlockIndexConfig(Parameters):
    in_memory_config: InMemoryConfig | None = Field(None, alias="inMemoryConfig")
    enable_metrics: bool = Field(False, alias="enableMetrics")
    metrics_logging_interval: str | int | None = Field(None, alias="metricsLoggingInterval")
    """Accepted for llm-d compatibility (a Go duration: `60s` or integer nanoseconds);
    servegate exports the index counters on /metrics instead of logging them."""
    max_prefix_blocks_to_match: int | None = Field(None, alias="maxPrefixBlocksToMatch", ge=1)
    """At most this many leading blocks of a prompt are looked up (and count in the score)."""

    @field_validator("metrics_logging_interval")
    @classmethod
    def _interval(cls, value: str | int | None) -> str | int | None:
        return _go_duration(value)


class PrefixStoreConfig(Parameters):
    """Older llm-d layout: the tokenization prefix cache; servegate keeps its own."""

    cache_size: int | None = Field(None, alias="cacheSize", ge=1)
    block_size: int | None = Field(None, alias="blockSize", ge=1)


class BackendConfig(Parameters):
    name: str = Field(min_length=1)
    weight: float = Field(ge=0.0, le=1.0)


class IndexerConfig(Parameters):
    kv_block_index_config: KVBlockIndexConfig | None = Field(None, alias="kvBlockIndexConfig")
    backend_configs: list[BackendConfig] | None = Field(None, alias="kvCacheBackendConfigs")
    tokenizers_pool_config: dict[str, Any] | None = Field(None, alias="tokenizersPoolConfig")
    """Accepted for llm-d compatibility; servegate tokenises per the pool's `tokenizer`."""
    token_processor_config: TokenProcessorConfig | None = Field(None, alias="tokenProcessorConfig")
    """The older layout: `tokenProcessorConfig` inside `indexerConfig`."""
    prefix_store_config: PrefixStoreConfig | None = Field(None, alias="prefixStoreConfig")


class PodDiscoveryConfig(Parameters):
    socket_port: int = Field(5557, alias="socketPort", ge=1, le=65535)


class KVEventsConfig(Parameters):
    zmq_endpoint: str | None = Field(None, alias="zmqEndpoint")
    """A SUB socket to bind (`tcp://*:5557`) that every engine publishes to; the
    topic's `@<host:port>@` part says which replica a batch is from."""
    topic_filter: str = Field("kv@", alias="topicFilter")
    concurrency: int = Field(4, ge=1)
    """Accepted for llm-d compatibility; unused."""
    discover_pods: bool = Field(False, alias="discoverPods")
    """Subscribe to `tcp://<replica host>:<socketPort>` of every replica."""
    pod_discovery_config: PodDiscoveryConfig | None = Field(None, alias="podDiscoveryConfig")
    engine_type: str = Field("vllm", alias="engineType")

    @field_validator("engine_type")
    @classmethod
    def _engine(cls, value: str) -> str:
        if value not in ("vllm", "sglang"):
            raise ValueError("engineType must be vllm or sglang (both use the same encodings)")
        return value


class PrecisePrefixParameters(Parameters):
    token_processor_config: TokenProcessorConfig = Field(
        default_factory=lambda: TokenProcessorConfig.model_validate({}),
        alias="tokenProcessorConfig",
    )
    indexer_config: IndexerConfig | None = Field(None, alias="indexerConfig")
    kv_events_config: KVEventsConfig | None = Field(None, alias="kvEventsConfig")
    speculative_indexing: bool = Field(False, alias="speculativeIndexing")
    speculative_ttl: str = Field("2s", alias="speculativeTTL")
    max_blocks_per_endpoint: int = Field(131_072, alias="maxBlocksPerEndpoint", ge=1)
    """servegate: engine blocks remembered per replica (LRU)."""

    @model_validator(mode="after")
    def _one_token_processor(self) -> Self:
        nested = self.indexer_config.token_processor_config if self.indexer_config else None
        if nested is not None and "token_processor_config" in self.model_fields_set:
            raise ValueError(
                "tokenProcessorConfig is given twice (top level and inside indexerConfig); "
                "keep the top-level one"
            )
        return self

    def token_processor(self) -> TokenProcessorConfig:
        """The token processor settings, from whichever layout the document uses."""
        nested = self.indexer_config.token_processor_config if self.indexer_config else None
        return nested or self.token_processor_config

    def max_prefix_blocks(self) -> int:
        index = self.indexer_config.kv_block_index_config if self.indexer_config else None
        limit = index.max_prefix_blocks_to_match if index is not None else None
        return limit or _UNLIMITED

    @field_validator("speculative_ttl")
    @classmethod
    def _ttl(cls, value: str) -> str:
        parse_duration(value)
        return value


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """A Go duration string (`2s`, `500ms`, `1m30s`) in seconds."""
    pos = 0
    total = 0.0
    for match in _DURATION.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNIT_S[match.group(2)]
        pos = match.end()
    if pos != len(text) or not text or total <= 0:
        raise ValueError(f"{text!r} is not a positive duration like 2s or 500ms")
    return total


# -- the index ---------------------------------------------------------------------


class _Entry:
    __slots__ = ("key", "tiers")

    def __init__(self, key: int, tiers: int) -> None:
        self.key = key
        self.tiers = tiers


@dataclass(slots=True)
class EndpointBlocks:
    """What one replica holds: engine hash → own key, least recently stored first."""

    address: str
    blocks: OrderedDict[BlockHash, _Entry] = field(default_factory=OrderedDict)
    block_size: int | None = None


@dataclass(slots=True)
class IndexStats:
    """Counters of the index; exported by the gateway with the KV-event stats."""

    stored_blocks: int = 0
    """Blocks added by `BlockStored`."""
    removed_blocks: int = 0
    """Blocks dropped by `BlockRemoved`."""
    evicted_blocks: int = 0
    """Blocks dropped to stay within `maxBlocksPerEndpoint`."""
    clears: int = 0
    """`AllBlocksCleared` events and publisher restarts."""
    unknown_parent: int = 0
    """`BlockStored` events whose parent block the index never saw (dropped)."""
    unknown_removed: int = 0
    """`BlockRemoved` hashes the index did not hold."""


def _forget_waiting(
    waiting: dict[BlockHash, list[BlockStored]], removed: Sequence[BlockHash]
) -> None:
    """A removal later in the batch wins over a store still waiting for its parent."""
    gone = set(removed)
    for parent in list(waiting):
        kept = [e for e in waiting[parent] if gone.isdisjoint(e.block_hashes)]
        if kept:
            waiting[parent] = kept
        else:
            del waiting[parent]


def lora_seed(lora: str | None) -> int:
    return chain_seed("", lora)


class PreciseIndex:
    """Replica → blocks from KV events, and own key → holders for scoring."""

    def __init__(
        self,
        tier_weights: Mapping[str, float] | None = None,
        max_blocks_per_endpoint: int = 131_072,
    ) -> None:
        weights = dict(DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights)
        self._tiers: dict[str, int] = {}
        self._weights: list[float] = []
        for name, weight in weights.items():
            self._tier(name.lower(), weight)
        self.capacity = max_blocks_per_endpoint
        self.stats = IndexStats()
        self._endpoints: dict[str, EndpointBlocks] = {}
        self._holders: dict[int, dict[str, list[float]]] = {}
        self._spec: dict[int, dict[str, float]] = {}
        self._spec_log: deque[tuple[float, str, list[int]]] = deque()
        self._block_sizes: dict[int, int] = {}

    # -- sizes -------------------------------------------------------------------------
    def blocks(self, address: str) -> int:
        ep = self._endpoints.get(address)
        return 0 if ep is None else len(ep.blocks)

    def sizes(self) -> dict[str, int]:
        return {a: len(ep.blocks) for a, ep in self._endpoints.items()}

    def block_size(self, address: str) -> int | None:
        ep = self._endpoints.get(address)
        return None if ep is None else ep.block_size

    @property
    def speculative_entries(self) -> int:
        return sum(len(v) for v in self._spec.values())

    # -- writes (the KV-event subscriber) ----------------------------------------------
    def apply(self, address: str, batch: EventBatch) -> None:
        """One batch, in order; except that a `BlockStored` whose parent is stored later
        in the same batch waits for it. vLLM's offloading connector publishes one
        self-contained store per offloaded chunk in whatever order the copies completed,
        so a child's CPU store can precede its parent's when the GPU no longer holds it."""
        waiting: dict[BlockHash, list[BlockStored]] = {}
        for event in batch.events:
            if isinstance(event, BlockStored):
                if self._store(address, event):
                    if waiting:
                        self._link_waiting(address, event, waiting)
                elif event.parent_block_hash is not None:
                    waiting.setdefault(event.parent_block_hash, []).append(event)
            elif isinstance(event, BlockRemoved):
                if waiting:
                    _forget_waiting(waiting, event.block_hashes)
                self.remove(address, event)
            elif isinstance(event, AllBlocksCleared):
                waiting.clear()
                self.clear(address)
        self.stats.unknown_parent += sum(len(v) for v in waiting.values())

    def _link_waiting(
        self, address: str, event: BlockStored, waiting: dict[BlockHash, list[BlockStored]]
    ) -> None:
        """Store the waiting events whose parent `event` (or one they unblock) just stored."""
        ready = [event]
        while ready and waiting:
            for engine_hash in ready.pop().block_hashes:
                for child in waiting.pop(engine_hash, ()):
                    if self._store(address, child):
                        ready.append(child)

    def store(self, address: str, event: BlockStored) -> None:
        if not self._store(address, event):
            self.stats.unknown_parent += 1

    def _store(self, address: str, event: BlockStored) -> bool:
        """False when the parent block is unknown (nothing stored)."""
        ep = self._endpoints.get(address)
        if ep is None:
            ep = self._endpoints[address] = EndpointBlocks(address)
        if ep.block_size != event.block_size:
            self._count_block_size(ep.block_size, -1)
            self._count_block_size(event.block_size, 1)
            ep.block_size = event.block_size
        parent = event.parent_block_hash
        if parent is None:
            lora = event.lora_name
            if lora is None and event.lora_id is not None:
                lora = f"\x00lora-id:{event.lora_id}"
            prev = lora_seed(lora)
        else:
            entry = ep.blocks.get(parent)
            if entry is None:
                return False
            prev = entry.key
        hashes = event.block_hashes
        keys = token_block_hashes(event.token_ids, event.block_size, prev, len(hashes))
        tier = self._tier_of(event.medium)
        bit = 1 << tier
        blocks = ep.blocks
        for engine_hash, key in zip(hashes, keys, strict=False):
            entry = blocks.get(engine_hash)
            if entry is None:
                blocks[engine_hash] = _Entry(key, bit)
                self._hold(key, address, tier, 1)
                self.stats.stored_blocks += 1
            else:
                blocks.move_to_end(engine_hash)
                if entry.key != key:
                    self._drop_entry(address, entry)
                    entry.key, entry.tiers = key, 0
                if not entry.tiers & bit:
                    entry.tiers |= bit
                    self._hold(key, address, tier, 1)
        while len(blocks) > self.capacity:
            _, old = blocks.popitem(last=False)
            self._drop_entry(address, old)
            self.stats.evicted_blocks += 1
        return True

    def remove(self, address: str, event: BlockRemoved) -> None:
        ep = self._endpoints.get(address)
        tier = self._tier_of(event.medium)
        bit = 1 << tier
        for engine_hash in event.block_hashes:
            entry = None if ep is None else ep.blocks.get(engine_hash)
            if entry is not None and self._spec:
                self._unspeculate(entry.key, address)
            if entry is None or not entry.tiers & bit:
                self.stats.unknown_removed += 1
                continue
            entry.tiers &= ~bit
            self._hold(entry.key, address, tier, -1)
            self.stats.removed_blocks += 1
            if not entry.tiers:
                del ep.blocks[engine_hash]  # type: ignore[union-attr]

    def clear(self, address: str) -> None:
        """Forget every block of `address` (`AllBlocksCleared`, restart, removal)."""
        ep = self._endpoints.pop(address, None)
        if ep is not None:
            self._count_block_size(ep.block_size, -1)
        self.stats.clears += 1
        for key in [k for k, holders in self._spec.items() if address in holders]:
            self._unspeculate(key, address)
        if ep is None:
            return
        for entry in ep.blocks.values():
            self._drop_entry(address, entry)

    def _drop_entry(self, address: str, entry: _Entry) -> None:
        tiers = entry.tiers
        tier = 0
        while tiers:
            if tiers & 1:
                self._hold(entry.key, address, tier, -1)
            tiers >>= 1
            tier += 1

    def _hold(self, key: int, address: str, tier: int, delta: int) -> None:
        if self._spec:
            self._unspeculate(key, address)
        holders = self._holders.get(key)
        if holders is None:
            if delta < 0:
                return
            holders = self._holders[key] = {}
        holding = holders.get(address)
        if holding is None:
            if delta < 0:
                return
            holding = holders[address] = [0.0] * (len(self._weights) + 1)
        elif len(holding) <= tier + 1:
            holding.extend([0.0] * (tier + 2 - len(holding)))
        holding[tier + 1] += delta
        weights = self._weights
        best = 0.0
        for i in range(1, len(holding)):
            if holding[i] > 0 and weights[i - 1] > best:
                best = weights[i - 1]
        if best == 0.0 and not any(c > 0 for c in holding[1:]):
            del holders[address]
            if not holders:
                del self._holders[key]
            return
        holding[0] = best

    def _tier(self, name: str, weight: float) -> int:
        index = self._tiers.get(name)
        if index is None:
            index = self._tiers[name] = len(self._weights)
            self._weights.append(weight)
        return index

    def _tier_of(self, medium: str | None) -> int:
        name = "gpu" if medium is None else medium.lower()
        index = self._tiers.get(name)
        if index is not None:
            return index
        if len(self._weights) >= MAX_TIERS:
            return self._tiers.get("gpu", 0)
        return self._tier(name, 1.0)

    # -- speculative entries (the scorer's pre_request) ---------------------------------
    def speculate(self, address: str, keys: list[int], now: float, ttl: float) -> None:
        self.expire(now)
        until = now + ttl
        spec = self._spec
        for key in keys:
            holders = spec.get(key)
            if holders is None:
                spec[key] = {address: until}
            else:
                holders[address] = until
        self._spec_log.append((until, address, keys))

    def _unspeculate(self, key: int, address: str) -> None:
        """An event about this block on this replica replaces the guess either way."""
        holders = self._spec.get(key)
        if holders is not None and holders.pop(address, None) is not None and not holders:
            del self._spec[key]

    def expire(self, now: float) -> None:
        log = self._spec_log
        spec = self._spec
        while log and log[0][0] <= now:
            _, address, keys = log.popleft()
            for key in keys:
                holders = spec.get(key)
                if holders is not None and holders.get(address, now + 1.0) <= now:
                    del holders[address]
                    if not holders:
                        del spec[key]

    # -- reads (scoring) -----------------------------------------------------------------
    def match(self, keys: Sequence[int], addresses: Sequence[str], now: float) -> dict[str, float]:
        """Weighted consecutive leading blocks of `keys` each address holds."""
        scores = dict.fromkeys(addresses, 0.0)
        alive = set(addresses)
        holders_of = self._holders
        spec_of = self._spec
        for key in keys:
            holders = holders_of.get(key)
            spec = spec_of.get(key) if spec_of else None
            if holders is None and spec is None:
                break
            still = []
            for address in alive:
                weight = 0.0
                if holders is not None:
                    holding = holders.get(address)
                    if holding is not None:
                        weight = holding[0]
                if spec is not None and weight < 1.0:
                    until = spec.get(address)
                    if until is not None and until > now:
                        weight = 1.0
                if weight > 0.0:
                    scores[address] += weight
                    still.append(address)
            if not still:
                break
            alive.intersection_update(still)
        return scores

    def deepest_holders(self, keys: Sequence[int], limit: int) -> list[str]:
        """Up to `limit` replicas (stored or speculated) holding the longest leading runs of
        `keys`, deepest first: bisection for the deepest held block, then levels back
        towards the first at doubling strides. No pass over the pool."""
        holders_of, spec_of = self._holders, self._spec

        def held(key: int) -> bool:
            return bool(holders_of.get(key)) or bool(spec_of.get(key))

        if not keys or not held(keys[0]):
            return []
        lo, hi = 1, len(keys)
        while lo < hi:
            mid = (lo + hi) // 2
            if held(keys[mid]):
                lo = mid + 1
            else:
                hi = mid
        out: dict[str, None] = {}
        i, stride = lo - 1, 1
        while i >= 0:
            for source in (holders_of.get(keys[i]), spec_of.get(keys[i])):
                for address in source or ():
                    out[address] = None
                    if len(out) >= limit:
                        return list(out)
            if i == 0:
                break
            i, stride = max(0, i - stride), stride * 2
        return list(out)

    def block_sizes(self) -> Collection[int]:
        """Block sizes the replicas in the index reported."""
        return self._block_sizes.keys()

    def _count_block_size(self, size: int | None, delta: int) -> None:
        if size is None:
            return
        count = self._block_sizes.get(size, 0) + delta
        if count > 0:
            self._block_sizes[size] = count
        else:
            self._block_sizes.pop(size, None)

    def matched_blocks(
        self, address: str, token_ids: Sequence[int], lora: str | None = None
    ) -> int:
        """Leading full blocks of a prompt that `address` holds in any tier."""
        bs = self.block_size(address)
        if bs is None:
            return 0
        keys = token_block_hashes(token_ids, bs, lora_seed(lora), _UNLIMITED)
        n = 0
        for key in keys:
            holders = self._holders.get(key)
            if holders is None or address not in holders:
                break
            n += 1
        return n

    def tier_blocks(
        self, address: str, token_ids: Sequence[int], tier: str, lora: str | None = None
    ) -> int:
        """Leading full blocks of a prompt that `address` holds in the tier named `tier`."""
        bs = self.block_size(address)
        index = self._tiers.get(tier.lower())
        if bs is None or index is None:
            return 0
        keys = token_block_hashes(token_ids, bs, lora_seed(lora), _UNLIMITED)
        n = 0
        for key in keys:
            holding = self._holders.get(key, {}).get(address)
            if holding is None or len(holding) <= index + 1 or holding[index + 1] <= 0:
                break
            n += 1
        return n

    def predicted_hit_tokens(
        self, address: str, token_ids: Sequence[int], lora: str | None = None
    ) -> int:
        """Prompt tokens `address` would serve from cache: full blocks, never the last token."""
        bs = self.block_size(address)
        if bs is None:
            return 0
        usable = (len(token_ids) - 1) // bs * bs
        return min(self.matched_blocks(address, token_ids, lora) * bs, max(0, usable))


# -- the scorer --------------------------------------------------------------------------


class PrecisePrefixCacheScorer:
    """`precise-prefix-cache-scorer`: weighted matched leading blocks / prompt blocks."""

    type: ClassVar[str] = "precise-prefix-cache-scorer"

    def __init__(
        self, name: str, params: PrecisePrefixParameters, routing: RoutingState | None = None
    ) -> None:
        self.name = name
        self.params = params
        weights: dict[str, float] | None = None
        indexer = params.indexer_config
        if indexer is not None and indexer.backend_configs is not None:
            weights = {b.name.lower(): b.weight for b in indexer.backend_configs}
        self.routing = routing if routing is not None else RoutingState()
        """The pool's learned state, which owns this scorer's index: what the KV events
        taught it survives a picker reload."""
        self.index = self.routing.shared(
            PRECISE_INDEX,
            name,
            params.model_dump_json(),
            PreciseIndex,
            lambda: PreciseIndex(weights, params.max_blocks_per_endpoint),
        )
        self.default_block_size = params.token_processor().tokens_per_block
        self.max_blocks = params.max_prefix_blocks()
        self.speculative_ttl = parse_duration(params.speculative_ttl)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        params = decode_parameters(PrecisePrefixParameters, cls.type, name, parameters)
        return cls(name, params, routing_state(ctx))

    def _block_size(self, state: EndpointState) -> int:
        return (
            self.index.block_size(state.address)
            or state.metrics.block_size
            or self.default_block_size
        )

    def block_keys(self, request: LLMRequest, block_size: int) -> list[int] | None:
        """The prompt's own keys at `block_size`, cached on the request; None without token ids."""
        tokens = request.cache.get("token_ids")
        if tokens is None:
            return None
        cache: dict[int, list[int]] | None = request.cache.get(KEYS_KEY)
        if cache is None:
            cache = request.cache[KEYS_KEY] = {}
        keys = cache.get(block_size)
        if keys is None:
            keys = cache[block_size] = token_block_hashes(
                tokens, block_size, lora_seed(request.lora), self.max_blocks
            )
        return keys

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> Sequence[float]:
        if request.cache.get("token_ids") is None:
            return [0.0] * len(endpoints)
        by_size: dict[int, list[str]] = {}
        for state in endpoints:
            by_size.setdefault(self._block_size(state), []).append(state.address)
        scores: dict[str, float] = {}
        for block_size, addresses in by_size.items():
            keys = self.block_keys(request, block_size)
            if not keys:
                scores.update(dict.fromkeys(addresses, 0.0))
                continue
            total = len(keys)
            matched = self.index.match(keys, addresses, cycle.now)
            for address, weight in matched.items():
                scores[address] = weight / total
        return [scores[state.address] for state in endpoints]

    def shortlist(self, cycle: CycleState, request: LLMRequest, limit: int) -> list[str]:
        """The replicas holding this prompt's longest prefixes, at every block size in use."""
        if request.cache.get("token_ids") is None:
            return []
        out: dict[str, None] = {}
        for block_size in self.index.block_sizes() or (self.default_block_size,):
            keys = self.block_keys(request, block_size)
            if keys:
                out.update(dict.fromkeys(self.index.deepest_holders(keys, limit)))
        return list(out)

    @property
    def records_decisions(self) -> bool:
        """Only with speculative indexing (`RECORDS_DECISIONS`)."""
        return self.params.speculative_indexing

    def pre_request(self, request: LLMRequest, decision: Decision, now: float) -> None:
        if not self.params.speculative_indexing:
            return
        for state in (decision.endpoint, decision.prefill):
            if state is None:
                continue
            keys = self.block_keys(request, self._block_size(state))
            if keys:
                self.index.speculate(state.address, keys, now, self.speculative_ttl)


# -- wiring (the gateway) -------------------------------------------------------------------


def precise_owners(plugins: Mapping[str, Plugin]) -> dict[str, PrecisePrefixCacheScorer]:
    """Plugin name → the precise scorer that owns an index: the scorer itself, or the
    inner scorer of a `precise-prefix-cache-producer`."""
    out: dict[str, PrecisePrefixCacheScorer] = {}
    for name, plugin in plugins.items():
        inner = getattr(plugin, "source", None)
        if isinstance(inner, PrecisePrefixCacheScorer):
            out[name] = inner
        elif isinstance(plugin, PrecisePrefixCacheScorer):
            out[name] = plugin
    return out


def precise_indexes(plugins: Mapping[str, Plugin]) -> dict[str, PreciseIndex]:
    """Plugin name → index, for every precise prefix scorer: what KV events must feed."""
    return {name: owner.index for name, owner in precise_owners(plugins).items()}
