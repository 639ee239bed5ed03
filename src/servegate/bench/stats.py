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
