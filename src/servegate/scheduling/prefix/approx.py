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

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, Self

import xxhash
from pydantic import Field, model_validator

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.factory import Parameters, PluginContext, decode_parameters
from servegate.scheduling.framework import CycleState, Decision
from servegate.scheduling.prefix.approx_index import ApproxPrefixIndex
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
