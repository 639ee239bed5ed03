"""`prefix-cache-affinity-filter`: llm-d's sticky-replica filter over the prefix match.

Apart from `affinity.py` (its parameters and the other affinity plugins, beside pydantic
models and a runtime-checkable protocol, which mypyc cannot compile) so that mypyc
compiles it (native.txt): its verdict runs on every request of the default profile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import compress
from operator import not_
from typing import TYPE_CHECKING, Any, ClassVar, Self

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.affinity import AffinityFilterParameters
from servegate.scheduling.factory import PluginContext, decode_parameters
from servegate.scheduling.framework import CycleState, Decision, Plugin, Scorer
from servegate.scheduling.prefix.lookup import (
    PREFIX_SCORER_TYPES,
    find_prefix_scorer,
    prefix_scores,
    producer_source,
)
from servegate.scheduling.request import LLMRequest
from servegate.scheduling.routing_state import RoutingState, routing_state

if TYPE_CHECKING:
    from servegate.scheduling.prefix.approx import PrefixCacheScorer


class PrefixCacheAffinityFilter:
    """`prefix-cache-affinity-filter`: sticky replicas only, unless they are too slow."""

    type: ClassVar[str] = "prefix-cache-affinity-filter"
    keeps_fallbacks: ClassVar[bool] = True
    """A preference: the replicas it removes stay last-resort fallbacks (`KEEPS_FALLBACKS`)."""

    def __init__(
        self, name: str, params: AffinityFilterParameters, routing: RoutingState | None = None
    ) -> None:
        self.name = name
        self.params = params
        self.routing = routing
        """The pool's learned state, which keeps this filter's own index (when it has one)."""
        self.prefix: Scorer | None = None
        self._own: PrefixCacheScorer | None = None
        self.decisions: dict[str, int] = {}
        """Outcomes: not-applicable, exploration, no-match, load-override,
        request-load-override, sticky."""

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        params = decode_parameters(AffinityFilterParameters, cls.type, name, parameters)
        return cls(name, params, routing_state(ctx))

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        named = self.params.prefix_match_info_producer_name
        if named is None and not any(
            p.type in PREFIX_SCORER_TYPES or producer_source(p) is not None
            for p in plugins.values()
        ):
            # Nothing declared produces a prefix match (llm-d's predicted-latency guides
            # pair this filter with the latency producer alone): keep an approximate index
            # of its own, fed by this filter's pre_request hook.
            from servegate.scheduling.prefix.approx import ApproxPrefixParameters, PrefixCacheScorer

            self._own = PrefixCacheScorer(
                f"{self.name}/prefix", ApproxPrefixParameters(), routing=self.routing
            )
            self.prefix = self._own
            return
        self.prefix = find_prefix_scorer(self.type, plugins, named, "prefixMatchInfoProducerName")

    @property
    def records_decisions(self) -> bool:
        """Only with an index of its own, or while not bound yet (`RECORDS_DECISIONS`)."""
        return self.prefix is None or self._own is not None

    def pre_request(self, request: LLMRequest, decision: Decision, now: float) -> None:
        if self._own is not None:
            self._own.pre_request(request, decision, now)

    def startup_warnings(self) -> list[str]:
        own = (
            [
                f"plugin {self.name!r} (type {self.type!r}): no prefix scorer or producer is "
                "declared; it keeps its own approximate prefix index (what was routed where)"
            ]
            if self._own is not None
            else []
        )
        if self.params.ttft_source != "latencyPredictor":
            return own
        return [
            *own,
            f"plugin {self.name!r} (type {self.type!r}): ttftSource latencyPredictor needs a "
            "latency predictor, which servegate does not have yet; the TTFT gate uses the "
            "prefill-throughput estimate (in-flight tokens / peakPrefillThroughput) instead",
        ]

    def _count(self, outcome: str) -> None:
        self.decisions[outcome] = self.decisions.get(outcome, 0) + 1

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        p = self.params
        if len(endpoints) <= 1 or p.affinity_threshold <= 0 or self.prefix is None:
            self._count("not-applicable")
            return endpoints
        if p.exploration_probability > 0 and cycle.rng.random() < p.exploration_probability:
            self._count("exploration")
            return endpoints
        scores = prefix_scores(cycle, self.prefix, request, endpoints)
        outcome, kept = self.verdict(request, endpoints, scores)
        self._count(outcome)
        return kept

    def verdict(
        self, request: LLMRequest, endpoints: list[EndpointState], scores: Sequence[float]
    ) -> tuple[str, list[EndpointState]]:
        """`filter`'s outcome and the endpoints kept, given the prefix scores of `endpoints`
        (more than one endpoint, a threshold above 0, no exploration drawn); counts nothing."""
        p = self.params
        threshold = p.affinity_threshold
        if max(scores) < threshold:
            return "no-match", endpoints
        if len(endpoints) <= SPLIT_LOOP_LIMIT:
            return self._small_pool(request, endpoints, scores)
        sticky, sticky_scores, others, other_scores = _split(endpoints, scores, threshold)
        if not sticky:  # a NaN score first made `max` say otherwise
            return "no-match", endpoints
        if not others:
            return "sticky", sticky
        # x / throughput · 1000 is monotonic in x, so its least (or greatest) value over
        # the replicas is that of the least (greatest) x, computed once
        sticky_tokens = [s.in_flight_tokens for s in sticky]
        other_tokens = [s.in_flight_tokens for s in others]
        token_penalty = p.max_tokens_in_flight_penalty
        if token_penalty > 0 and min(sticky_tokens) - min(other_tokens) > token_penalty:
            return "token-load-override", endpoints
        throughput = p.peak_prefill_throughput
        if p.max_ttft_penalty_ms > 0:
            best_sticky = min(sticky_tokens) / throughput * 1000.0
            best_other = min(other_tokens) / throughput * 1000.0
            if best_sticky - best_other > p.max_ttft_penalty_ms:
                return "load-override", endpoints
        if p.max_in_flight_requests_delta > 0:
            prompt = request.prompt_tokens
            # TTFT = queued tokens, then the prompt's uncached part, at the prefill rate
            best = min(
                [
                    _ttft_ms(s.in_flight_tokens, x, prompt, throughput)
                    for s, x in zip(sticky, sticky_scores, strict=True)
                ]
            )
            least = min(other_scores)
            slowest = _ttft_ms(max(other_tokens), least, prompt, throughput)
            if least == least and slowest - best <= p.max_ttft_penalty_ms:
                within = others  # the slowest bound is within, so every one is
            else:
                within = _within(
                    others, other_scores, prompt, throughput, best, p.max_ttft_penalty_ms
                )
            if within:
                least_sticky = min([s.in_flight_requests for s in sticky])
                least_within = min([s.in_flight_requests for s in within])
                if least_sticky - least_within > p.max_in_flight_requests_delta:
                    return "request-load-override", [*sticky, *within]
        return "sticky", sticky

    def _small_pool(
        self, request: LLMRequest, endpoints: list[EndpointState], scores: Sequence[float]
    ) -> tuple[str, list[EndpointState]]:
        """`filter`'s verdict after a match (outcome, endpoints kept) in a small pool, from
        one pass that splits the endpoints and takes the least and greatest loads the
        guards compare: the same expressions, in the same order, as the list-wise code
        for a large pool, without a list per quantity."""
        p = self.params
        threshold = p.affinity_threshold
        throughput = p.peak_prefill_throughput
        prompt = request.prompt_tokens
        sticky: list[EndpointState] = []
        others: list[EndpointState] = []
        other_scores: list[float] = []
        sticky_tokens = other_tokens = most_other_tokens = 0
        sticky_requests = other_requests = 0
        best = least = 0.0
        for state, x in zip(endpoints, scores, strict=True):
            tokens = state.in_flight_tokens
            requests = state.in_flight_requests
            if x >= threshold:
                ttft = _ttft_ms(tokens, x, prompt, throughput)
                if not sticky:
                    sticky_tokens, sticky_requests, best = tokens, requests, ttft
                else:
                    if tokens < sticky_tokens:
                        sticky_tokens = tokens
                    if requests < sticky_requests:
                        sticky_requests = requests
                    if ttft < best:
                        best = ttft
                sticky.append(state)
            else:
                if not others:
                    other_tokens = most_other_tokens = tokens
                    other_requests, least = requests, x
                else:
                    if tokens < other_tokens:
                        other_tokens = tokens
                    if tokens > most_other_tokens:
                        most_other_tokens = tokens
                    if requests < other_requests:
                        other_requests = requests
                    if x < least:
                        least = x
                others.append(state)
                other_scores.append(x)
        if not sticky:  # a NaN score first made `max` say otherwise
            return "no-match", endpoints
        if not others:
            return "sticky", sticky
        token_penalty = p.max_tokens_in_flight_penalty
        if token_penalty > 0 and sticky_tokens - other_tokens > token_penalty:
            return "token-load-override", endpoints
        if p.max_ttft_penalty_ms > 0:
            best_sticky = sticky_tokens / throughput * 1000.0
            best_other = other_tokens / throughput * 1000.0
            if best_sticky - best_other > p.max_ttft_penalty_ms:
                return "load-override", endpoints
        if p.max_in_flight_requests_delta > 0:
            slowest = _ttft_ms(most_other_tokens, least, prompt, throughput)
            if least == least and slowest - best <= p.max_ttft_penalty_ms:
                within, least_within = others, other_requests
            else:
                within = _within(
                    others, other_scores, prompt, throughput, best, p.max_ttft_penalty_ms
                )
                least_within = min([s.in_flight_requests for s in within], default=0)
            if within and sticky_requests - least_within > p.max_in_flight_requests_delta:
                return "request-load-override", [*sticky, *within]
        return "sticky", sticky


def _ttft_ms(tokens: int, score: float, prompt: int, throughput: float) -> float:
    """The filter's TTFT estimate: the queued tokens, then the prompt's part not matched
    (`score`, capped at 1), at the prefill rate."""
    return (
        tokens / throughput * 1000.0
        + (1.0 - (score if score < 1.0 else 1.0)) * prompt / throughput * 1000.0
    )


def _within(
    others: list[EndpointState],
    scores: list[float],
    prompt: int,
    throughput: float,
    best: float,
    penalty_ms: float,
) -> list[EndpointState]:
    """The non-sticky endpoints whose TTFT estimate is within `penalty_ms` of `best`."""
    return [
        s
        for s, x in zip(others, scores, strict=True)
        if _ttft_ms(s.in_flight_tokens, x, prompt, throughput) - best <= penalty_ms
    ]


SPLIT_LOOP_LIMIT = 8
"""Up to this many endpoints the affinity filter takes its verdict in one Python pass
(`_small_pool`); above, list by list (`compress` over a mask and `min`/`max`, in C, beat
one Python pass over a large pool)."""


def _split(
    endpoints: list[EndpointState], scores: Sequence[float], threshold: float
) -> tuple[list[EndpointState], list[float], list[EndpointState], list[float]]:
    """The endpoints scoring at least `threshold` and the others, each with their scores,
    in the endpoints' order."""
    held = [score >= threshold for score in scores]
    return (
        list(compress(endpoints, held)),
        list(compress(scores, held)),
        list(compress(endpoints, map(not_, held))),
        list(compress(scores, map(not_, held))),
    )


# -- no-hit-lru-scorer ---------------------------------------------------------------------
