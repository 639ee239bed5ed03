"""llm-d's predicted-latency plugins over servegate's in-process predictor.

- `predicted-latency-producer`: predicts TTFT and TPOT for every candidate (a filter
  that keeps every endpoint, so that it can sit first in a profile as in llm-d's
  configs); llm-d's sidecar-client parameters are accepted.
- `latency-scorer`: scores by headroom (`SLO − predicted`), or by predicted latency
  when the request carries no SLO.
- `slo-headroom-tier-filter`: keeps the endpoints predicted to meet the SLO
  (with a small chance of keeping only the others, so recovering replicas are seen).
- `latency-slo-admitter`: sheds sheddable requests (priority < 0) that no endpoint
  is likely to serve within their SLO, given each endpoint's measured prediction error
  (declared under `plugins` only; the gateway runs it before scheduling, as llm-d's
  admission step).

Every plugin reads predictions through one `PredictionSource`: the producer's when
one is declared, else one that reads every declared prefix scorer for the match.
Predictions are memoised per request in `request.cache`, so a profile's filter,
scorer and the admitter share them. Predicted TTFT counts the time the request has
already spent in the gateway (`ARRIVED_KEY`, set by the gateway) so that a request
that queued has less headroom left.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, field_validator

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.factory import Parameters, PluginContext, decode_parameters
from servegate.scheduling.framework import CycleState, Plugin, Scorer
from servegate.scheduling.latency.predictor import SERVICE_KEY, LatencyPredictor, Prediction
from servegate.scheduling.latency.slo import NO_SLO, Slo, slo_of
from servegate.scheduling.request import LLMRequest

PREDICTIONS_KEY = "latency.predictions"
SLO_KEY = "latency.slo"
ARRIVED_KEY = "latency.arrived_at"
"""`request.cache` key: `time.monotonic()` when the gateway received the request."""
COLD_KV_USAGE = 0.02
"""The admitter lets a sheddable request through when some endpoint's KV usage is below this."""
MEMBER_FLOOR = 0.01
"""The lowest score a scored endpoint gets, so that it still beats an excluded one (0)."""

_GO_DURATION = r"^(?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+$"


def request_slo(request: LLMRequest) -> Slo:
    """The request's objectives, parsed once per request."""
    slo = request.cache.get(SLO_KEY)
    if not isinstance(slo, Slo):
        slo = request.cache[SLO_KEY] = slo_of(request.headers)
    return slo


def elapsed_ms(cycle: CycleState, request: LLMRequest) -> float:
    arrived = request.cache.get(ARRIVED_KEY)
    if not isinstance(arrived, float):
        return 0.0
    return max(0.0, (cycle.now - arrived) * 1000.0)


class PredictionSource:
    """Predictions for a request's candidates: the predictor plus the prefix match."""

    __slots__ = ("buffer", "predictor", "prefix", "streaming")

    def __init__(
        self,
        predictor: LatencyPredictor,
        prefix: Sequence[Scorer] = (),
        buffer: float = 1.0,
        streaming: bool = True,
    ) -> None:
        self.predictor = predictor
        self.prefix = list(prefix)
        self.buffer = buffer
        """llm-d's `sloBufferFactor`: predictions are multiplied by it before comparing."""
        self.streaming = streaming
        """llm-d's `streamingMode`: False neutralises TPOT (its headroom is 0 everywhere)."""

    def predictions(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[tuple[float, float]]:
        """Each endpoint's predicted (TTFT, TPOT) in ms, memoised per request."""
        memo = request.cache.get(PREDICTIONS_KEY)
        if memo is None:
            memo = request.cache[PREDICTIONS_KEY] = {}
            missing = endpoints
        else:
            missing = [s for s in endpoints if s.endpoint.address not in memo]
        if missing:
            match = self.matches(cycle, request, missing)
            estimate = self.predictor.estimate
            tokens = request.prompt_tokens
            lora = request.lora
            now = cycle.now
            for state, m in zip(missing, match, strict=True):
                memo[state.endpoint.address] = estimate(state, tokens, m, lora, now)
        return [memo[s.endpoint.address] for s in endpoints]

    def matches(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[float]:
        """The best prefix match any declared prefix scorer gives each endpoint."""
        match = [0.0] * len(endpoints)
        for scorer in self.prefix:
            for i, x in enumerate(scorer.score(cycle, request, endpoints)):
                if x > match[i]:
                    match[i] = x
        return match

    def prediction(
        self, cycle: CycleState, request: LLMRequest, state: EndpointState
    ) -> Prediction:
        """The chosen endpoint's prediction with its features (for dispatch and learning)."""
        match = 0.0
        if self.prefix:
            one = [state]
            for scorer in self.prefix:
                x = scorer.score(cycle, request, one)[0]
                if x > match:
                    match = x
        return self.predictor.predict(state, request.prompt_tokens, match, request.lora, cycle.now)

    def headrooms(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> tuple[Slo, list[float], list[float]]:
        """The SLO and each endpoint's TTFT and TPOT headroom (`SLO − predicted`, ms).

        Without a TTFT objective the TTFT headroom is `−predicted`; likewise for TPOT,
        which is 0 everywhere when `streaming` is off (llm-d's neutralised TPOT).
        """
        slo = request_slo(request)
        preds = self.predictions(cycle, request, endpoints)
        spent = elapsed_ms(cycle, request)
        buf = self.buffer
        ttft_slo = slo.ttft_ms or 0.0
        ttft = [ttft_slo - (spent + p[0] * buf) for p in preds]
        if self.streaming:
            tpot_slo = slo.tpot_ms or 0.0
            tpot = [tpot_slo - p[1] * buf for p in preds]
        else:
            tpot = [0.0] * len(preds)
        return slo, ttft, tpot

    def meets(self, slo: Slo, ttft_headroom: float, tpot_headroom: float) -> bool:
        """Every objective the request set is predicted to be met."""
        if slo.ttft_ms is not None and ttft_headroom < 0.0:
            return False
        return not (slo.tpot_ms is not None and self.streaming and tpot_headroom < 0.0)

    def meeting(self, slo: Slo, ttft: list[float], tpot: list[float]) -> list[bool]:
        """`meets` for every endpoint at once (the filter's and the scorer's hot loop)."""
        check_ttft = slo.ttft_ms is not None
        check_tpot = slo.tpot_ms is not None and self.streaming
        if check_ttft and check_tpot:
            return [a >= 0.0 and b >= 0.0 for a, b in zip(ttft, tpot, strict=True)]
        if check_ttft:
            return [a >= 0.0 for a in ttft]
        if check_tpot:
            return [b >= 0.0 for b in tpot]
        return [True] * len(ttft)


def _predictor(ctx: PluginContext) -> LatencyPredictor:
    """The pool's shared predictor; a private one (priors only) where none is shared
    (`servegate config check`, a picker built outside a gateway)."""
    value = ctx.services.get(SERVICE_KEY)
    return value if isinstance(value, LatencyPredictor) else LatencyPredictor()


def _prefix_scorers(plugins: Mapping[str, Plugin]) -> list[Scorer]:
    from servegate.scheduling.prefix.approx import PrefixCacheScorer
    from servegate.scheduling.prefix.precise import PrecisePrefixCacheScorer

    return [
        p
        for p in plugins.values()
        if isinstance(p, (PrefixCacheScorer, PrecisePrefixCacheScorer)) and isinstance(p, Scorer)
    ]


def find_source(plugins: Mapping[str, Plugin], predictor: LatencyPredictor) -> PredictionSource:
    """The declared producer's source, else one over every declared prefix scorer."""
    for plugin in plugins.values():
        if isinstance(plugin, PredictedLatencyProducer):
            return plugin.source
    return PredictionSource(predictor, _prefix_scorers(plugins))


class _SourceUser:
    """A plugin that reads predictions: binds to the declared producer, if any."""

    __slots__ = ("name", "source")
    type: ClassVar[str]

    def __init__(self, name: str | None, predictor: LatencyPredictor) -> None:
        self.name = name or self.type
        self.source = PredictionSource(predictor)

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        self.source = find_source(plugins, self.source.predictor)


# -- predicted-latency-producer ------------------------------------------------------------


class ProducerParameters(Parameters):
    """llm-d's producer parameters; the sidecar's own settings (its URLs) are environment
    variables in llm-d and have no equivalent here: the predictor runs in-process."""

    sampling_mean: float = Field(1000.0, alias="samplingMean", gt=0)
    max_decode_token_samples: int = Field(0, alias="maxDecodeTokenSamplesForPrediction", ge=0)
    slo_buffer_factor: float = Field(1.0, alias="sloBufferFactor", gt=0)
    context_ttl: str | None = Field(None, alias="contextTTL")
    streaming_mode: bool = Field(False, alias="streamingMode")
    endpoint_role_label: str | None = Field(None, alias="endpointRoleLabel")
    predict_in_produce: bool = Field(True, alias="predictInProduce")
    prefix_match_info_producer_name: str | None = Field(
        None, alias="prefixMatchInfoProducerName", min_length=1
    )

    @field_validator("context_ttl")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        import re

        if value is not None and not re.match(_GO_DURATION, value):
            raise ValueError("must be a duration such as '30s', '5m' or '1h'")
        return value


class PredictedLatencyProducer:
    """`predicted-latency-producer`: predicts every candidate's TTFT/TPOT; keeps them all.

    `sloBufferFactor` scales predictions before they are compared with the SLO;
    `streamingMode: false` (llm-d's default) neutralises TPOT in headroom (a TPOT
    objective is then not enforced); `prefixMatchInfoProducerName` names the prefix
    scorer whose match the uncached-prompt feature uses (default: every declared
    prefix scorer, the best match wins); `predictInProduce: false` defers predicting
    to the first plugin that needs it. `samplingMean`, `maxDecodeTokenSamplesForPrediction`,
    `contextTTL` and `endpointRoleLabel` configure llm-d's sidecar client (token
    sampling for TPOT, its request-context cache, P/D roles) and are accepted and
    unused: the gateway measures TPOT over the whole stream and keeps no context cache.
    """

    __slots__ = ("name", "params", "source")
    type: ClassVar[str] = "predicted-latency-producer"

    def __init__(
        self, name: str | None, params: ProducerParameters, predictor: LatencyPredictor
    ) -> None:
        self.name = name or self.type
        self.params = params
        self.source = PredictionSource(
            predictor, (), params.slo_buffer_factor, params.streaming_mode
        )

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        return cls(
            name, decode_parameters(ProducerParameters, cls.type, name, parameters), _predictor(ctx)
        )

    def bind_plugins(self, plugins: Mapping[str, Plugin]) -> None:
        wanted = self.params.prefix_match_info_producer_name
        if wanted is None:
            self.source.prefix = _prefix_scorers(plugins)
            return
        plugin = plugins.get(wanted)
        if plugin is None or not isinstance(plugin, Scorer):
            raise ValueError(
                f"prefixMatchInfoProducerName {wanted!r} names no declared prefix scorer; "
                "declare a prefix-cache-scorer or precise-prefix-cache-scorer with that name"
            )
        self.source.prefix = [plugin]

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        if self.params.predict_in_produce:
            self.source.predictions(cycle, request, endpoints)
        return list(endpoints)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# -- latency-scorer ------------------------------------------------------------------------


class LatencyScorerParameters(Parameters):
    ttft_weight: float = Field(0.8, alias="ttftWeight", ge=0)
    tpot_weight: float = Field(0.2, alias="tpotWeight", ge=0)
    headroom_selection_strategy: Literal["least", "most"] = Field(
        "least", alias="headroomSelectionStrategy"
    )
    composite_kv_weight: float = Field(1.0, alias="compositeKVWeight", ge=0)
    composite_queue_weight: float = Field(1.0, alias="compositeQueueWeight", ge=0)
    composite_prefix_weight: float = Field(1.0, alias="compositePrefixWeight", ge=0)


def _normalised(values: list[float]) -> tuple[list[float], bool]:
    """`(v − min)/(max − min)`, and whether the values had any range (else all 1)."""
    lo = min(values)
    hi = max(values)
    if hi <= lo:
        return [1.0] * len(values), False
    span = hi - lo
    return [(v - lo) / span for v in values], True


class LatencyScorer(_SourceUser):
    """`latency-scorer`: headroom against the request's SLO, or lowest predicted latency.

    Among endpoints predicted to meet every objective the request set, `least`
    prefers the one closest to its objective (packing), `most` the one with the most
    headroom (spreading); the others score 0. When none meets them, an idle endpoint
    (nothing in flight) is preferred, then the least severe violation (only TPOT
    missed, then only TTFT, then both), then the smallest deficit. The TTFT and TPOT
    parts are normalised over the scored endpoints and blended with `ttftWeight` and
    `tpotWeight`; a part with no spread gives its weight to the other. A dimension
    without an objective always prefers the lower predicted latency. The composite
    weights (llm-d's fallback when its sidecar does not answer) are accepted and
    unused: the in-process predictor always answers.
    """

    __slots__ = ("params",)
    type: ClassVar[str] = "latency-scorer"

    def __init__(
        self,
        name: str | None = None,
        params: LatencyScorerParameters | None = None,
        predictor: LatencyPredictor | None = None,
    ) -> None:
        super().__init__(name, predictor or LatencyPredictor())
        self.params = params or LatencyScorerParameters()

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(LatencyScorerParameters, cls.type, name, parameters)
        return cls(name, p, _predictor(ctx))

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[float]:
        n = len(endpoints)
        if n == 0:
            return []
        source = self.source
        slo, ttft, tpot = source.headrooms(cycle, request, endpoints)
        meets = source.meeting(slo, ttft, tpot)
        members = [i for i in range(n) if meets[i]] if slo.any else []
        positive = bool(members)
        if not positive:
            members = list(range(n))
            idle = [i for i in members if endpoints[i].in_flight_requests == 0]
            if idle:
                members = idle
            elif slo.any:
                members = self._least_severe(members, slo, ttft, tpot)
        most = positive and self.params.headroom_selection_strategy == "most"
        n_ttft, ranged_ttft = _normalised([ttft[i] for i in members])
        n_tpot, ranged_tpot = _normalised([tpot[i] for i in members])
        if positive and not most:  # least: closest to the objective wins
            if slo.ttft_ms is not None:
                n_ttft = [1.0 - x for x in n_ttft]
            if slo.tpot_ms is not None and source.streaming:
                n_tpot = [1.0 - x for x in n_tpot]
        wt = self.params.ttft_weight if ranged_ttft else 0.0
        wp = self.params.tpot_weight if ranged_tpot else 0.0
        total = wt + wp
        out = [0.0] * n
        for k, i in enumerate(members):
            blend = 1.0 if total <= 0.0 else (wt * n_ttft[k] + wp * n_tpot[k]) / total
            out[i] = MEMBER_FLOOR + (1.0 - MEMBER_FLOOR) * blend
        return out

    def _least_severe(
        self, members: list[int], slo: Slo, ttft: list[float], tpot: list[float]
    ) -> list[int]:
        check_tpot = slo.tpot_ms is not None and self.source.streaming
        buckets: tuple[list[int], list[int], list[int]] = ([], [], [])
        for i in members:
            ttft_bad = slo.ttft_ms is not None and ttft[i] < 0.0
            tpot_bad = check_tpot and tpot[i] < 0.0
            if ttft_bad and tpot_bad:
                buckets[2].append(i)
            elif ttft_bad:
                buckets[1].append(i)
            else:
                buckets[0].append(i)
        return next(b for b in buckets if b)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# -- slo-headroom-tier-filter --------------------------------------------------------------


class TierFilterParameters(Parameters):
    epsilon_explore_neg: float = Field(0.01, alias="epsilonExploreNeg", ge=0, le=1)


class SloHeadroomTierFilter(_SourceUser):
    """`slo-headroom-tier-filter`: keep the endpoints predicted to meet the request's SLO.

    Without an SLO every endpoint passes. When some meet it and some do not, the
    meeting tier is kept, except with probability `epsilonExploreNeg` (from
    `cycle.rng`) the other tier is, so that a replica recovering from overload is
    tried and its predictions corrected; when only one tier exists it is kept.
    """

    __slots__ = ("epsilon",)
    type: ClassVar[str] = "slo-headroom-tier-filter"

    def __init__(
        self,
        name: str | None = None,
        epsilon: float = 0.01,
        predictor: LatencyPredictor | None = None,
    ) -> None:
        super().__init__(name, predictor or LatencyPredictor())
        self.epsilon = epsilon

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(TierFilterParameters, cls.type, name, parameters)
        return cls(name, p.epsilon_explore_neg, _predictor(ctx))

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        if request_slo(request) is NO_SLO or not endpoints:
            return list(endpoints)
        source = self.source
        slo, ttft, tpot = source.headrooms(cycle, request, endpoints)
        positive: list[EndpointState] = []
        negative: list[EndpointState] = []
        for state, ok in zip(endpoints, source.meeting(slo, ttft, tpot), strict=True):
            (positive if ok else negative).append(state)
        if positive and negative:
            return negative if cycle.rng.random() < self.epsilon else positive
        return positive or negative

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# -- latency-slo-admitter ------------------------------------------------------------------


class AdmitterParameters(Parameters):
    queue_timeout_ms: float = Field(0.0, alias="queueTimeoutMs", ge=0)
    """servegate: how long a sheddable request may wait for an endpoint that can meet
    its SLO before it is shed (0, llm-d's behaviour: shed at once)."""
    min_observations: int = Field(20, alias="minObservations", ge=1)
    """servegate: an endpoint whose model has learned fewer streams than this (in a
    dimension the request has an objective for) is cold; while one is, nothing is shed."""
    shed_quantile: float = Field(0.1, alias="shedQuantile", gt=0.0, le=1.0)
    """servegate: each prediction is scaled by this quantile of the endpoint's recent
    actual / predicted ratios before it is compared with the SLO: a request is shed only
    when every endpoint would miss even if it beat its prediction as it did the
    `shedQuantile` best of the last 50 times."""


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    reason: str


class LatencySloAdmitter(_SourceUser):
    """`latency-slo-admitter`: shed sheddable requests no endpoint can serve within SLO.

    A request with priority ≥ 0 or without an SLO is always admitted. A sheddable one
    (priority < 0) is admitted when some candidate is idle (nothing in flight: its
    prediction is least trustworthy and it costs nothing to try), cold (KV usage under
    2 %), or still learning (fewer than `minObservations` streams), or may meet its SLO:
    shedding is irreversible, so the prediction it is compared with is the optimistic
    end of what the endpoint measured, `predicted × q-quantile(actual / predicted)` over
    its last 50 streams (`shedQuantile`). Otherwise it is shed with 429, after waiting
    up to `queueTimeoutMs` for one of those to become true.
    """

    __slots__ = ("min_observations", "queue_timeout_s", "shed_quantile")
    type: ClassVar[str] = "latency-slo-admitter"

    def __init__(
        self,
        name: str | None = None,
        queue_timeout_ms: float = 0.0,
        predictor: LatencyPredictor | None = None,
        min_observations: int = 20,
        shed_quantile: float = 0.1,
    ) -> None:
        super().__init__(name, predictor or LatencyPredictor())
        self.queue_timeout_s = queue_timeout_ms / 1000.0
        self.min_observations = min_observations
        self.shed_quantile = shed_quantile

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(AdmitterParameters, cls.type, name, parameters)
        return cls(name, p.queue_timeout_ms, _predictor(ctx), p.min_observations, p.shed_quantile)

    def check(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> Verdict:
        if request.priority >= 0:
            return Verdict(True, "not sheddable")
        slo = request_slo(request)
        if not slo.any:
            return Verdict(True, "no SLO")
        if not endpoints:
            return Verdict(True, "no candidates")
        if any(s.in_flight_requests == 0 for s in endpoints):
            return Verdict(True, "an endpoint is idle")
        if any(s.metrics.kv_usage < COLD_KV_USAGE for s in endpoints):
            return Verdict(True, "an endpoint is cold")
        source = self.source
        check_ttft = slo.ttft_ms is not None
        check_tpot = slo.tpot_ms is not None and source.streaming
        models = source.predictor.endpoints
        low_ttft: list[float] = []
        low_tpot: list[float] = []
        for state in endpoints:
            model = models.get(state.endpoint.address)
            if model is None:
                return Verdict(True, "an endpoint's latency model is still learning")
            ttft_err, tpot_err = model.ttft_error, model.tpot_error
            if (check_ttft and ttft_err.observations < self.min_observations) or (
                check_tpot and tpot_err.observations < self.min_observations
            ):
                return Verdict(True, "an endpoint's latency model is still learning")
            low_ttft.append(ttft_err.low_ratio(self.shed_quantile))
            low_tpot.append(tpot_err.low_ratio(self.shed_quantile))
        preds = source.predictions(cycle, request, endpoints)
        spent = elapsed_ms(cycle, request)
        buf = source.buffer
        for (ttft, tpot), lo_ttft, lo_tpot in zip(preds, low_ttft, low_tpot, strict=True):
            ttft_ok = not check_ttft or spent + ttft * buf * lo_ttft <= (slo.ttft_ms or 0.0)
            tpot_ok = not check_tpot or tpot * buf * lo_tpot <= (slo.tpot_ms or 0.0)
            if ttft_ok and tpot_ok:
                return Verdict(True, "an endpoint may meet the SLO")
        return Verdict(
            False,
            "no endpoint is predicted to meet the request's latency SLO, even at the "
            "low end of its measured prediction error",
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class PredictedLatencyScorerParameters(LatencyScorerParameters):
    """GIE v1.5's `predicted-latency-scorer` carried its sidecar client's settings too."""

    sampling_mean: float = Field(1000.0, alias="samplingMean", gt=0)
    max_decode_token_samples: int = Field(0, alias="maxDecodeTokenSamplesForPrediction", ge=0)
    slo_buffer_factor: float = Field(1.0, alias="sloBufferFactor", gt=0)
    context_ttl: str | None = Field(None, alias="contextTTL")
    streaming_mode: bool = Field(False, alias="streamingMode")


class PredictedLatencyScorer(LatencyScorer):
    """`predicted-latency-scorer`: the Gateway API Inference Extension v1.5 name of
    `latency-scorer`, which then also held the predictor client's settings (accepted;
    the in-process predictor needs no sampling or sidecar)."""

    __slots__ = ()
    type: ClassVar[str] = "predicted-latency-scorer"

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(PredictedLatencyScorerParameters, cls.type, name, parameters)
        kept = LatencyScorerParameters.model_validate(
            p.model_dump(by_alias=True, include=set(LatencyScorerParameters.model_fields))
        )
        return cls(name, kept, _predictor(ctx))
