"""The gateway's side of predicted-latency routing: SLO admission, dispatch, learning.

Three calls from the request path (`app.py`), none inside the pure scheduling call:

- `admit` (before scheduling): when the picker config declares `latency-slo-admitter`,
  a sheddable request no candidate can serve within its SLO waits (up to the
  admitter's `queueTimeoutMs`) or is shed with 429 `rejected-slo`.
- `dispatch` (after the decision, before the prefix indexes learn it): the chosen
  endpoint's predicted TTFT/TPOT go into the access record (and the debug header),
  its in-flight prompt backlog grows, and a request that asked for a stream is
  sampled (`LatencyPredictor.reserve`, the learning-rate cap); returns a `Ticket`.
- `admit` also teaches the predictor the TTFT of every sampled stream whose first byte
  was relayed since (from dispatch to the first byte; `Ticket.learnable_ttft_ms`):
  learnt then, before the next decision, not seconds later when the stream ends.
- `Ticket.done` (when the request ends, whatever the outcome): the backlog shrinks
  and a completed sampled stream teaches the predictor its TPOT (the rest of the
  stream over the remaining completion tokens), and its TTFT if that was not learnt
  yet. A JSON answer or a stream over the cap only releases its backlog and counts
  for the SLO outcomes: it was never tracked for its first byte.

Accuracy and SLO outcomes are exported from the runtime's registry (`_Collector`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import orjson
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from servegate.control.errors import SloUnattainable
from servegate.gateway.access_log import AccessRecord
from servegate.pool.endpoint import EndpointState
from servegate.pool.pool import Pool
from servegate.scheduling.framework import CycleState, Decision, Plugin
from servegate.scheduling.latency.plugins import (
    ARRIVED_KEY,
    PREDICTIONS_KEY,
    LatencySloAdmitter,
    find_source,
    request_slo,
)
from servegate.scheduling.latency.predictor import MIN_LEARNED_MS, LatencyPredictor, Prediction
from servegate.scheduling.latency.slo import Slo
from servegate.scheduling.request import LLMRequest

QUEUE_POLL_S = 0.02
"""How often a request held by the admitter looks again."""
DEBUG_HEADER = "x-servegate-latency"
_NO_PREDICTIONS: Mapping[str, tuple[float, float]] = MappingProxyType({})


class Ticket:
    """One dispatched request's prediction, settled once by `done`."""

    __slots__ = (
        "_done", "address", "dispatched_ms", "key", "learned_ttft_ms", "owner", "prediction",
        "predictions", "record", "sampled", "slo", "started", "taught",
    )  # fmt: skip

    def __init__(
        self,
        owner: LatencyRouting,
        address: str,
        key: int,
        prediction: Prediction,
        slo: Slo,
        started: float,
        dispatched_ms: float,
        predictions: Mapping[str, tuple[float, float]],
        record: AccessRecord,
        sampled: bool | None,
    ) -> None:
        self.owner = owner
        self.record = record
        self.address = address
        self.key = key
        self.prediction = prediction
        self.slo = slo
        self.started = started
        self.dispatched_ms = dispatched_ms
        self.predictions = predictions
        """The request's memo of every scored candidate's predictions (not copied: `debug`
        reads it right after dispatch)."""
        self.sampled = sampled
        """`LatencyPredictor.reserve`'s answer, asked at dispatch for a request that asked
        for a stream: True, learn what it shows (its TTFT at the first byte, its TPOT at
        the end); False, learn nothing (counted as sampled out at the end if it had
        something to teach). None for a request that did not ask for a stream: nothing
        to learn, unless its answer is a stream after all, then sampled at its end."""
        self.learned_ttft_ms: float | None = None
        """The TTFT seen at the first byte of a sampled stream (once: never again at `done`)."""
        self.taught = False
        """A sampled stream taught its TTFT at the first byte."""
        self._done = False

    @property
    def learnable_ttft_ms(self) -> float | None:
        """The engine-side TTFT (dispatch to first byte) once the record shows a first
        streamed byte from the predicted endpoint in a successful answer; else None."""
        r = self.record
        if (
            r.ttft_ms is None
            or not r.stream
            or r.status != 200
            or r.error is not None
            or r.endpoint != self.address
            or r.prefill_endpoint is not None
        ):
            return None
        return max(0.0, r.ttft_ms - self.dispatched_ms)

    def first_token(self, now: float) -> bool:
        """Teach a sampled stream's TTFT if it is known (by `now`); True once the ticket
        needs no more looks."""
        if self._done or self.learned_ttft_ms is not None:
            return True
        ttft = self.learnable_ttft_ms
        if ttft is None:
            return self.record.ttft_ms is not None  # a first byte that teaches nothing
        self.learned_ttft_ms = ttft
        if ttft >= MIN_LEARNED_MS:  # else nothing to learn
            self.owner.predictor.learn_ttft(self.address, self.prediction, ttft)
            self.taught = True
        return True

    def debug(self, headers: dict[str, str]) -> None:
        """Add the debug header: every scored candidate's predictions and the chosen one's."""
        body: dict[str, Any] = {
            "endpoint": self.address,
            "predicted_ttft_ms": round(self.dispatched_ms + self.prediction.ttft_ms, 3),
            "predicted_tpot_ms": round(self.prediction.tpot_ms, 3),
            "slo_ttft_ms": self.slo.ttft_ms,
            "slo_tpot_ms": self.slo.tpot_ms,
            "candidates": {
                a: {"ttft_ms": round(p[0], 3), "tpot_ms": round(p[1], 3)}
                for a, p in self.predictions.items()
            },
        }
        headers[DEBUG_HEADER] = orjson.dumps(body).decode()

    def done(self, record: AccessRecord, now: float) -> None:
        """The request ended: release its backlog, count its SLO outcome and, for a sampled
        stream, learn what it showed."""
        if self._done:
            return
        self._done = True
        sampled = self.sampled
        owner = self.owner
        predictor = owner.predictor
        ok = record.status == 200 and record.error is None
        tpot: float | None = None
        if record.stream:
            if sampled:
                owner.awaiting_first_token.pop(self.key, None)
            ttft: float | None = None
            first_ms = record.ttft_ms
            if ok and first_ms is not None:
                tokens = record.completion_tokens
                if tokens is not None and tokens > 1:
                    total_ms = (now - self.started) * 1000.0
                    tpot = max(0.0, total_ms - first_ms) / (tokens - 1)
                    record.tpot_ms = tpot
                if self.learned_ttft_ms is None:
                    ttft = max(0.0, first_ms - self.dispatched_ms)
            teaches = (
                ok
                and record.endpoint == self.address
                and record.prefill_endpoint is None
                and (
                    (ttft is not None and ttft >= MIN_LEARNED_MS)
                    or (tpot is not None and tpot >= MIN_LEARNED_MS)
                )
            )
            if sampled is None:  # asked for no stream, answered with one: sampled here
                sampled = teaches and predictor.sample(self.address, now)
            elif not sampled:
                if teaches:
                    predictor.skipped(self.address)
            elif not teaches and not self.taught:
                predictor.unreserve(self.address)  # it taught nothing: its place goes back
            if sampled and teaches:
                uncached = None
                if record.prompt_tokens is not None and record.cached_tokens is not None:
                    uncached = max(0, record.prompt_tokens - record.cached_tokens)
                predictor.completed(self.address, self.key, self.prediction, ttft, tpot, uncached)
            else:
                predictor.release(self.address, self.key)
        else:  # a JSON answer: nothing to learn
            if sampled:  # asked for a stream, answered without one (an error): nothing taught
                owner.awaiting_first_token.pop(self.key, None)
                predictor.unreserve(self.address)
            predictor.release(self.address, self.key)
        slo = self.slo
        if slo.ttft_ms is not None or slo.tpot_ms is not None:
            owner.count_slo(slo, record.ttft_ms if ok else None, tpot if ok else None)


class LatencyRouting:
    """The predictor, how plugins read it, and the optional admitter, for one runtime."""

    def __init__(
        self,
        predictor: LatencyPredictor,
        plugins: Mapping[str, Plugin],
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.predictor = predictor
        self.source = find_source(plugins, predictor)
        self.admitter = next(
            (p for p in plugins.values() if isinstance(p, LatencySloAdmitter)), None
        )
        self.shed = 0
        self.admitted_after_wait = 0
        self.slo_outcomes: Counter[tuple[str, str]] = Counter()
        self.awaiting_first_token: dict[int, Ticket] = {}
        """Dispatched streams whose TTFT is not learnt yet, by predictor key."""
        if registry is not None:
            registry.register(_Collector(self))

    async def admit(
        self,
        request: LLMRequest,
        started: float,
        candidates: list[EndpointState],
        pool: Pool,
        rng: random.Random,
    ) -> list[EndpointState] | None:
        """Hold or shed a sheddable request that no candidate can serve within its SLO.

        While it waits, the candidates are re-read from `pool`. Raises `SloUnattainable`
        (429) once `queueTimeoutMs` has passed without an
        endpoint that can; returns None when admitted at once, else the candidates
        current when it was admitted after waiting.
        """
        request.cache[ARRIVED_KEY] = started
        if self.awaiting_first_token:  # only sampled streams wait there
            self.learn_first_tokens(started)
        admitter = self.admitter
        if admitter is None:
            return None
        now = time.monotonic()
        verdict = admitter.check(CycleState(now=now, rng=rng), request, candidates)
        if verdict.admitted:
            return None
        deadline = now + admitter.queue_timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(QUEUE_POLL_S)
            request.cache.pop(PREDICTIONS_KEY, None)
            now = time.monotonic()
            candidates = pool.candidates(request.base_model, now, request.lora)
            verdict = admitter.check(CycleState(now=now, rng=rng), request, candidates)
            if verdict.admitted:
                self.admitted_after_wait += 1
                request.cache.pop(PREDICTIONS_KEY, None)
                return candidates
        self.shed += 1
        raise SloUnattainable(verdict.reason)

    def learn_first_tokens(self, now: float) -> None:
        """Teach the predictor every TTFT relayed since the last call (before a decision
        at `now`, monotonic seconds)."""
        awaiting = self.awaiting_first_token
        if awaiting:  # only those with a first byte can settle (`Ticket.first_token`)
            arrived = [t for t in awaiting.values() if t.record.ttft_ms is not None]
            for ticket in arrived:
                if ticket.first_token(now):
                    del awaiting[ticket.key]

    def dispatch(
        self,
        request: LLMRequest,
        decision: Decision,
        record: AccessRecord,
        cycle: CycleState,
        started: float,
    ) -> Ticket:
        """Note the chosen endpoint's prediction (call before the prefix indexes learn it)."""
        state = decision.endpoint
        prediction = self.source.prediction(cycle, request, state)
        memo = request.cache.get(PREDICTIONS_KEY)
        slo = request_slo(request)
        dispatched_ms = max(0.0, (cycle.now - started) * 1000.0)
        record.predicted_ttft_ms = round(dispatched_ms + prediction.ttft_ms, 3)
        record.predicted_tpot_ms = round(prediction.tpot_ms, 3)
        record.dispatched_ms = round(dispatched_ms, 3)
        record.slo_ttft_ms = slo.ttft_ms
        record.slo_tpot_ms = slo.tpot_ms
        address = state.endpoint.address
        predictor = self.predictor
        key = predictor.dispatched(address, prediction, cycle.now, record)
        sampled = predictor.reserve(address, cycle.now) if request.stream else None
        ticket = Ticket(
            self, address, key, prediction, slo, started, dispatched_ms,
            memo if isinstance(memo, dict) else _NO_PREDICTIONS, record, sampled,
        )  # fmt: skip
        if sampled:
            self.awaiting_first_token[key] = ticket
        return ticket

    def count_slo(self, slo: Slo, ttft_ms: float | None, tpot_ms: float | None) -> None:
        if slo.ttft_ms is not None:
            met = ttft_ms is not None and ttft_ms <= slo.ttft_ms
            self.slo_outcomes["ttft", "met" if met else "missed"] += 1
        if slo.tpot_ms is not None and tpot_ms is not None:
            self.slo_outcomes["tpot", "met" if tpot_ms <= slo.tpot_ms else "missed"] += 1


class _Collector(Collector):
    def __init__(self, routing: LatencyRouting) -> None:
        self._routing = routing

    def collect(self) -> Iterable[Metric]:
        routing = self._routing
        mape = GaugeMetricFamily(
            "servegate_latency_prediction_error_ratio",
            "Predictor error per endpoint: exponentially weighted mean absolute percentage "
            "error (fraction) over about the last 50 observations.",
            labels=["endpoint", "target"],
        )
        observations = CounterMetricFamily(
            "servegate_latency_prediction_observations",
            "Streams the predictor learned from, per endpoint (TTFT at the first byte, TPOT at the end).",
            labels=["endpoint", "target"],
        )
        sampled_out = CounterMetricFamily(
            "servegate_latency_prediction_sampled_out",
            "Streams the predictor did not learn from because their endpoint was over the "
            "learning-rate cap (pool latency.learn_per_s).",
            labels=["endpoint"],
        )
        backlog = GaugeMetricFamily(
            "servegate_latency_backlog_tokens",
            "Uncached prompt tokens sent per endpoint with no first token yet, each for the share "
            "of its predicted prefill time still ahead.",
            labels=["endpoint"],
        )
        now = time.monotonic()
        for address, model in sorted(routing.predictor.endpoints.items()):
            for target, acc in (("ttft", model.ttft_error), ("tpot", model.tpot_error)):
                if acc.observations:
                    mape.add_metric([address, target], acc.mape)
                observations.add_metric([address, target], acc.observations)
            sampled_out.add_metric([address], model.sampled_out)
            backlog.add_metric([address], model.backlog(now))
        slo = CounterMetricFamily(
            "servegate_latency_slo_requests",
            "Requests with an SLO header by dimension and outcome (met, missed).",
            labels=["target", "outcome"],
        )
        for (target, outcome), count in sorted(routing.slo_outcomes.items()):
            slo.add_metric([target, outcome], count)
        shed = CounterMetricFamily(
            "servegate_latency_slo_shed",
            "Sheddable requests latency-slo-admitter turned away (429 rejected-slo).",
        )
        shed.add_metric([], routing.shed)
        yield from (mape, observations, sampled_out, backlog, slo, shed)
