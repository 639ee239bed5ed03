"""servegate_scheduler_picked_score: the picked endpoint's weighted score per scorer."""

from __future__ import annotations

from servegate.gateway.metrics import GatewayMetrics
from servegate.pool.endpoint import Endpoint, EndpointState
from servegate.scheduling.framework import Decision, ProfileResult

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
