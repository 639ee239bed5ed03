"""The gateway's latency bookkeeping: what a finished request teaches, and what it does not."""

from __future__ import annotations

import asyncio
import random

import pytest

from servegate.gateway.access_log import AccessRecord
from servegate.gateway.latency import LatencyRouting
from servegate.pool.endpoint import Endpoint, EndpointMetrics, EndpointState
from servegate.scheduling.framework import CycleState, Decision
from servegate.scheduling.latency.predictor import LatencyPredictor
from servegate.scheduling.request import LLMRequest, RequestKind


def setup(headers: dict[str, str] | None = None) -> tuple[LatencyRouting, LLMRequest, Decision]:
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
    routing.learn_first_tokens()  # no first byte yet: nothing to learn
    assert model.ttft_error.observations == 0
    record.endpoint, record.status, record.stream = "a:1", 200, True
    record.ttft_ms = 250.0  # the first byte, 200 ms after dispatch; the stream goes on
    asyncio.run(routing.admit(req, 10.5, [decision.endpoint], None, random.Random(0)))  # type: ignore[arg-type]
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
    routing.learn_first_tokens()
    assert not routing.awaiting_first_token  # looked at once, then no more
    model = routing.predictor.endpoints["a:1"]
    ticket.done(record, now=11.0)
    assert model.ttft_error.observations == 0
