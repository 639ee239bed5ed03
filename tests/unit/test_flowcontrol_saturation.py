import random

import pytest

from servegate.scheduling.factory import PluginContext, PluginParameterError
from servegate.scheduling.flowcontrol import (
    ConcurrencyDetector,
    ConcurrencyParameters,
    UtilizationDetector,
    UtilizationParameters,
)
from servegate.scheduling.framework import CycleState
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.testing.endpoints import endpoint_state

NOW = 10.0
FRESH = NOW - 0.1
STALE = NOW - 5.0


def util(**params: object) -> UtilizationDetector:
    return UtilizationDetector.from_config("u", params, PluginContext())


def conc(**params: object) -> ConcurrencyDetector:
    return ConcurrencyDetector.from_config("c", params, PluginContext())


REQUEST = LLMRequest("r", RequestKind.CHAT, "m", "m", "m", prompt_tokens=100, max_tokens=50)


def test_llm_d_defaults() -> None:
    u = UtilizationParameters()
    c = ConcurrencyParameters()
    assert (u.queue_depth_threshold, u.kv_cache_util_threshold, u.staleness_s) == (5, 0.8, 0.2)
    assert (u.staleness_policy, u.headroom) == ("saturated", 0.0)
    assert (c.concurrency_mode, c.max_concurrency, c.max_token_concurrency) == (
        "requests",
        100,
        1_000_000,
    )


@pytest.mark.parametrize(
    ("endpoints", "expected"),
    [
        # max(0/5, 0/0.8) = 0
        pytest.param([dict()], 0.0, id="idle"),
        # max(5/5, 0.4/0.8) = 1.0
        pytest.param([dict(waiting=5, kv_usage=0.4)], 1.0, id="queue-bound"),
        # max(1/5, 0.72/0.8) = 0.9
        pytest.param([dict(waiting=1, kv_usage=0.72)], 0.9, id="kv-bound"),
        # (max(10/5, 0) + max(0, 0.4/0.8)) / 2 = (2 + 0.5) / 2 = 1.25
        pytest.param([dict(waiting=10), dict(kv_usage=0.4)], 1.25, id="average"),
        # stale counts 1.0: (0 + 1) / 2
        pytest.param([dict(), dict(scraped_at=STALE)], 0.5, id="stale-saturated"),
        # every endpoint stale: fail open
        pytest.param([dict(scraped_at=STALE), dict(scraped_at=0.0)], 0.0, id="all-stale"),
        # in flight 4, scrape shows waiting 1 + running 1: credit 2 → (1 + 2)/5 = 0.6
        pytest.param([dict(waiting=1, running=1, in_flight_requests=4)], 0.6, id="credit"),
    ],
)
def test_utilization_saturation(endpoints: list[dict[str, float]], expected: float) -> None:
    states = [
        endpoint_state(f"10.0.0.{i}:8000", **{"scraped_at": FRESH, **e})  # type: ignore[arg-type]
        for i, e in enumerate(endpoints)
    ]
    assert util().saturation(states, NOW) == pytest.approx(expected)


def test_utilization_pending_spreads_over_fresh_endpoints() -> None:
    states = [endpoint_state(f"10.0.0.{i}:8000", scraped_at=FRESH) for i in range(2)]
    # 4 pending over 2 endpoints: each (0 + 2)/5 = 0.4
    assert util().saturation(states, NOW, pending=4) == pytest.approx(0.4)


def test_utilization_ignore_policy_leaves_stale_out() -> None:
    states = [
        endpoint_state("a:1", waiting=5, scraped_at=FRESH),
        endpoint_state("b:1", scraped_at=STALE),
    ]
    # only the fresh one counts: 5/5
    assert util(stalenessPolicy="ignore").saturation(states, NOW) == pytest.approx(1.0)
    assert util().stale_count(states, NOW) == 1


def test_no_endpoints_is_saturated() -> None:
    assert util().saturation([], NOW) == 1.0
    assert conc().saturation([], NOW) == 1.0


def test_utilization_filter_drops_over_limit_and_fails_open() -> None:
    ok = endpoint_state("a:1", waiting=2, scraped_at=FRESH)
    full = endpoint_state("b:1", waiting=5, scraped_at=FRESH)
    stale = endpoint_state("c:1", scraped_at=STALE)
    cycle = CycleState(NOW, random.Random(0))
    assert util().filter(cycle, REQUEST, [ok, full, stale]) == [ok]
    # headroom 0.2: limit 6 → waiting 5 passes
    assert util(headroom=0.2).filter(cycle, REQUEST, [ok, full]) == [ok, full]
    assert util().filter(cycle, REQUEST, [full, stale]) == [full, stale]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # (3 + 1 + 2 pending) / (2 x 10) = 0.3
        pytest.param("requests", 0.3, id="requests"),
        # (500 + 100 + 400 pending) / (2 x 1000) = 0.5
        pytest.param("tokens", 0.5, id="tokens"),
        # a: max((3+1)/10, (500+200)/1000) = 0.7; b: max((1+1)/10, (100+200)/1000) = 0.3 → 0.5
        pytest.param("hybrid", 0.5, id="hybrid"),
    ],
)
def test_concurrency_saturation(mode: str, expected: float) -> None:
    states = [
        endpoint_state("a:1", in_flight_requests=3, in_flight_tokens=500),
        endpoint_state("b:1", in_flight_requests=1, in_flight_tokens=100),
    ]
    detector = conc(concurrencyMode=mode, maxConcurrency=10, maxTokenConcurrency=1000)
    assert detector.saturation(states, NOW, pending=2, pending_tokens=400) == pytest.approx(
        expected
    )


def test_concurrency_filter_limits() -> None:
    a = endpoint_state("a:1", in_flight_requests=9, in_flight_tokens=0)
    b = endpoint_state("b:1", in_flight_requests=10, in_flight_tokens=900)
    cycle = CycleState(NOW, random.Random(0))
    assert conc(maxConcurrency=10).filter(cycle, REQUEST, [a, b]) == [a]
    # incoming 100 + 50 tokens: b would reach 1050 > 1000
    tokens = conc(concurrencyMode="tokens", maxTokenConcurrency=1000)
    assert tokens.filter(cycle, REQUEST, [a, b]) == [a]
    assert conc(maxConcurrency=10, headroom=0.5).filter(cycle, REQUEST, [a, b]) == [a, b]


@pytest.mark.parametrize(
    ("factory", "params", "fragment"),
    [
        pytest.param(util, {"queueThreshold": 5}, "unknown parameter 'queueThreshold'", id="typo"),
        pytest.param(util, {"kvCacheUtilThreshold": 1.5}, "kvCacheUtilThreshold", id="kv>1"),
        pytest.param(util, {"metricsStalenessThreshold": "soon"}, "not a duration", id="dur"),
        pytest.param(util, {"stalenessPolicy": "hold"}, "stalenessPolicy", id="policy"),
        pytest.param(conc, {"concurrencyMode": "bytes"}, "concurrencyMode", id="mode"),
        pytest.param(conc, {"maxConcurrency": 0}, "maxConcurrency", id="zero"),
    ],
)
def test_bad_parameters_name_the_field(
    factory: object, params: dict[str, object], fragment: str
) -> None:
    with pytest.raises(PluginParameterError) as info:
        factory(**params)  # type: ignore[operator]
    assert fragment in str(info.value)
