"""The gateway's latency bookkeeping: what a finished request teaches, and what it does not."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry

from servegate.gateway.access_log import AccessRecord
from servegate.gateway.latency import LatencyRouting
from servegate.pool.endpoint import Endpoint, EndpointMetrics, EndpointState
from servegate.pool.pool import Pool
from servegate.scheduling.framework import CycleState, Decision
from servegate.scheduling.latency.predictor import LatencyPredictor
from servegate.scheduling.request import LLMRequest, RequestKind


def setup(
    headers: dict[str, str] | None = None, stream: bool = True
) -> tuple[LatencyRouting, LLMRequest, Decision]:
    routing = LatencyRouting(LatencyPredictor(), {})
    s = EndpointState(Endpoint(address="a:1", url="http://a:1"))
    s.metrics = EndpointMetrics(scraped_at=1.0)
    req = LLMRequest(
        request_id="r",
        kind=RequestKind.CHAT,
        model="m",
        target_model="m",
        base_model="m",
        prompt_tokens=2000,
        stream=stream,
        headers=headers or {},
    )
    return routing, req, Decision(endpoint=s, fallbacks=[])


def dispatch(routing: LatencyRouting, req: LLMRequest, decision: Decision) -> tuple:
    record = AccessRecord(request_id="r", method="POST", path="/v1/chat/completions")
    ticket = routing.dispatch(req, decision, record, CycleState(10.05, random.Random(0)), 10.0)
    return record, ticket


def test_a_completed_stream_teaches_ttft_from_dispatch_and_tpot() -> None:
    routing, req, decision = setup({"x-llm-d-slo-ttft-ms": "500"})
    record, ticket = dispatch(routing, req, decision)
    assert record.dispatched_ms == pytest.approx(50.0)
    assert record.predicted_ttft_ms == pytest.approx(50.0 + ticket.prediction.ttft_ms, abs=1e-3)
    assert record.slo_ttft_ms == 500.0
    record.endpoint, record.status, record.stream = "a:1", 200, True
    record.ttft_ms, record.completion_tokens = 250.0, 11
    ticket.done(record, now=11.25)  # 1250 ms after arrival: 1000 ms for 10 tokens
    assert record.tpot_ms == pytest.approx(100.0)
    model = routing.predictor.endpoints["a:1"]
    assert model.ttft_error.observations == 1 and model.tpot_error.observations == 1
    assert model.ttft_error.mape == pytest.approx(abs(ticket.prediction.ttft_ms - 200.0) / 200.0)
    assert routing.slo_outcomes == {("ttft", "met"): 1}
    ticket.done(record, now=12.0)  # settled once
    assert model.ttft_error.observations == 1


@pytest.mark.parametrize(
    "change",
    [
        {"stream": False},  # the first byte of a JSON answer is the whole answer
        {"endpoint": "b:1"},  # a fallback served it: the prediction was for another
        {"status": 502, "error": "upstream failed"},
        {"prefill_endpoint": "p:1"},  # two legs
    ],
)
def test_nothing_is_learned_from_answers_that_do_not_show_the_predicted_ttft(
    change: dict[str, object],
) -> None:
    routing, req, decision = setup()
    record, ticket = dispatch(routing, req, decision)
    record.endpoint, record.status, record.stream = "a:1", 200, True
    record.ttft_ms, record.completion_tokens = 250.0, 11
    for key, value in change.items():
        setattr(record, key, value)
    ticket.done(record, now=11.0)
    model = routing.predictor.endpoints["a:1"]
    assert model.ttft_error.observations == 0
    assert not model.pending  # the backlog is released whatever happened


def test_a_ttft_is_learned_before_the_next_decision_once_its_first_byte_is_relayed() -> None:
    routing, req, decision = setup()
    record, ticket = dispatch(routing, req, decision)
    model = routing.predictor.endpoints["a:1"]
    routing.learn_first_tokens(10.1)  # no first byte yet: nothing to learn
    assert model.ttft_error.observations == 0
    record.endpoint, record.status, record.stream = "a:1", 200, True
    record.ttft_ms = 250.0  # the first byte, 200 ms after dispatch; the stream goes on
    asyncio.run(routing.admit(req, 10.5, [decision.endpoint], Pool(), random.Random(0)))
    assert model.ttft_error.observations == 1
    assert model.ttft_error.mape == pytest.approx(abs(ticket.prediction.ttft_ms - 200.0) / 200.0)
    assert not routing.awaiting_first_token
    record.completion_tokens = 11
    ticket.done(record, now=11.25)
    assert model.ttft_error.observations == 1  # not learned twice
    assert model.tpot_error.observations == 1
    assert not model.pending


def test_a_first_byte_that_does_not_show_the_predicted_ttft_is_left_to_the_end() -> None:
    routing, req, decision = setup()
    record, ticket = dispatch(routing, req, decision)
    record.endpoint, record.status, record.stream = "b:1", 200, True  # a fallback served it
    record.ttft_ms = 250.0
    routing.learn_first_tokens(10.5)
    assert not routing.awaiting_first_token  # looked at once, then no more
    model = routing.predictor.endpoints["a:1"]
    ticket.done(record, now=11.0)
    assert model.ttft_error.observations == 0


def streams(routing: LatencyRouting, rate: float, n: int) -> list[float]:
    """`n` streams of one endpoint at `rate` a second through the gateway's calls, each
    with its first byte 100 ms and its end 300 ms after dispatch; the TTFT predicted
    for each, in order."""
    _, req, decision = setup()
    predicted = []
    open_: list[tuple[AccessRecord, object, float]] = []
    for i in range(n):
        t = 10.0 + i / rate
        for record, ticket, sent in [o for o in open_ if o[2] + 0.3 <= t]:
            ticket.done(record, sent + 0.3)  # type: ignore[attr-defined]
            open_.remove((record, ticket, sent))
        for record, _, sent in open_:
            if sent + 0.1 <= t and record.ttft_ms is None:
                record.ttft_ms = 100.0 + 10.0 * (i % 7)
        asyncio.run(routing.admit(req, t, [decision.endpoint], Pool(), random.Random(0)))
        record = AccessRecord(request_id=str(i), method="POST", path="/v1/chat/completions")
        ticket = routing.dispatch(req, decision, record, CycleState(t, random.Random(0)), t)
        predicted.append(ticket.prediction.ttft_ms)
        record.endpoint, record.status, record.stream = "a:1", 200, True
        record.completion_tokens = 5 + i % 5
        open_.append((record, ticket, t))
    return predicted


def test_below_the_learning_cap_predictions_are_those_of_an_uncapped_predictor() -> None:
    capped = LatencyRouting(LatencyPredictor(learn_per_s=20.0), {})
    uncapped = LatencyRouting(LatencyPredictor(learn_per_s=None), {})
    assert streams(capped, 15.0, 300) == streams(uncapped, 15.0, 300)
    assert capped.predictor.endpoints["a:1"].sampled_out == 0


def test_above_the_learning_cap_streams_are_learned_at_the_cap() -> None:
    routing = LatencyRouting(LatencyPredictor(learn_per_s=20.0), {})
    streams(routing, 200.0, 600)  # 3 s at ten times the cap
    model = routing.predictor.endpoints["a:1"]
    learned = model.ttft_error.observations
    # the first second's burst (20) and 20 a second after: not the ~595 streams seen
    assert 60 <= learned <= 20 + 20 * 3
    assert model.tpot_error.observations <= learned + 1  # the same streams, fewer ended
    # streams end 0.3 s after dispatch: by the last (at 10 + 599/200 s) the first 540 had
    # ended, each with a TPOT to teach, and each was either learned or counted at its end
    assert model.sampled_out + model.tpot_error.observations == 540
    assert len(model.pending) <= 61  # every finished one released its backlog


def test_one_sampling_decision_covers_a_streams_first_byte_and_its_end() -> None:
    _, req, decision = setup({"x-llm-d-slo-ttft-ms": "500"})
    registry = CollectorRegistry()
    routing = LatencyRouting(LatencyPredictor(learn_per_s=1.0), {}, registry)  # a bucket of one
    first, a = dispatch(routing, req, decision)
    second, b = dispatch(routing, req, decision)
    for record in (first, second):
        record.endpoint, record.status, record.stream = "a:1", 200, True
        record.ttft_ms, record.completion_tokens = 250.0, 11
    routing.learn_first_tokens(10.5)  # the first takes the bucket's one stream
    assert (a.sampled, b.sampled) == (True, False)
    model = routing.predictor.endpoints["a:1"]
    assert model.ttft_error.observations == 1
    # 1.5 s later the bucket has room again, but the streams keep their decisions
    a.done(first, now=12.0)
    b.done(second, now=12.0)
    assert model.ttft_error.observations == 1 and model.tpot_error.observations == 1
    assert model.sampled_out == 1
    assert not model.pending  # both released their backlog
    assert routing.slo_outcomes == {("ttft", "met"): 2}  # and both count for the SLO
    sample = registry.get_sample_value
    assert sample("servegate_latency_prediction_sampled_out_total", {"endpoint": "a:1"}) == 1
    for target in ("ttft", "tpot"):  # the sampled-out stream is not counted as learned
        labels = {"endpoint": "a:1", "target": target}
        assert sample("servegate_latency_prediction_observations_total", labels) == 1


def test_streams_are_sampled_at_dispatch_and_counted_as_sampled_out_at_their_end() -> None:
    routing, req, decision = setup()
    routing.predictor.learn_per_s = 1.0  # a bucket of one
    tickets = [dispatch(routing, req, decision) for _ in range(2)]
    assert [t.sampled for _, t in tickets] == [True, False]
    assert list(routing.awaiting_first_token.values()) == [tickets[0][1]]  # only the learned
    model = routing.predictor.endpoints["a:1"]
    assert model.sampled_out == 0  # not yet known to have anything to teach
    for record, ticket in tickets:
        record.endpoint, record.status, record.stream = "a:1", 200, True
        record.ttft_ms, record.completion_tokens = 250.0, 11
        ticket.done(record, now=11.0)
    assert (model.ttft_error.observations, model.tpot_error.observations) == (1, 1)
    assert model.sampled_out == 1


def test_a_sampled_out_stream_is_not_tracked_nor_learned_and_a_sampled_one_is() -> None:
    routing, req, decision = setup()
    routing.predictor.learn_per_s = 1.0  # a bucket of one
    (first, a), (second, b) = dispatch(routing, req, decision), dispatch(routing, req, decision)
    model = routing.predictor.endpoints["a:1"]
    assert list(model.pending) == [a.key, b.key]  # both count in the backlog until they end
    for record in (first, second):
        record.endpoint, record.status, record.stream = "a:1", 200, True
        record.ttft_ms = 250.0
    routing.learn_first_tokens(10.5)
    assert model.ttft_error.observations == 1  # the sampled stream's TTFT, not the other's
    for record, ticket in ((first, a), (second, b)):
        record.completion_tokens = 11
        ticket.done(record, now=11.25)
    # only the sampled stream reaches the learning; the other released its backlog without it
    assert (model.ttft_error.observations, model.tpot_error.observations) == (1, 1)
    assert model.sampled_out == 1
    assert list(model.pending) == []
    assert second.predicted_ttft_ms is not None  # every request's prediction is logged


def test_a_request_that_asked_for_no_stream_is_not_sampled_unless_streamed() -> None:
    routing, req, decision = setup(stream=False)
    routing.predictor.learn_per_s = 1.0
    record, ticket = dispatch(routing, req, decision)
    assert ticket.sampled is None and not routing.awaiting_first_token
    record.endpoint, record.status, record.ttft_ms, record.completion_tokens = "a:1", 200, 250.0, 11
    ticket.done(record, now=11.0)  # a JSON answer: nothing learned, no place taken
    model = routing.predictor.endpoints["a:1"]
    assert (model.ttft_error.observations, model.sampled_out) == (0, 0)
    assert not model.pending
    tickets = [dispatch(routing, req, decision) for _ in range(2)]
    for record, ticket in tickets:  # answered with streams after all: sampled at their end
        record.endpoint, record.status, record.stream = "a:1", 200, True
        record.ttft_ms, record.completion_tokens = 250.0, 11
        ticket.done(record, now=11.0)
    assert (model.ttft_error.observations, model.tpot_error.observations) == (1, 1)
    assert model.sampled_out == 1


def test_a_stream_that_teaches_nothing_takes_no_place_under_the_cap() -> None:
    _, req, decision = setup()
    routing = LatencyRouting(LatencyPredictor(learn_per_s=1.0), {})
    burst, burst_ticket = dispatch(routing, req, decision)
    burst.endpoint, burst.status, burst.stream = "a:1", 200, True
    burst.ttft_ms, burst.completion_tokens = 50.2, 11  # 0.2 ms after dispatch: one burst
    routing.learn_first_tokens(10.5)
    burst_ticket.done(burst, now=10.05)  # and its tokens all at once: its place goes back
    assert burst_ticket.sampled
    record, ticket = dispatch(routing, req, decision)
    record.endpoint, record.status, record.stream = "a:1", 200, True
    record.ttft_ms, record.completion_tokens = 250.0, 11
    routing.learn_first_tokens(10.5)
    assert ticket.sampled  # the bucket's one stream was still there
    assert routing.predictor.endpoints["a:1"].sampled_out == 0
