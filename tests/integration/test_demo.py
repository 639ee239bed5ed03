"""`servegate demo`, bounded by request count: the comparison is printed and the
prefix-aware default beats round-robin on the replicas' own cache counters."""

from __future__ import annotations

import io

from rich.console import Console

from servegate.demo import ROUND_ROBIN, SERVEGATE, DemoSpec, run_demo, turn_order

REQUESTS = 120


async def test_demo_prints_the_comparison_and_servegate_hits_more() -> None:
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=False, color_system=None)
    spec = DemoSpec(port=0, max_requests=REQUESTS, phase_seconds=120.0, speed=4.0)
    result = await run_demo(spec, console, live_view=True)
    text = out.getvalue()
    rr, sg = result.phase(ROUND_ROBIN), result.phase(SERVEGATE)
    # the same number of requests through each, none failed, every replica counted
    assert len(rr.results) == len(sg.results) == REQUESTS
    kinds = [(r.error_kind, r.error) for r in rr.results + sg.results if not r.ok]
    assert rr.errors == sg.errors == 0, kinds
    assert sum(rr.served.values()) == sum(sg.served.values()) == REQUESTS
    assert len(sg.served) == spec.replicas and all(n > 0 for n in sg.served.values())
    # the working set is larger than one replica's cache, so routing decides the hit rate
    assert rr.hit_rate is not None and sg.hit_rate is not None
    assert sg.hit_rate > rr.hit_rate + 0.2, (rr.hit_rate, sg.hit_rate)
    assert result.shows_the_difference
    assert rr.cache_resets_failed == sg.cache_resets_failed == 0
    # what the user reads: the side-by-side summary, readable in 80 columns
    assert "Same traffic, same cluster" in text
    assert "cache hit rate" in text and "TTFT p99" in text and "balance" in text
    assert f"{100 * sg.hit_rate:.1f} %" in text and f"{100 * rr.hit_rate:.1f} %" in text
    assert "r1 = " + result.replica_urls[0] in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_turns_alternate_so_drift_hits_both_policies() -> None:
    assert turn_order(1) == [ROUND_ROBIN, SERVEGATE]
    assert turn_order(2) == [ROUND_ROBIN, SERVEGATE, SERVEGATE, ROUND_ROBIN]
    assert turn_order(3).count(ROUND_ROBIN) == 3
