"""Affinity plugins and their load guards: prefix affinity, cold-request spreading, sessions.

Cache affinity without a load guard makes hot spots: every request of a popular
prefix goes to the one replica that holds it until that replica drowns. These
plugins follow llm-d's definitions:

- `prefix-cache-affinity-filter` keeps only the replicas whose prefix score is
  at least `affinityThreshold`, unless the best of them would make the request
  wait `maxTTFTPenaltyMs` longer than the best other replica (TTFT estimated as
  in-flight tokens / `peakPrefillThroughput`); then it keeps every replica and
  the load scorers decide;
- `no-hit-lru-scorer` sends requests that hit no cache anywhere to the replica
  least recently given such a request, so new prefixes spread evenly;
- `session-affinity-scorer` pins a session to a replica: with `x-session-token`
  (the replica echoed back to the client) or `x-session-id` (a binding the
  router keeps, forgotten after `evictionTtlSeconds` unused).

The prefix plugins read the score of a prefix scorer declared in the same
config (`prefix-cache-scorer` or `precise-prefix-cache-scorer`), named by
`prefixMatchInfoProducerName` / `prefixPluginName` or found as the only one.
"""

from __future__ import annotations

import base64
import binascii
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, Self, runtime_checkable

from pydantic import Field, model_validator

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.factory import Parameters, PluginContext, decode_parameters
from servegate.scheduling.framework import CycleState, Decision, Plugin, Scorer
from servegate.scheduling.prefix.lookup import (
    find_prefix_scorer,
    prefix_scores,
)
from servegate.scheduling.request import LLMRequest
from servegate.scheduling.routing_state import (
    NO_HIT_PLACEMENTS,
    SESSION_BINDINGS,
    RoutingState,
    routing_state,
)

if TYPE_CHECKING:
    pass

SESSION_TOKEN_HEADER = "x-session-token"
SESSION_ID_HEADER = "x-session-id"


@runtime_checkable
class ResponseHeaders(Protocol):
    """A plugin that adds headers to the response (the gateway asks after the decision)."""

    def response_headers(self, request: LLMRequest, decision: Decision) -> Mapping[str, str]: ...


# -- prefix-cache-affinity-filter ----------------------------------------------------------


class AffinityFilterParameters(Parameters):
    affinity_threshold: float = Field(0.80, alias="affinityThreshold", ge=0.0, le=1.0)
    exploration_probability: float = Field(0.0, alias="explorationProbability", ge=0.0, le=1.0)
    max_ttft_penalty_ms: float = Field(18000.0, alias="maxTTFTPenaltyMs", ge=0.0)
    ttft_source: Literal["prefillThroughput", "latencyPredictor"] = Field(
        "prefillThroughput", alias="ttftSource"
    )
    """`latencyPredictor` needs issue 21's predictor; until then the prefill-throughput
    estimate is used, with a startup warning."""
    max_tokens_in_flight_penalty: int = Field(0, alias="maxTokensInFlightPenalty", ge=0)
    """Older llm-d gate: keep every candidate when the least-loaded sticky endpoint has
    more than this many in-flight tokens above the least-loaded other one; 0 = off."""
    peak_prefill_throughput: float = Field(15928.0, alias="peakPrefillThroughput", gt=0.0)
    max_in_flight_requests_delta: int = Field(0, alias="maxInFlightRequestsDelta", ge=0)
    prefix_match_info_producer_name: str | None = Field(None, alias="prefixMatchInfoProducerName")
    in_flight_load_producer_name: str | None = Field(None, alias="inFlightLoadProducerName")
    """Accepted for llm-d compatibility; the pool's in-flight counters are the load."""
    latency_prediction_info_producer_name: str | None = Field(
        None, alias="latencyPredictionInfoProducerName"
    )
    """Accepted for llm-d compatibility; servegate has no latency predictor."""

    @model_validator(mode="after")
    def _delta_needs_penalty(self) -> Self:
        if self.max_in_flight_requests_delta > 0 and self.max_ttft_penalty_ms == 0:
            raise ValueError("maxTTFTPenaltyMs must be > 0 when maxInFlightRequestsDelta is set")
        return self


class NoHitLRUParameters(Parameters):
    prefix_plugin_name: str | None = Field(None, alias="prefixPluginName")
    prefix_match_info_producer_name: str | None = Field(
        None, alias="prefixMatchInfoProducerName", min_length=1
    )
    """The current llm-d name of the same reference: the producer whose match it reads."""
    prefill_profile: str = Field("prefill", alias="prefillProfile", min_length=1)
    lru_size: int = Field(1024, alias="lruSize", ge=1)


class RecentPlacements:
    """Which replicas were given cold requests, least recent first: pool state (kept by
    `RoutingState` across picker reloads), read and written by `no-hit-lru-scorer`."""

    __slots__ = ("_position", "capacity", "lru")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[str, None] = OrderedDict()
        self._position: dict[str, int] | None = None

    def position(self) -> dict[str, int]:
        """address → place in `lru` (oldest 0), rebuilt only after a change."""
        position = self._position
        if position is None:
            position = self._position = {address: i for i, address in enumerate(self.lru)}
        return position

    def touch(self, address: str) -> None:
        """`address` was just given a cold request."""
        self._position = None
        lru = self.lru
        lru.pop(address, None)
        lru[address] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)


class NoHitLRUScorer:
    """`no-hit-lru-scorer`: cold requests to the replica least recently given one.

    A request is cold when the prefix scorer gives every candidate 0. Cold: the
    candidates never given a cold request first (in candidate order), then the
    others from least to most recently given one; rank r of n scores
    `1 − r/(n − 1)`. Not cold: 0.5 for everyone (no preference).
    """

    type: ClassVar[str] = "no-hit-lru-scorer"

    def __init__(
        self, name: str, params: NoHitLRUParameters, routing: RoutingState | None = None
    ) -> None:
        self.name = name
        self.params = params
        self.prefix: Scorer | None = None
        self.placements = (routing or RoutingState()).shared(
            NO_HIT_PLACEMENTS,
            name,
            str(params.lru_size),
            RecentPlacements,
            lambda: RecentPlacements(params.lru_size),
        )
        self._state_key = f"no-hit-lru/{name}"

    @property
    def lru(self) -> OrderedDict[str, None]:
        return self.placements.lru

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        params = decode_parameters(NoHitLRUParameters, cls.type, name, parameters)
        return cls(name, params, routing_state(ctx))

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        p = self.params
        if p.prefix_match_info_producer_name is not None and p.prefix_plugin_name is not None:
            raise ValueError(
                "prefixPluginName and prefixMatchInfoProducerName name the same thing; keep one"
            )
        parameter = "prefixPluginName"
        name = p.prefix_plugin_name
        if p.prefix_match_info_producer_name is not None:
            name, parameter = p.prefix_match_info_producer_name, "prefixMatchInfoProducerName"
        if name is None and "prefix-cache-scorer" in plugins:
            name = "prefix-cache-scorer"
        self.prefix = find_prefix_scorer(self.type, plugins, name, parameter)

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> Sequence[float]:
        if self.prefix is None:
            return self.given_match(request, endpoints, None)
        return self.given_match(
            request, endpoints, prefix_scores(cycle, self.prefix, request, endpoints)
        )

    def given_match(
        self, request: LLMRequest, endpoints: list[EndpointState], match: Sequence[float] | None
    ) -> list[float]:
        """`score` with the prefix scorer's scores of `endpoints` already known (`match`;
        None: no prefix scorer, every request is cold)."""
        n = len(endpoints)
        cold = match is None or not match or max(match) <= 0.0
        request.cache[self._state_key] = cold
        if not cold:
            return [0.5] * n
        if n == 1:
            return [1.0]
        position = self.placements.position()
        if n == 2:  # the stable sort of two below: the first unless the second is older
            first, second = endpoints
            older = position.get(second.endpoint.address, -1) < position.get(
                first.endpoint.address, -1
            )
            return [0.0, 1.0] if older else [1.0, 0.0]
        order = [position.get(s.endpoint.address, -1) for s in endpoints]
        step = 1.0 / (n - 1)
        if max(order) < 0:  # none given a cold request yet: candidate order is the rank
            return [1.0 - rank * step for rank in range(n)]
        ranked = sorted(range(n), key=order.__getitem__)  # stable: never-given first, in order
        rank_of = sorted(range(n), key=ranked.__getitem__)
        return [1.0 - rank * step for rank in rank_of]

    def pre_request(self, request: LLMRequest, decision: Decision, now: float) -> None:
        if not request.cache.pop(self._state_key, False):
            return
        targets = [decision.endpoint.address]
        prefill = decision.results.get(self.params.prefill_profile)
        if decision.prefill is not None:
            targets.append(decision.prefill.address)
        elif prefill is not None and prefill.ranked:
            targets.append(prefill.ranked[0].address)
        for address in targets:
            self.placements.touch(address)


# -- session-affinity-scorer ------------------------------------------------------------------


class EncodedEndpointHeaderConfig(Parameters):
    header: str | None = Field(None, min_length=1)
    """llm-d's name of the header that carries the token."""
    header_name: str | None = Field(None, alias="headerName", min_length=1)
    """servegate's earlier spelling of `header`; accepted."""

    @model_validator(mode="after")
    def _one_name(self) -> Self:
        if self.header is not None and self.header_name is not None:
            raise ValueError("header and headerName are the same setting; keep header")
        return self

    @property
    def name(self) -> str:
        return self.header or self.header_name or SESSION_TOKEN_HEADER


class SessionIDSource(Parameters):
    header: str | None = Field(None, min_length=1)
    attribute: str | None = Field(None, min_length=1)
    """A request attribute another plugin publishes; only a `session-id-producer`'s
    (named by `producer`) exists in servegate."""
    producer: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if (self.header is None) == (self.attribute is None and self.producer is None):
            raise ValueError("set exactly one of header and attribute (with its producer)")
        return self


class SessionIDConfig(Parameters):
    sources: list[SessionIDSource] = Field(
        default_factory=lambda: [SessionIDSource.model_validate({"header": SESSION_ID_HEADER})],
        min_length=1,
    )
    eviction_ttl_seconds: float = Field(300.0, alias="evictionTtlSeconds", gt=0.0)
    eviction_sweep_seconds: float = Field(10.0, alias="evictionSweepSeconds", gt=0.0)
    max_sessions: int = Field(1_000_000, alias="maxSessions", ge=1)
    """servegate: bindings kept at most (the least recently used are dropped first)."""


class SessionAffinityParameters(Parameters):
    strategy: Literal["encoded_endpoint_header", "session_id"] = "encoded_endpoint_header"
    encoded_endpoint_header_config: EncodedEndpointHeaderConfig = Field(
        default_factory=lambda: EncodedEndpointHeaderConfig.model_validate({}),
        alias="encodedEndpointHeaderConfig",
    )
    session_id_config: SessionIDConfig = Field(
        default_factory=lambda: SessionIDConfig.model_validate({}), alias="sessionIdConfig"
    )
    profile_name: str | None = Field(None, alias="profileName")


def encode_token(address: str) -> str:
    return base64.b64encode(address.encode()).decode()


def decode_token(token: str) -> str | None:
    try:
        return base64.b64decode(token.strip(), validate=True).decode()
    except (binascii.Error, ValueError):
        return None


class _SessionAffinity:
    """What the session-affinity scorer and filter share: the session's replica, bindings."""

    type: ClassVar[str]

    def __init__(
        self, name: str, params: SessionAffinityParameters, routing: RoutingState | None = None
    ) -> None:
        self.name = name
        self.params = params
        self.token_header = params.encoded_endpoint_header_config.name.lower()
        sid = params.session_id_config
        self.sources = list(sid.sources)
        self.producers: dict[str, Any] = {}
        self.ttl = sid.eviction_ttl_seconds
        self.sweep_every = sid.eviction_sweep_seconds
        shared = routing if routing is not None else RoutingState()
        self.bindings: OrderedDict[str, tuple[str, float]] = shared.shared(
            SESSION_BINDINGS, name, params.strategy, OrderedDict, OrderedDict
        )
        """Session id → (address, last used), least recently used first; owned by the pool's
        state, so sessions stay bound across a picker reload."""
        self._next_sweep = 0.0
        self._state_key = f"session-affinity/{name}"

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        params = decode_parameters(SessionAffinityParameters, cls.type, name, parameters)
        return cls(name, params, routing_state(ctx))

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        for source in self.sources:
            if source.header is not None:
                continue
            ref = source.producer or source.attribute
            plugin = plugins.get(ref or "")
            if plugin is None or not hasattr(plugin, "session_id"):
                raise ValueError(
                    f"sessionIdConfig source {ref!r}: servegate publishes request attributes "
                    "only from a session-id-producer; declare one with that name, or read a "
                    "`header`"
                )
            self.producers[ref or ""] = plugin

    def session_id(self, request: LLMRequest) -> str | None:
        for source in self.sources:
            if source.header is not None:
                value: str | None = request.headers.get(source.header.lower(), "").strip()
            else:
                value = self.producers[source.producer or source.attribute or ""].session_id(
                    request.headers
                )
            if value:
                return value
        return None

    def preferred(self, request: LLMRequest, now: float) -> str | None:
        if self.params.strategy == "encoded_endpoint_header":
            token = request.headers.get(self.token_header)
            return None if not token else decode_token(token)
        sid = self.session_id(request)
        if sid is None:
            return None
        bound = self.bindings.get(sid)
        if bound is None or now - bound[1] > self.ttl:
            return None
        return bound[0]

    def _picked(self, decision: Decision) -> EndpointState | None:
        name = self.params.profile_name
        if name is None:
            return decision.endpoint
        if name == "prefill" and decision.prefill is not None:
            return decision.prefill
        result = decision.results.get(name)
        return result.ranked[0] if result is not None and result.ranked else None

    def pre_request(self, request: LLMRequest, decision: Decision, now: float) -> None:
        if self.params.strategy != "session_id":
            return
        sid = self.session_id(request)
        picked = self._picked(decision)
        present = request.cache.pop(self._state_key, None)
        if sid is None or picked is None:
            return
        self._sweep(now)
        bound = self.bindings.get(sid)
        keep = (
            bound is not None
            and bound[0] != picked.address
            and present is not False
            and now - bound[1] <= self.ttl
        )
        if keep and bound is not None:
            self.bindings[sid] = (bound[0], now)
            self.bindings.move_to_end(sid)
            return
        self.bindings[sid] = (picked.address, now)
        self.bindings.move_to_end(sid)
        while len(self.bindings) > self.params.session_id_config.max_sessions:
            self.bindings.popitem(last=False)

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.sweep_every
        bindings = self.bindings
        while bindings:
            sid, (_, last) = next(iter(bindings.items()))
            if now - last <= self.ttl:
                break
            del bindings[sid]

    def response_headers(self, request: LLMRequest, decision: Decision) -> Mapping[str, str]:
        if self.params.strategy != "encoded_endpoint_header":
            return {}
        picked = self._picked(decision)
        return {} if picked is None else {self.token_header: encode_token(picked.address)}


class SessionAffinityFilter(_SessionAffinity):
    """`session-affinity-filter`: the session's replica alone when it is a candidate.

    The hard-constraint form of `session-affinity-scorer`, with the same
    parameters: when the session's replica (by token header or bound session id)
    is among the candidates it is the only one kept; otherwise every candidate
    passes. It never returns an empty list.
    """

    type: ClassVar[str] = "session-affinity-filter"

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        target = self.preferred(request, cycle.now)
        if target is None:
            return endpoints
        kept = [s for s in endpoints if s.address == target]
        request.cache[self._state_key] = bool(kept)
        return kept or endpoints


class SessionAffinityScorer(_SessionAffinity):
    """`session-affinity-scorer`: 1.0 for the session's replica, 0 for the others.

    `encoded_endpoint_header` (llm-d's default): the response carries
    `x-session-token: base64(host:port)` of the chosen replica; a request that
    sends it back prefers that replica. `session_id`: the router binds the
    client's `x-session-id` to the replica it routed to; an unused binding is
    forgotten after `evictionTtlSeconds`. A session whose replica is no longer
    a candidate expresses no preference and is re-bound where it goes.
    """

    type: ClassVar[str] = "session-affinity-scorer"

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> Sequence[float]:
        target = self.preferred(request, cycle.now)
        if target is None:
            return [0.0] * len(endpoints)
        present = any(s.address == target for s in endpoints)
        request.cache[self._state_key] = present
        return [1.0 if s.address == target else 0.0 for s in endpoints]
