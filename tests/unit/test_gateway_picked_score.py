"""servegate_scheduler_picked_score: the picked endpoint's weighted score per scorer."""

from __future__ import annotations

import random

from servegate.gateway.metrics import GatewayMetrics
from servegate.pool.endpoint import Endpoint, EndpointState
from servegate.scheduling.framework import (
    CycleState,
    Decision,
    ProfileResult,
    SchedulerProfile,
    WeightedScorer,
)
from servegate.scheduling.pickers import MaxScorePicker
from servegate.scheduling.profiles import SingleProfileHandler
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.scheduler import Scheduler, ScoreTable
from servegate.scheduling.scorers import ActiveRequestScorer, KVCacheUtilizationScorer, QueueScorer
from servegate.testing.endpoints import random_endpoint_states

A, B = (EndpointState(Endpoint(address=f"10.0.0.{i}:8000", url="http://x")) for i in (1, 2))


def sample(metrics: GatewayMetrics, suffix: str, scorer: str) -> float | None:
    return metrics.registry.get_sample_value(
        f"servegate_scheduler_picked_score_{suffix}", {"name": "pool-a", "scorer": scorer}
    )


def test_only_the_picked_endpoints_scores_are_recorded() -> None:
    metrics = GatewayMetrics(lambda: [])
    scores = {
        A.endpoint.address: {"prefix-cache-scorer": 3.0, "queue-scorer": 0.5},
        B.endpoint.address: {"prefix-cache-scorer": 0.0, "queue-scorer": 2.0},
    }
    result = ProfileResult(ranked=[A, B], scores=scores, totals={})
    decision = Decision(endpoint=A, fallbacks=[B], results={"default": result})
    metrics.observe_pick("pool-a", decision)
    metrics.observe_pick("pool-a", decision)
    assert sample(metrics, "count", "prefix-cache-scorer") == 2
    assert sample(metrics, "sum", "prefix-cache-scorer") == 6.0
    assert sample(metrics, "sum", "queue-scorer") == 1.0
    assert b"servegate_scheduler_picked_score_bucket" in metrics.render()


def test_a_decision_without_its_profiles_result_records_nothing() -> None:
    metrics = GatewayMetrics(lambda: [])
    metrics.observe_pick("pool-a", Decision(endpoint=A, fallbacks=[], profile="other"))
    assert sample(metrics, "count", "prefix-cache-scorer") is None


def test_a_schedulers_score_table_records_what_its_rows_say() -> None:
    """The scheduler's lazy score table is read by position, not through its address rows;
    the histograms must hold what the rows would have given."""
    pool = random_endpoint_states(6, random.Random(3))
    scorers = [QueueScorer(), KVCacheUtilizationScorer(), ActiveRequestScorer()]
    profile = SchedulerProfile(
        "default",
        [],
        [WeightedScorer(s, w) for s, w in zip(scorers, (2.0, 1.5, 1.0), strict=True)],
        MaxScorePicker(),
    )
    scheduler = Scheduler({"default": profile}, SingleProfileHandler(), {})
    fast, by_rows = GatewayMetrics(lambda: []), GatewayMetrics(lambda: [])
    request = LLMRequest("r", RequestKind.CHAT, "m", "m", "m")
    for seed in range(20):
        pool[seed % 6].in_flight_requests += 1
        decision = scheduler.schedule(request, pool, CycleState(50.0, random.Random(seed)))
        result = decision.results["default"]
        assert isinstance(result.scores, ScoreTable)
        fast.observe_pick("pool-a", decision)
        rows = {a: dict(row) for a, row in result.scores.items()}
        copy = ProfileResult(ranked=result.ranked, scores=rows, totals={})
        by_rows.observe_pick("pool-a", Decision(decision.endpoint, [], results={"default": copy}))
    for scorer in scorers:
        for suffix in ("count", "sum"):
            assert sample(fast, suffix, scorer.name) == sample(by_rows, suffix, scorer.name)
    assert fast.render() == by_rows.render()
    assert sample(fast, "count", "queue-scorer") == 20


def test_an_endpoint_the_table_did_not_score_records_nothing() -> None:
    """A decision whose endpoint is not in its profile's score table (another profile's
    pick) observes nothing, before and after the pool's children exist."""
    table = ScoreTable([A], ["queue-scorer"], [2.0], [[0.5]])
    result = ProfileResult(ranked=[A], scores=table, totals={})
    metrics = GatewayMetrics(lambda: [])
    metrics.observe_pick("pool-a", Decision(endpoint=B, fallbacks=[], results={"default": result}))
    assert sample(metrics, "count", "queue-scorer") is None
    metrics.observe_pick("pool-a", Decision(endpoint=A, fallbacks=[], results={"default": result}))
    metrics.observe_pick("pool-a", Decision(endpoint=B, fallbacks=[], results={"default": result}))
    assert sample(metrics, "count", "queue-scorer") == 1
    assert sample(metrics, "sum", "queue-scorer") == 1.0
