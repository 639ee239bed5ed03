from __future__ import annotations

import math

import pytest

from servegate.bench.client import RequestResult
from servegate.bench.engine_counters import EngineDelta
from servegate.bench.runner import LoadKind, LoadPoint, RoundRecord, Target, TargetRun
from servegate.bench.stats import (
    balance,
    compare_runs,
    percentile,
    ratio_interval,
    sample_warnings,
    summarize,
    t_critical,
)


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


# -- ratios with intervals over rounds ------------------------------------------------


def test_t_critical_values() -> None:
    assert t_critical(1) == pytest.approx(12.706)
    assert t_critical(4) == pytest.approx(2.776)
    assert t_critical(11) == t_critical(10)  # between entries: the smaller df, wider
    assert t_critical(100) == 1.96
    with pytest.raises(ValueError, match="two rounds"):
        t_critical(0)


def test_ratio_interval_is_geometric_with_a_t_interval_on_the_logs() -> None:
    ratio, low, high = ratio_interval([2.0, 8.0])  # logs ln2, ln8: mean ln4, sd ln4/sqrt2
    assert ratio == pytest.approx(4.0)
    half = 12.706 * (math.log(4.0) / math.sqrt(2)) / math.sqrt(2)
    assert low == pytest.approx(math.exp(math.log(4.0) - half))
    assert high == pytest.approx(math.exp(math.log(4.0) + half))
    assert ratio_interval([3.0]) == (pytest.approx(3.0), None, None)
    same = ratio_interval([1.5, 1.5, 1.5])
    assert same == (pytest.approx(1.5), pytest.approx(1.5), pytest.approx(1.5))


def _rounds_run(name: str, ttfts_per_round: list[list[float]], hits: list[float]) -> TargetRun:
    run = TargetRun(Target(name, f"http://{name}"), LoadPoint(LoadKind.CONCURRENCY, 4))
    for index, (ttfts, hit) in enumerate(zip(ttfts_per_round, hits, strict=True)):
        record = RoundRecord(index, [ok(1.0, ttft=t, tokens=10) for t in ttfts], 1.0)
        record.engine_deltas["e"] = EngineDelta(prefix_hits=hit, prefix_queries=100.0)
        run.rounds.append(record)
        run.results += record.results
        run.wall_s += 1.0
    return run


def test_compare_runs_pairs_rounds_and_separates_a_consistent_difference() -> None:
    fast = [[0.05] * 40, [0.06] * 40, [0.05] * 40]
    slow = [[0.10] * 40, [0.11] * 40, [0.10] * 40]
    base = _rounds_run("base", slow, [20.0, 22.0, 21.0])
    better = _rounds_run("better", fast, [80.0, 82.0, 79.0])
    estimates = {e.metric: e for e in compare_runs(better, base)}
    hit, ttft = estimates["hit rate"], estimates["TTFT p50"]
    assert hit.rounds == 3 and hit.separated and hit.better is True
    assert hit.low is not None and hit.low > 3.0  # ~3.8x, every round
    assert ttft.separated and ttft.better is True and ttft.ratio < 0.6
    assert estimates["throughput"].separated is False  # the same tokens in the same time
    assert estimates["throughput"].better is None
    assert "hit rate 3.8" in hit.describe() and "[" in hit.describe()
    warnings = sample_warnings(better, base, list(estimates.values()))
    assert warnings == [
        "better vs base at c=4: the sample is too small to separate them on throughput "
        "(95 % interval spans 1.0 over 3 rounds); run more rounds or requests"
    ]


def test_noisy_or_small_samples_are_flagged() -> None:
    base = _rounds_run("base", [[0.10] * 5, [0.10] * 5], [20.0, 20.0])
    noisy = _rounds_run("noisy", [[0.05] * 5, [0.20] * 5], [10.0, 40.0])
    estimates = compare_runs(noisy, base)
    warnings = sample_warnings(noisy, base, estimates)
    assert any("too small to separate them on hit rate, TTFT p50" in w for w in warnings)
    assert any("a round has only 5 successful requests" in w for w in warnings)
    one = _rounds_run("one", [[0.05] * 40], [50.0])
    lone = compare_runs(one, _rounds_run("b", [[0.1] * 40], [10.0]))
    assert all(e.low is None and e.rounds == 1 for e in lone)
    assert "(1 round, no interval)" in lone[0].describe()
    assert any("1 round, so no confidence interval" in w for w in sample_warnings(one, one, lone))
