from __future__ import annotations

import pytest

from servegate.bench.client import RequestResult
from servegate.bench.engine_counters import EngineDelta
from servegate.bench.runner import LoadKind, LoadPoint, Target, TargetRun
from servegate.bench.stats import balance, percentile, summarize


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        pytest.param([1.0, 2.0, 3.0, 4.0], 50, 2.5, id="p50-even"),  # rank 1.5 -> 2 + 0.5
        pytest.param([1.0, 2.0, 3.0, 4.0], 90, 3.7, id="p90"),  # rank 2.7 -> 3 + 0.7
        pytest.param([4.0, 1.0, 3.0, 2.0], 0, 1.0, id="p0-unsorted"),
        pytest.param([1.0, 2.0, 3.0, 4.0], 100, 4.0, id="p100"),
        pytest.param([7.0], 99, 7.0, id="single"),
        pytest.param([], 50, None, id="empty"),
    ],
)
def test_percentile(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        pytest.param([10.0, 10.0], 1.0, id="even"),
        pytest.param([30.0, 10.0, 20.0], 1.5, id="skewed"),  # max 30 / mean 20
        pytest.param([0.0, 0.0], None, id="no-requests"),
        pytest.param([], None, id="no-replicas"),
    ],
)
def test_balance(counts: list[float], expected: float | None) -> None:
    assert balance(counts) == expected


def ok(
    e2e: float,
    ttft: float | None = None,
    itl: tuple[float, ...] = (),
    tokens: int = 0,
    prompt: int | None = None,
    cached: int | None = None,
    served_by: str | None = None,
) -> RequestResult:
    return RequestResult(
        started_at=0.0,
        status=200,
        e2e_s=e2e,
        ttft_s=ttft,
        itl_s=itl,
        output_tokens=tokens,
        prompt_tokens=prompt,
        cached_tokens=cached,
        served_by=served_by,
    )


def failed(kind: str) -> RequestResult:
    return RequestResult(started_at=0.0, status=0, e2e_s=1.0, error_kind=kind, error="x")


def run_with(results: list[RequestResult], wall_s: float = 2.0) -> TargetRun:
    run = TargetRun(Target("t", "http://127.0.0.1:1"), LoadPoint(LoadKind.CONCURRENCY, 4))
    run.results = results
    run.wall_s = wall_s
    return run


def test_summary_arithmetic() -> None:
    run = run_with(
        [
            ok(1.0, ttft=0.1, itl=(0.01, 0.03), tokens=10, prompt=100, cached=50, served_by="a"),
            ok(3.0, ttft=0.3, itl=(0.02,), tokens=30, prompt=100, cached=0, served_by="a"),
            ok(2.0, ttft=0.2, tokens=20, served_by="b"),
            failed("429"),
            failed("429"),
            failed("timeout"),
        ]
    )
    summary = summarize(run)
    assert (summary.requests, summary.errors) == (6, 3)
    assert summary.errors_by_kind == {"429": 2, "timeout": 1}
    assert summary.req_per_s == pytest.approx(1.5)  # 3 ok / 2 s
    assert summary.output_tok_per_s == pytest.approx(30.0)  # (10 + 30 + 20) / 2 s
    assert summary.ttft_p50_s == pytest.approx(0.2)
    assert summary.e2e_p50_s == pytest.approx(2.0)
    assert summary.itl_p50_s == pytest.approx(0.02)  # pooled gaps 0.01, 0.02, 0.03
    # usage: 50 cached of 200 prompt tokens (the third request reports neither)
    assert summary.hit_rate == pytest.approx(0.25)
    assert summary.hit_rate_source == "usage"
    # header: a served 2, b served 1: max 2 / mean 1.5
    assert summary.replica_requests == {"a": 2.0, "b": 1.0}
    assert summary.balance == pytest.approx(4 / 3)
    assert summary.balance_source == "header"
    assert (summary.load, summary.load_kind, summary.load_value) == ("c=4", "concurrency", 4)


def test_engine_counters_win_over_usage_and_headers() -> None:
    run = run_with([ok(1.0, prompt=100, cached=100, served_by="a")])
    run.engine_deltas = {
        "http://e1": EngineDelta(prefix_hits=30, prefix_queries=100, requests=3),
        "http://e2": EngineDelta(prefix_hits=10, prefix_queries=100, requests=1),
    }
    summary = summarize(run)
    assert summary.hit_rate == pytest.approx(0.2)  # (30 + 10) / (100 + 100)
    assert summary.hit_rate_source == "engine"
    assert summary.replica_requests == {"http://e1": 3, "http://e2": 1}
    assert summary.balance == pytest.approx(1.5)  # max 3 / mean 2
    assert summary.balance_source == "engine"


def test_nothing_measurable_gives_none() -> None:
    summary = summarize(run_with([failed("connection")], wall_s=0.0))
    assert summary.req_per_s == 0.0
    assert summary.ttft_p50_s is None
    assert summary.hit_rate is None
    assert summary.hit_rate_source is None
    assert summary.balance is None


def test_failed_engine_reads_are_counted() -> None:
    run = run_with([ok(1.0)])
    run.engine_deltas = {"http://e1": EngineDelta(failed_scrapes=2), "http://e2": EngineDelta()}
    assert summarize(run).engine_scrapes_failed == 2
