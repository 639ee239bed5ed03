"""llm-d's data producers: plugins that compute per-request data other plugins consume.

The current llm-d router splits a prefix scorer in two: a *producer* keeps the
index and computes each endpoint's prefix match for a request; *consumers*
(`prefix-cache-scorer`, `no-hit-lru-scorer`, `prefix-cache-affinity-filter`,
`prefix-based-pd-decider`, `p2p-source-producer`) read it, naming the producer
with `prefixMatchInfoProducerName` (empty = the producer declared under its
type name, else a private default one). In servegate a producer becomes the
data it produces:

- `approx-prefix-cache-producer` owns an approximate index (what was routed
  where) and `precise-prefix-cache-producer` a KV-event index; consumers read
  the producer's per-cycle match fractions (`affinity.prefix_scores`), so every
  consumer of one producer sees the same numbers, and the producer's
  `pre_request` records each decision once;
- `inflight-load-producer` is the pool's own in-flight request and token
  counts, which servegate always keeps (`EndpointState.in_flight_*`);
- `session-id-producer` names the header or cookie that carries the session id
  (`LLMRequest.session_id` reads it);
- `p2p-source-producer` names, in `x-kv-cache-source-host-port`, a peer that holds
  more of the prompt than the computing endpoint, for the sidecar's P2P KV pull;
- `token-producer` / `tokenizer`: servegate tokenises with the pool's
  `tokenizer` settings, so these are accepted with a warning saying so.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, ClassVar, Self

import xxhash
from pydantic import Field, model_validator

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.declared import DeclaredPlugin, ParamsModel
from servegate.scheduling.factory import Parameters, PluginContext, decode_parameters
from servegate.scheduling.framework import CycleState, Decision
from servegate.scheduling.prefix.approx import ApproxPrefixParameters, PrefixCacheScorer
from servegate.scheduling.prefix.lookup import PRODUCER_KIND, PrefixProducer, find_prefix_scorer
from servegate.scheduling.prefix.precise import PrecisePrefixCacheScorer, PrecisePrefixParameters
from servegate.scheduling.request import LLMRequest
from servegate.scheduling.routing_state import RoutingState, routing_state


class ApproxProducerParameters(ApproxPrefixParameters):
    max_prefix_tokens_to_match: int | None = Field(None, alias="maxPrefixTokensToMatch", ge=0)
    """llm-d: the prefix length looked at, in tokens; blocks = this / blockSizeTokens."""


class ApproxPrefixCacheProducer(PrefixProducer):
    """`approx-prefix-cache-producer`: servegate's approximate index as a producer.

    Parameters as `prefix-cache-scorer`'s index parameters; `maxPrefixTokensToMatch`
    (when > 0) sets the blocks looked at to `maxPrefixTokensToMatch // blockSizeTokens`,
    as llm-d resolves it, instead of `maxPrefixBlocksToMatch`.
    """

    type: ClassVar[str] = "approx-prefix-cache-producer"

    def __init__(
        self, name: str, params: ApproxProducerParameters, routing: RoutingState | None = None
    ) -> None:
        super().__init__(name)
        index = params.model_dump(by_alias=True, exclude={"max_prefix_tokens_to_match"})
        tokens = params.max_prefix_tokens_to_match
        if tokens:
            index["maxPrefixBlocksToMatch"] = max(1, tokens // params.block_size_tokens)
        self.params = params
        self.source = PrefixCacheScorer(
            name, ApproxPrefixParameters.model_validate(index), routing=routing
        )

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        params = decode_parameters(ApproxProducerParameters, cls.type, name, parameters)
        return cls(name, params, routing_state(ctx))


class PrecisePrefixCacheProducer(PrefixProducer):
    """`precise-prefix-cache-producer`: the KV-event index of `precise-prefix-cache-scorer`.

    Same parameters; the pool's KV-event subscribers feed it (`precise_indexes`).
    """

    type: ClassVar[str] = "precise-prefix-cache-producer"

    def __init__(
        self, name: str, params: PrecisePrefixParameters, routing: RoutingState | None = None
    ) -> None:
        super().__init__(name)
        self.params = params
        self.source = PrecisePrefixCacheScorer(name, params, routing)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        params = decode_parameters(PrecisePrefixParameters, cls.type, name, parameters)
        return cls(name, params, routing_state(ctx))


# -- producers whose data servegate keeps anyway, or computes elsewhere -----------------


class InFlightLoadProducer(DeclaredPlugin):
    """`inflight-load-producer`: the pool's in-flight requests and tokens per endpoint.

    servegate's pool counts them at dispatch and completion whether or not this
    plugin is declared; consumers (`concurrency-detector`, `active-request-scorer`,
    `token-load-scorer`) read `EndpointState.in_flight_requests` / `in_flight_tokens`.
    """

    __slots__ = ()
    type: ClassVar[str] = "inflight-load-producer"
    kind: ClassVar[str] = PRODUCER_KIND


class SessionIDParameters(Parameters):
    header_name: str | None = Field(None, alias="headerName", min_length=1)
    cookie_name: str | None = Field(None, alias="cookieName", min_length=1)

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if (self.header_name is None) == (self.cookie_name is None):
            raise ValueError("set exactly one of headerName and cookieName")
        return self


class SessionIDProducer(DeclaredPlugin):
    """`session-id-producer`: the session id from a header or a cookie of the request."""

    __slots__ = ()
    type: ClassVar[str] = "session-id-producer"
    kind: ClassVar[str] = PRODUCER_KIND
    parameters_model: ClassVar[ParamsModel] = SessionIDParameters

    def session_id(self, headers: Mapping[str, str]) -> str | None:
        p = self.params
        assert isinstance(p, SessionIDParameters)
        if p.header_name is not None:
            return headers.get(p.header_name.lower()) or None
        for part in headers.get("cookie", "").split(";"):
            key, _, value = part.strip().partition("=")
            if key == p.cookie_name and value:
                return value
        return None


class VLLMTokenizer(Parameters):
    http: str | None = None
    url: str | None = None
    timeout: str | int | None = None
    mm_timeout: str | int | None = Field(None, alias="mmTimeout")


class UDSTokenizer(Parameters):
    socket_file: str = Field("", alias="socketFile")
    model_name: str | None = Field(None, alias="modelName")


class TokenizerParameters(Parameters):
    model_name: str = Field("", alias="modelName")
    vllm: VLLMTokenizer | None = None
    uds_tokenizer_config: UDSTokenizer | None = Field(None, alias="udsTokenizerConfig")
    estimate: dict[str, Any] | None = None


class TokenizerProducer(DeclaredPlugin):
    """`tokenizer` (formerly `token-producer`): token ids of the prompt for routing."""

    __slots__ = ()
    type: ClassVar[str] = "tokenizer"
    kind: ClassVar[str] = PRODUCER_KIND
    parameters_model: ClassVar[ParamsModel] = TokenizerParameters
    unsupported: ClassVar[str] = (
        "servegate tokenises for routing with the pool's `tokenizer` settings "
        "(source: hf | engine | simulator | chars, docs/configuration.md), not with this "
        "plugin; `source: engine` asks each replica's /tokenize as vllm.http/url does"
    )


class LegacyTokenProducer(TokenizerProducer):
    __slots__ = ()
    type: ClassVar[str] = "token-producer"


class P2PSourceParameters(Parameters):
    prefix_match_info_producer_name: str | None = Field(
        None, alias="prefixMatchInfoProducerName", min_length=1
    )
    min_cached_token_delta: int = Field(1, alias="minCachedTokenDelta", ge=1)
    prefill_profile_name: str = Field("prefill", alias="prefillProfileName", min_length=1)


KV_CACHE_SOURCE_HEADER = "x-kv-cache-source-host-port"


class P2PSourceProducer(DeclaredPlugin):
    """`p2p-source-producer`: names a peer that holds more of the prompt, for a P2P KV pull.

    After the decision, each endpoint the cycle ranked gets its cached prompt tokens
    from the prefix producer (`prefixMatchInfoProducerName`, else the one declared
    under its type name, else the only prefix scorer): match share × prompt tokens.
    The source is drawn among the endpoints within one block of the most cached,
    weighted by `1/(1 + waiting)`, with the request id's hash as the draw (so a
    widely cached prefix does not pull from one replica only). The computing
    endpoint is the prefill endpoint when there is one, else the target. The header
    `x-kv-cache-source-host-port: ip:port` is set only when the source holds at least
    `minCachedTokenDelta` more cached tokens than the computing endpoint.
    With the precise producer (per-tier data) a peer counts only its contiguous CPU-tier
    blocks (pulls are served from the CPU tier) and the computing endpoint all of its
    own, as in llm-d.
    """

    __slots__ = ("block_size", "source")
    type: ClassVar[str] = "p2p-source-producer"
    reads_before_records: ClassVar[bool] = True
    """Its `pre_request` runs before the hooks that record the decision in an index."""
    kind: ClassVar[str] = PRODUCER_KIND
    parameters_model: ClassVar[ParamsModel] = P2PSourceParameters

    def __init__(self, name: str | None = None, params: Parameters | None = None) -> None:
        super().__init__(name, params)
        self.source: Any = None
        self.block_size = 16

    def bind_plugins(self, plugins: Mapping[str, Any]) -> None:
        p = self.params
        assert isinstance(p, P2PSourceParameters)
        self.source = find_prefix_scorer(
            self.type, plugins, p.prefix_match_info_producer_name, "prefixMatchInfoProducerName"
        )
        params = getattr(self.source, "params", None)
        size = getattr(params, "block_size_tokens", None)
        if not isinstance(size, int):
            size = getattr(self.source, "default_block_size", None)
        self.block_size = size if isinstance(size, int) and size > 0 else 16

    def pre_request(self, request: LLMRequest, decision: Decision, now: float) -> None:
        p = self.params
        assert isinstance(p, P2PSourceParameters)
        decision.upstream_headers.pop(KV_CACHE_SOURCE_HEADER, None)
        if self.source is None or request.prompt_tokens <= 0:
            return
        seen: dict[str, EndpointState] = {}
        for result in decision.results.values():
            for state in result.ranked:
                seen.setdefault(state.address, state)
        computing = decision.prefill or decision.endpoint
        seen.setdefault(computing.address, computing)
        states = list(seen.values())
        peer, local = self._cached_tokens(request, states, now)
        cached = peer
        best = max(cached.values())
        band = [s for s in states if cached[s.address] >= best - self.block_size]
        weights = [1.0 / (1.0 + max(0.0, s.metrics.waiting)) for s in band]
        point = (xxhash.xxh3_64_intdigest(request.request_id.encode()) / 2**64) * sum(weights)
        chosen = band[-1]
        for state, weight in zip(band, weights, strict=True):
            point -= weight
            if point < 0:
                chosen = state
                break
        if chosen is computing:
            return
        if cached[chosen.address] - local[computing.address] >= p.min_cached_token_delta:
            decision.upstream_headers[KV_CACHE_SOURCE_HEADER] = chosen.address

    def _cached_tokens(
        self, request: LLMRequest, states: list[EndpointState], now: float
    ) -> tuple[dict[str, int], dict[str, int]]:
        """(tokens a peer could serve a pull from, tokens an endpoint holds itself).

        With a precise index (per-tier data) a pull is served from the peer's CPU
        tier, so only its contiguous CPU-tier prefix counts for the peer, while the
        computing endpoint's own blocks count in any tier, as in llm-d; otherwise both
        are the match share × prompt tokens."""
        source = self.source
        producer = getattr(source, "producer", None)
        if producer is not None:
            source = getattr(producer, "source", source)
        tokens = request.cache.get("token_ids")
        if isinstance(source, PrecisePrefixCacheScorer) and tokens is not None:
            index = source.index
            peer: dict[str, int] = {}
            local: dict[str, int] = {}
            for s in states:
                size = index.block_size(s.address) or 0
                peer[s.address] = index.tier_blocks(s.address, tokens, "cpu", request.lora) * size
                local[s.address] = index.matched_blocks(s.address, tokens, request.lora) * size
            return peer, local
        cycle = CycleState(now, random.Random(0))
        shares = self.source.score(cycle, request, states)
        cached = {
            s.address: round(min(1.0, max(0.0, x)) * request.prompt_tokens)
            for s, x in zip(states, shares, strict=True)
        }
        return cached, cached


class BurstPrefixParameters(Parameters):
    window_duration_ms: int = Field(0, alias="windowDurationMs", ge=0)
    max_per_replica: int = Field(0, alias="maxPerReplica")
    min_colocate_blocks: int = Field(0, alias="minColocateBlocks", ge=0)


class BurstPrefixCacheProducer(PrefixProducer):
    """`burst-prefix-cache-producer`: a prefix producer; here its match is the approximate
    index's (default parameters), without llm-d's burst co-location of new prefixes."""

    type: ClassVar[str] = "burst-prefix-cache-producer"

    def __init__(
        self, name: str, params: BurstPrefixParameters, routing: RoutingState | None = None
    ) -> None:
        super().__init__(name)
        self.params = params
        self.source = PrefixCacheScorer(
            name, ApproxPrefixParameters.model_validate({}), routing=routing
        )

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        params = decode_parameters(BurstPrefixParameters, cls.type, name, parameters)
        return cls(name, params, routing_state(ctx))

    def startup_warnings(self) -> list[str]:
        return [
            f"plugin {self.name!r} (type {self.type!r}): burst co-location of new prefixes is "
            "not implemented; consumers read the approximate prefix index (what was routed "
            "where) instead; prefix-cache-scorer's `coldPlacement: hash` places a new prefix "
            "consistently"
        ]


class MMCacheParameters(Parameters):
    cache_size_in_mb: int = Field(0, alias="cacheSizeInMB", ge=0)


class MMEmbeddingsCacheProducer(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "mm-embeddings-cache-producer"
    kind: ClassVar[str] = PRODUCER_KIND
    parameters_model: ClassVar[ParamsModel] = MMCacheParameters
    unsupported: ClassVar[str] = (
        "servegate does not track multimodal embedding caches; no servegate plugin reads them"
    )


PRODUCERS: tuple[type[DeclaredPlugin], ...] = (
    InFlightLoadProducer,
    SessionIDProducer,
    TokenizerProducer,
    LegacyTokenProducer,
    P2PSourceProducer,
    MMEmbeddingsCacheProducer,
)
