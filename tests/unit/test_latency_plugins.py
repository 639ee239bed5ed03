"""llm-d's predicted-latency plugins over the in-process predictor, and the SLO headers."""

from __future__ import annotations

import random
from typing import Any

import pytest

from servegate.pool.endpoint import Endpoint, EndpointMetrics, EndpointState
from servegate.scheduling.config import load_picker_config
from servegate.scheduling.factory import PluginContext, PluginParameterError
from servegate.scheduling.framework import CycleState
from servegate.scheduling.latency.plugins import (
    ARRIVED_KEY,
    PREDICTIONS_KEY,
    LatencyScorer,
    LatencyScorerParameters,
    LatencySloAdmitter,
    PredictedLatencyProducer,
    SloHeadroomTierFilter,
)
from servegate.scheduling.latency.predictor import SERVICE_KEY, Accuracy, LatencyPredictor
from servegate.scheduling.latency.slo import NO_SLO, Slo, slo_of
from servegate.scheduling.request import LLMRequest, RequestKind

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"


def state(address: str, in_flight: int = 1, kv: float = 0.5, waiting: float = 0) -> EndpointState:
    s = EndpointState(Endpoint(address=address, url=f"http://{address}"))
    s.in_flight_requests = in_flight
    s.metrics = EndpointMetrics(waiting=waiting, kv_usage=kv, scraped_at=1.0)
    return s


def request(
    ttft: float | None = None, tpot: float | None = None, priority: int = 0, tokens: int = 1000
) -> LLMRequest:
    headers = {}
    if ttft is not None:
        headers["x-llm-d-slo-ttft-ms"] = str(ttft)
    if tpot is not None:
        headers["x-llm-d-slo-tpot-ms"] = str(tpot)
    return LLMRequest(
        request_id="r",
        kind=RequestKind.COMPLETION,
        model="m",
        target_model="m",
        base_model="m",
        headers=headers,
        prompt_tokens=tokens,
        priority=priority,
    )


def cycle(now: float = 100.0, seed: int = 0) -> CycleState:
    return CycleState(now=now, rng=random.Random(seed))


def predictor_with(ttft_per_in_flight: float, tpot_per_in_flight: float) -> LatencyPredictor:
    """A predictor whose pool fit is `10 + k · in_flight` ms for both targets (no tokens)."""
    p = LatencyPredictor()
    p.pool_ttft.theta = [10.0, 0.0, 0.0, ttft_per_in_flight] + [0.0] * 5
    p.pool_tpot.theta = [10.0, tpot_per_in_flight] + [0.0] * 4
    return p


def scorer(predictor: LatencyPredictor, **params: Any) -> LatencyScorer:
    return LatencyScorer("l", LatencyScorerParameters.model_validate(params), predictor)


def test_slo_headers_parse_and_bad_values_mean_no_objective() -> None:
    assert slo_of({}) is NO_SLO
    assert slo_of({"x-llm-d-slo-ttft-ms": "250", "x-llm-d-slo-tpot-ms": "20.5"}) == Slo(250, 20.5)
    assert slo_of({"x-llm-d-slo-ttft-ms": "soon"}) is NO_SLO
    for bad in ("-5", "0", "inf", "nan", ""):
        assert slo_of({"x-llm-d-slo-tpot-ms": bad}) is NO_SLO
    assert slo_of({"x-llm-d-slo-tpot-ms": "30"}) == Slo(None, 30.0)


def test_without_slo_the_lowest_predicted_latency_wins_after_idle_ones() -> None:
    p = predictor_with(100.0, 1.0)
    eps = [state("a:1", in_flight=3), state("b:1", in_flight=1), state("c:1", in_flight=2)]
    scores = scorer(p).score(cycle(), request(), eps)
    assert max(range(3), key=scores.__getitem__) == 1
    assert scores[0] == pytest.approx(0.01)  # the worst still beats an excluded endpoint
    eps.append(state("idle:1", in_flight=0))
    scores = scorer(p).score(cycle(), request(), eps)
    assert scores[:3] == [0.0, 0.0, 0.0] and scores[3] == 1.0


def test_most_spreads_and_least_packs_among_endpoints_that_meet_the_slo() -> None:
    p = predictor_with(100.0, 0.0)  # TTFT 110, 210, 310, 410 ms; TPOT 10 everywhere
    eps = [state(f"e{i}:1", in_flight=i) for i in (1, 2, 3, 4)]
    slo = request(ttft=350)  # e4 (410 ms) misses
    most = scorer(p, headroomSelectionStrategy="most").score(cycle(), slo, eps)
    least = scorer(p, headroomSelectionStrategy="least").score(cycle(), slo, eps)
    assert most[3] == 0.0 and least[3] == 0.0
    assert max(range(4), key=most.__getitem__) == 0
    assert max(range(4), key=least.__getitem__) == 2
    assert most[0] == 1.0 and least[2] == 1.0


def test_time_spent_in_the_gateway_counts_against_the_ttft_slo() -> None:
    p = predictor_with(100.0, 0.0)
    eps = [state("a:1", in_flight=1), state("b:1", in_flight=2)]  # 110 and 210 ms
    req = request(ttft=300)
    assert scorer(p, headroomSelectionStrategy="most").score(cycle(), req, eps)[1] > 0.0
    req = request(ttft=300)
    req.cache[ARRIVED_KEY] = 99.85  # queued 150 ms: b (210 + 150) now misses
    assert scorer(p, headroomSelectionStrategy="most").score(cycle(100.0), req, eps)[1] == 0.0


def test_when_nothing_meets_the_slo_the_least_severe_violation_wins() -> None:
    p = LatencyPredictor()
    p.pool_ttft.theta = [10.0, 0.0, 0.0, 100.0] + [0.0] * 5  # TTFT grows with in-flight
    p.pool_tpot.theta = [100.0, -20.0] + [0.0] * 4  # TPOT shrinks with it
    # a: TTFT 110 / TPOT 80; b: 210 / 60; c: 310 / 40
    eps = [state("a:1", in_flight=1), state("b:1", in_flight=2), state("c:1", in_flight=3)]
    s = scorer(p, ttftWeight=1, tpotWeight=1)
    # SLO 100 / 50 ms: a and b miss both, c misses only TTFT
    scores = s.score(cycle(), request(ttft=100, tpot=50), eps)
    assert scores[0] == 0.0 and scores[1] == 0.0 and scores[2] > 0.0
    # SLO 250 / 50: a, b miss only TPOT (the mildest bucket), c misses only TTFT
    scores = s.score(cycle(), request(ttft=250, tpot=50), eps)
    assert scores[2] == 0.0 and scores[0] > 0.0 and scores[1] > 0.0


def test_streaming_mode_off_neutralises_tpot() -> None:
    p = predictor_with(0.0, 50.0)  # TTFT 10 everywhere, TPOT 60 / 110
    eps = [state("a:1", in_flight=1), state("b:1", in_flight=2)]
    producer = PredictedLatencyProducer(
        "p", PredictedLatencyProducer.from_config("p", {}, PluginContext()).params, p
    )
    tier = SloHeadroomTierFilter("t", 0.0, p)
    tier.bind_plugins({"p": producer})
    assert tier.filter(cycle(), request(tpot=80), eps) == eps  # TPOT not enforced
    streaming = PredictedLatencyProducer.from_config(
        "p", {"streamingMode": True}, PluginContext(services={SERVICE_KEY: p})
    )
    tier.bind_plugins({"p": streaming})
    assert tier.filter(cycle(), request(tpot=80), eps) == eps[:1]


def test_tier_filter_explores_the_negative_tier_with_its_epsilon() -> None:
    p = predictor_with(100.0, 0.0)
    eps = [state("a:1", in_flight=1), state("b:1", in_flight=5)]  # 110 / 510 ms
    assert SloHeadroomTierFilter("t", 0.0, p).filter(cycle(), request(ttft=300), eps) == eps[:1]
    assert SloHeadroomTierFilter("t", 1.0, p).filter(cycle(), request(ttft=300), eps) == eps[1:]
    assert SloHeadroomTierFilter("t", 0.5, p).filter(cycle(), request(), eps) == eps
    kept = [
        SloHeadroomTierFilter("t", 0.3, p).filter(cycle(seed=i), request(ttft=300), eps)
        for i in range(400)
    ]
    share = sum(k == eps[1:] for k in kept) / len(kept)
    assert 0.2 < share < 0.4
    # only one tier: it is kept whatever epsilon says
    assert SloHeadroomTierFilter("t", 1.0, p).filter(cycle(), request(ttft=9999), eps) == eps


def taught(p: LatencyPredictor, address: str, ratios: list[float], n: int = 20) -> None:
    """`n` streams on `address` measured at these actual / predicted ratios (cycled)."""
    model = p.model(address)
    for i in range(n):
        model.ttft_error.add(100.0, 100.0 * ratios[i % len(ratios)])
        model.tpot_error.add(10.0, 10.0 * ratios[i % len(ratios)])


def test_admitter_sheds_only_sheddable_requests_that_nothing_can_serve_in_time() -> None:
    p = predictor_with(100.0, 0.0)
    admitter = LatencySloAdmitter("a", 0.0, p)
    busy = [state("a:1", in_flight=2), state("b:1", in_flight=3)]  # 210 / 310 ms
    for s in busy:
        taught(p, s.endpoint.address, [1.0])  # predictions have been exact
    assert not admitter.check(cycle(), request(ttft=100, priority=-1), busy).admitted
    assert admitter.check(cycle(), request(ttft=100, priority=0), busy).admitted
    assert admitter.check(cycle(), request(priority=-1), busy).admitted
    assert admitter.check(cycle(), request(ttft=250, priority=-1), busy).admitted
    idle = [*busy, state("c:1", in_flight=0)]
    assert admitter.check(cycle(), request(ttft=100, priority=-1), idle).reason.endswith("idle")
    cold = [*busy, state("c:1", in_flight=4, kv=0.01)]
    assert admitter.check(cycle(), request(ttft=100, priority=-1), cold).reason.endswith("cold")


def test_admitter_never_sheds_while_an_endpoint_model_is_still_learning() -> None:
    p = predictor_with(100.0, 0.0)
    admitter = LatencySloAdmitter("a", 0.0, p, min_observations=20)
    busy = [state("a:1", in_flight=2), state("b:1", in_flight=3)]  # 210 / 310 ms
    taught(p, "a:1", [1.0])
    sheddable = request(ttft=100, priority=-1)
    assert admitter.check(cycle(), sheddable, busy).reason.endswith("still learning")
    taught(p, "b:1", [1.0], n=19)
    assert admitter.check(cycle(), sheddable, busy).admitted
    taught(p, "b:1", [1.0], n=1)  # the 20th stream: both models have learned enough
    assert not admitter.check(cycle(), sheddable, busy).admitted


@pytest.mark.parametrize(
    ("ratios", "slo_ms", "admitted"),
    [
        # 210 ms predicted on a:1; the 10th percentile of its ratios is the bound
        pytest.param([1.0], 150, False, id="exact-model-misses"),
        pytest.param([0.5, 1.0, 1.5], 150, True, id="half-as-often-105ms-meets"),
        pytest.param([0.5, 1.0, 1.5], 100, False, id="even-at-105ms-misses"),
        pytest.param([0.9, 1.0, 1.1, 1.2], 150, False, id="tight-error-189ms-misses"),
    ],
)
def test_admitter_weighs_the_prediction_by_its_measured_error(
    ratios: list[float], slo_ms: float, admitted: bool
) -> None:
    p = predictor_with(100.0, 0.0)
    admitter = LatencySloAdmitter("a", 0.0, p, shed_quantile=0.1)
    busy = [state("a:1", in_flight=2), state("b:1", in_flight=3)]  # 210 / 310 ms
    taught(p, "a:1", ratios, n=30)
    taught(p, "b:1", [1.0], n=30)
    verdict = admitter.check(cycle(), request(ttft=slo_ms, priority=-1), busy)
    assert verdict.admitted is admitted, verdict.reason


def test_admitter_bounds_tpot_by_its_own_measured_error() -> None:
    p = predictor_with(0.0, 10.0)  # TPOT 10 + 10 · in_flight: 30 / 40 ms
    admitter = LatencySloAdmitter("a", 0.0, p)
    busy = [state("a:1", in_flight=2), state("b:1", in_flight=3)]
    for s in busy:
        taught(p, s.endpoint.address, [1.0])
    assert not admitter.check(cycle(), request(tpot=20, priority=-1), busy).admitted
    p.model("a:1").tpot_error = Accuracy()
    for _ in range(20):
        p.model("a:1").tpot_error.add(30.0, 15.0)  # a:1 has run twice as fast as predicted
    assert admitter.check(cycle(), request(tpot=20, priority=-1), busy).admitted


def test_producer_predicts_every_candidate_once_with_the_prefix_match() -> None:
    p = LatencyPredictor()
    scheduler = load_picker_config(
        HEAD + "plugins:\n- type: prefix-cache-scorer\n- type: predicted-latency-producer\n"
        "- type: latency-scorer\n- type: latency-slo-admitter\n",
        PluginContext(services={SERVICE_KEY: p}),
    )
    producer = scheduler.plugins["predicted-latency-producer"]
    assert isinstance(producer, PredictedLatencyProducer)
    assert len(producer.source.prefix) == 1
    latency = scheduler.plugins["latency-scorer"]
    assert isinstance(latency, LatencyScorer) and latency.source is producer.source
    assert producer.source.predictor is p
    eps = [state("a:1"), state("b:1")]
    req = request(ttft=1000)
    req.prompt = "x" * 4000
    decision = scheduler.schedule(req, eps, cycle())
    memo = req.cache[PREDICTIONS_KEY]
    assert set(memo) == {"a:1", "b:1"}
    first = producer.source.prediction(cycle(), req, eps[0])
    assert first.features.uncached_tokens == 1000  # nothing routed yet: no match
    assert memo["a:1"] == pytest.approx((first.ttft_ms, first.tpot_ms))
    scheduler.pre_request(req, decision, 100.0)  # the approximate index learns the prompt
    again = request(ttft=1000)
    again.prompt = req.prompt
    scheduler.schedule(again, eps, cycle())
    chosen = decision.endpoint.address
    assert chosen in again.cache[PREDICTIONS_KEY]
    assert (
        producer.source.prediction(cycle(), again, decision.endpoint).features.uncached_tokens < 100
    )


def test_parameters_are_strict_and_the_prefix_source_must_exist() -> None:
    ctx = PluginContext()
    with pytest.raises(PluginParameterError, match="headroomSelectionStrategy"):
        LatencyScorer.from_config("l", {"headroomSelectionStrategy": "middle"}, ctx)
    with pytest.raises(PluginParameterError, match="unknown parameter 'predictorURL'"):
        PredictedLatencyProducer.from_config("p", {"predictorURL": "http://x"}, ctx)
    with pytest.raises(PluginParameterError, match="contextTTL"):
        PredictedLatencyProducer.from_config("p", {"contextTTL": "five minutes"}, ctx)
    with pytest.raises(PluginParameterError, match="epsilonExploreNeg"):
        SloHeadroomTierFilter.from_config("t", {"epsilonExploreNeg": 2}, ctx)
    accepted = {
        "samplingMean": 100.0,
        "maxDecodeTokenSamplesForPrediction": 20,
        "sloBufferFactor": 1.2,
        "contextTTL": "5m",
        "streamingMode": True,
        "endpointRoleLabel": "llm-d.ai/role",
        "predictInProduce": False,
    }
    assert PredictedLatencyProducer.from_config("p", accepted, ctx).source.buffer == 1.2
    with pytest.raises(ValueError, match="names no declared prefix scorer"):
        load_picker_config(
            HEAD + "plugins:\n- type: predicted-latency-producer\n"
            "  parameters: {prefixMatchInfoProducerName: nope}\n",
            ctx,
        )
