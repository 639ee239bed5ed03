"""From raw request results to one summary per target and load point.

- Rates divide by the target's own wall time (the sum of its segments), so the other
  targets' turns in between do not dilute them. `req/s` counts successful requests.
- Percentiles interpolate linearly between order statistics (numpy's default).
  Inter-token latencies are pooled over all requests' gaps.
- Hit rate: from the engines' counters (hits / queries, in tokens) when given, else
  from responses (Σ cached_tokens / Σ prompt_tokens over requests that report both).
- Balance: max/mean of requests per replica (1.0 is perfect), from the engines'
  request counters when given, else from the `x-gateway-destination-endpoint`
  response header (replicas that served nothing are then invisible).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from servegate.bench.runner import TargetRun


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class TargetSummary:
    target: str
    url: str
    load: str
    """The load point's label, e.g. `c=8` or `rate=2/s`."""
    load_kind: str
    load_value: float
    requests: int
    errors: int
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    req_per_s: float = 0.0
    output_tok_per_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    ttft_p99_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_p99_s: float | None = None
    hit_rate: float | None = None
    hit_rate_source: str | None = None
    """`engine` (the replicas' counters) or `usage` (cached_tokens in responses)."""
    replica_requests: dict[str, float] = field(default_factory=dict)
    balance: float | None = None
    """max/mean requests per replica."""
    balance_source: str | None = None
    """`engine` or `header`."""
    engine_scrapes_failed: int = 0
    """Before/after pairs of engine `/metrics` reads that failed (their segment is left out)."""


def _usage_hit_rate(run: TargetRun) -> float | None:
    cached = prompt = 0
    for result in run.results:
        if result.ok and result.cached_tokens is not None and result.prompt_tokens:
            cached += result.cached_tokens
            prompt += result.prompt_tokens
    return cached / prompt if prompt else None


def _engine_hit_rate(run: TargetRun) -> float | None:
    hits = queries = 0.0
    seen = False
    for delta in run.engine_deltas.values():
        if delta.prefix_hits is not None and delta.prefix_queries is not None:
            hits += delta.prefix_hits
            queries += delta.prefix_queries
            seen = True
    if not seen or queries <= 0:
        return None
    return hits / queries


def _replica_counts(run: TargetRun) -> tuple[dict[str, float], str | None]:
    engine_counts = {
        url: delta.requests
        for url, delta in run.engine_deltas.items()
        if delta.requests is not None
    }
    if engine_counts and sum(engine_counts.values()) > 0:
        return engine_counts, "engine"
    served = Counter(r.served_by for r in run.results if r.ok and r.served_by)
    if served:
        return {name: float(count) for name, count in sorted(served.items())}, "header"
    return {}, None


def balance(counts: Sequence[float]) -> float | None:
    if not counts:
        return None
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean > 0 else None


def summarize(run: TargetRun) -> TargetSummary:
    ok = [r for r in run.results if r.ok]
    errors = Counter(r.error_kind for r in run.results if r.error_kind is not None)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [gap for r in ok for gap in r.itl_s]
    e2es = [r.e2e_s for r in ok]
    wall = run.wall_s
    hit_rate, hit_source = _engine_hit_rate(run), "engine"
    if hit_rate is None:
        hit_rate, hit_source = _usage_hit_rate(run), "usage"
    replicas, balance_source = _replica_counts(run)
    return TargetSummary(
        target=run.target.name,
        url=run.target.url,
        load=run.point.label,
        load_kind=str(run.point.kind),
        load_value=run.point.value,
        requests=len(run.results),
        errors=sum(errors.values()),
        errors_by_kind=dict(sorted(errors.items())),
        wall_s=wall,
        req_per_s=len(ok) / wall if wall > 0 else 0.0,
        output_tok_per_s=sum(r.output_tokens for r in ok) / wall if wall > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(gaps, 50),
        itl_p99_s=percentile(gaps, 99),
        e2e_p50_s=percentile(e2es, 50),
        e2e_p99_s=percentile(e2es, 99),
        hit_rate=hit_rate,
        hit_rate_source=hit_source if hit_rate is not None else None,
        replica_requests=replicas,
        balance=balance(list(replicas.values())),
        balance_source=balance_source,
        engine_scrapes_failed=sum(d.failed_scrapes for d in run.engine_deltas.values()),
    )


# -- ratios between targets, with confidence intervals over rounds ------------------

T_975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
    9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042,
}  # fmt: skip
"""Student's t, two-sided 95 %, by degrees of freedom (a df between two entries uses
the smaller one, which widens the interval slightly; above 30, 1.96)."""

SMALL_ROUND = 30
"""Fewer successful requests than this per round make a round's p99 close to its maximum."""


def t_critical(df: int) -> float:
    if df < 1:
        raise ValueError("a confidence interval needs at least two rounds")
    if df > 30:
        return 1.96
    return T_975[max(k for k in T_975 if k <= df)]


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    higher_is_better: bool

    def value(self, summary: TargetSummary) -> float | None:
        if self.name == "hit rate":
            return summary.hit_rate
        if self.name == "TTFT p50":
            return summary.ttft_p50_s if summary.ttft_p50_s is not None else summary.e2e_p50_s
        if self.name == "TTFT p99":
            return summary.ttft_p99_s if summary.ttft_p99_s is not None else summary.e2e_p99_s
        if self.name == "throughput":
            return summary.output_tok_per_s or summary.req_per_s
        if self.name == "balance":
            return summary.balance
        raise KeyError(self.name)


RATIO_METRICS = (
    Metric("hit rate", higher_is_better=True),
    Metric("TTFT p50", higher_is_better=False),
    Metric("TTFT p99", higher_is_better=False),
    Metric("throughput", higher_is_better=True),
    Metric("balance", higher_is_better=False),
)


@dataclass(frozen=True, slots=True)
class RatioEstimate:
    """`target`'s metric over `base`'s: the geometric mean of the per-round ratios (both
    targets ran each round on the same requests), with a 95 % t-interval on the log
    ratios. With one usable round there is no interval (`low`/`high` None)."""

    metric: str
    target: str
    base: str
    load: str
    ratio: float
    low: float | None
    high: float | None
    rounds: int
    higher_is_better: bool

    @property
    def separated(self) -> bool:
        """The interval leaves out 1.0: the two targets differ on this metric."""
        return self.low is not None and self.high is not None and (self.low > 1 or self.high < 1)

    @property
    def better(self) -> bool | None:
        """Whether `target` is better than `base` on this metric; None when not separated."""
        if not self.separated:
            return None
        return (self.ratio > 1) == self.higher_is_better

    def describe(self) -> str:
        interval = (
            f" [{self.low:.3g}, {self.high:.3g}]"
            if self.low is not None and self.high is not None
            else f" ({self.rounds} round, no interval)"
        )
        return f"{self.metric} {self.ratio:.2f}×{interval}"


def ratio_interval(ratios: Sequence[float]) -> tuple[float, float | None, float | None]:
    """Geometric mean of `ratios` (all > 0) and its 95 % t-interval (None for one ratio)."""
    if not ratios:
        raise ValueError("no ratios")
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean = sum(logs) / n
    if n < 2:
        return math.exp(mean), None, None
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t_critical(n - 1) * sd / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def round_summaries(run: TargetRun) -> dict[int, TargetSummary]:
    """Each round of `run` summarized on its own, by round index."""
    return {record.index: summarize(run.round_run(record)) for record in run.rounds}


def compare_runs(
    run: TargetRun, base: TargetRun, metrics: Sequence[Metric] = RATIO_METRICS
) -> list[RatioEstimate]:
    """Per metric, `run` over `base` paired round by round (rounds where either has no
    value, or a zero base, are left out)."""
    mine, theirs = round_summaries(run), round_summaries(base)
    estimates = []
    for metric in metrics:
        ratios = []
        for index, summary in mine.items():
            other = theirs.get(index)
            if other is None:
                continue
            value, reference = metric.value(summary), metric.value(other)
            if value is None or reference is None or value <= 0 or reference <= 0:
                continue
            ratios.append(value / reference)
        if not ratios:
            continue
        ratio, low, high = ratio_interval(ratios)
        estimates.append(
            RatioEstimate(
                metric=metric.name,
                target=run.target.name,
                base=base.target.name,
                load=run.point.label,
                ratio=ratio,
                low=low,
                high=high,
                rounds=len(ratios),
                higher_is_better=metric.higher_is_better,
            )
        )
    return estimates


def sample_warnings(
    run: TargetRun, base: TargetRun, estimates: Sequence[RatioEstimate]
) -> list[str]:
    """Why these numbers may not tell `run` and `base` apart."""
    lines = []
    label = f"{run.target.name} vs {base.target.name} at {run.point.label}"
    rounds = min(len(run.rounds), len(base.rounds))
    if rounds < 2:
        lines.append(f"{label}: {rounds} round, so no confidence interval; use --rounds 3 or more")
    vague = [e.metric for e in estimates if e.low is not None and not e.separated]
    if vague:
        lines.append(
            f"{label}: the sample is too small to separate them on {', '.join(vague)} "
            f"(95 % interval spans 1.0 over {rounds} rounds); run more rounds or requests"
        )
    smallest = min(
        (sum(1 for r in record.results if r.ok) for record in (*run.rounds, *base.rounds)),
        default=0,
    )
    if 0 < smallest < SMALL_ROUND:
        lines.append(
            f"{label}: a round has only {smallest} successful requests, so its p99 is "
            "about its slowest request"
        )
    return lines
