"""Every scorer's formula, one table per scorer, arithmetic beside each expectation."""

from __future__ import annotations

import math
import random

import pytest

from servegate.pool.endpoint import EndpointState, LoraInfo
from servegate.scheduling.factory import PluginContext, PluginParameterError
from servegate.scheduling.framework import CycleState
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.scorers import (
    ActiveRequestScorer,
    KVCacheUtilizationScorer,
    LoadAwareScorer,
    LoraAffinityScorer,
    QueueScorer,
    RunningRequestsSizeScorer,
    TokenLoadScorer,
    inverted_min_max,
)
from servegate.testing.endpoints import addresses, endpoint_state

NAN = float("nan")
CYCLE = CycleState(now=100.0, rng=random.Random(0))


def request(lora: str | None = None) -> LLMRequest:
    model = lora or "base"
    return LLMRequest("r1", RequestKind.CHAT, model, model, "base", lora=lora)


def states(**columns: list[float] | list[int] | list[LoraInfo | None]) -> list[EndpointState]:
    n = len(next(iter(columns.values())))
    return [
        endpoint_state(address, **{k: v[i] for k, v in columns.items()})  # type: ignore[arg-type]
        for i, address in enumerate(addresses(n))
    ]


def same(actual: list[float], expected: list[float]) -> bool:
    return len(actual) == len(expected) and all(
        (math.isnan(a) and math.isnan(e)) or a == pytest.approx(e)
        for a, e in zip(actual, expected, strict=True)
    )


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param([0.0, 5.0, 10.0], [1.0, 0.5, 0.0], id="spread"),  # (10-q)/(10-0)
        pytest.param([3.0, 3.0, 3.0], [1.0, 1.0, 1.0], id="all-equal"),
        pytest.param([7.0], [1.0], id="one"),
        pytest.param([2.0, 6.0, 4.0], [1.0, 0.0, 0.5], id="unsorted"),  # (6-4)/(6-2) = 0.5
        pytest.param([2.0, NAN, 4.0], [1.0, NAN, 0.0], id="nan-inside"),
        pytest.param([NAN, 2.0, 4.0], [NAN, 1.0, 0.0], id="nan-first"),
        pytest.param([NAN, NAN], [1.0, 1.0], id="all-nan"),
        pytest.param([], [], id="empty"),
    ],
)
def test_inverted_min_max(values: list[float], expected: list[float]) -> None:
    assert same(inverted_min_max(values), expected)


@pytest.mark.parametrize(
    ("waiting", "expected"),
    [
        pytest.param([0, 5, 10], [1.0, 0.5, 0.0], id="spread"),  # (10-5)/(10-0) = 0.5
        pytest.param([4, 4], [1.0, 1.0], id="all-equal-is-one"),
        pytest.param([1, 3, 9], [1.0, 0.75, 0.0], id="offset-min"),  # (9-3)/(9-1) = 0.75
    ],
)
def test_queue_scorer(waiting: list[float], expected: list[float]) -> None:
    eps = states(waiting=[float(w) for w in waiting])
    assert same(QueueScorer().score(CYCLE, request(), eps), expected)


@pytest.mark.parametrize(
    ("running", "expected"),
    [
        pytest.param([2, 4, 6], [1.0, 0.5, 0.0], id="spread"),  # (6-4)/(6-2) = 0.5
        pytest.param([0, 0], [1.0, 1.0], id="all-equal-is-one"),
        pytest.param([10, 0], [0.0, 1.0], id="two"),
    ],
)
def test_running_requests_size_scorer(running: list[float], expected: list[float]) -> None:
    eps = states(running=[float(r) for r in running])
    assert same(RunningRequestsSizeScorer().score(CYCLE, request(), eps), expected)


@pytest.mark.parametrize(
    ("kv", "expected"),
    [
        pytest.param([0.0, 0.25, 1.0], [1.0, 0.75, 0.0], id="range"),  # 1 - 0.25
        pytest.param([1.2], [-0.2], id="over-full-left-to-framework-clamp"),
    ],
)
def test_kv_cache_utilization_scorer(kv: list[float], expected: list[float]) -> None:
    assert same(KVCacheUtilizationScorer().score(CYCLE, request(), states(kv_usage=kv)), expected)


@pytest.mark.parametrize(
    ("idle", "busy", "in_flight", "expected"),
    [
        pytest.param(0, 1.0, [0, 2, 4], [1.0, 0.5, 0.0], id="defaults"),  # (4-2)/4
        pytest.param(0, 1.0, [0, 0], [1.0, 1.0], id="all-idle"),
        pytest.param(0, 1.0, [3, 3], [0.0, 0.0], id="all-equally-busy"),  # (3-3)/3 as llm-d
        pytest.param(0, 0.5, [0, 4], [1.0, 0.0], id="idle-beats-max-busy"),
        pytest.param(2, 0.5, [1, 3, 4], [1.0, 0.125, 0.0], id="threshold"),  # (4-3)/4*0.5
        pytest.param(5, 1.0, [1, 3, 4], [1.0, 1.0, 1.0], id="all-under-threshold"),
    ],
)
def test_active_request_scorer(
    idle: int, busy: float, in_flight: list[int], expected: list[float]
) -> None:
    scorer = ActiveRequestScorer(idle_threshold=idle, max_busy_score=busy)
    eps = states(in_flight_requests=in_flight)
    assert same(scorer.score(CYCLE, request(), eps), expected)


@pytest.mark.parametrize(
    ("threshold", "waiting", "expected"),
    [
        pytest.param(128, 0, 0.5, id="empty-is-half"),
        pytest.param(128, 64, 0.25, id="half-full"),  # 0.5*(1-64/128)
        pytest.param(128, 128, 0.0, id="at-threshold"),
        pytest.param(128, 500, 0.0, id="over-threshold"),  # min(500,128)=128
        pytest.param(10, 1, 0.45, id="small-threshold"),  # 0.5*(1-1/10)
    ],
)
def test_load_aware_scorer(threshold: int, waiting: float, expected: float) -> None:
    eps = states(waiting=[float(waiting)])
    assert same(LoadAwareScorer(threshold=threshold).score(CYCLE, request(), eps), [expected])


@pytest.mark.parametrize(
    ("threshold", "tokens", "expected"),
    [
        pytest.param(1000, 0, 1.0, id="none"),
        pytest.param(1000, 250, 0.75, id="quarter"),  # 1-250/1000
        pytest.param(1000, 1000, 0.0, id="at-threshold"),
        pytest.param(1000, 5000, 0.0, id="over"),  # 1-min(1, 5)
        pytest.param(4_194_304, 2_097_152, 0.5, id="default-threshold"),  # 1-2^21/2^22
    ],
)
def test_token_load_scorer(threshold: int, tokens: int, expected: float) -> None:
    eps = states(in_flight_tokens=[tokens])
    scorer = TokenLoadScorer(queue_threshold_tokens=threshold)
    assert same(scorer.score(CYCLE, request(), eps), [expected])


def lora(max_lora: int, running: set[str], waiting: set[str] | None = None) -> LoraInfo:
    return LoraInfo(max_lora=max_lora, running=frozenset(running), waiting=frozenset(waiting or ()))


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        pytest.param(lora(2, {"a1"}), 1.0, id="running"),
        pytest.param(lora(2, {"a1", "a2"}), 1.0, id="running-at-capacity"),
        pytest.param(lora(2, {"a2"}), 0.8, id="slot-free"),  # |{a2}| = 1 < 2
        pytest.param(lora(2, {"a2"}, {"a2"}), 0.8, id="same-adapter-running-and-waiting"),
        pytest.param(lora(2, {"a2"}, {"a3"}), 0.0, id="slots-claimed"),  # |{a2,a3}| = 2
        pytest.param(lora(2, {"a2", "a3"}, {"a1"}), 0.6, id="waiting"),
        pytest.param(lora(1, set(), {"a1"}), 0.6, id="waiting-only-slot"),  # |{a1}| = 1
        pytest.param(lora(2, {"a2", "a3"}), 0.0, id="full"),
        pytest.param(lora(0, set()), 0.0, id="lora-disabled"),
        pytest.param(None, 0.0, id="no-lora-info"),
    ],
)
def test_lora_affinity_scorer(info: LoraInfo | None, expected: float) -> None:
    eps = states(lora=[info])
    assert LoraAffinityScorer().score(CYCLE, request("a1"), eps) == [expected]


def test_lora_affinity_scores_base_model_requests_one_everywhere() -> None:
    eps = states(lora=[None, lora(1, {"a2"})])
    assert LoraAffinityScorer().score(CYCLE, request(None), eps) == [1.0, 1.0]


def test_scorers_read_stale_metrics_as_they_are() -> None:
    # scraped at 1.0, now 100.0: stale, still scored (llm-d behaviour; filters drop stale)
    eps = [endpoint_state("10.0.0.1:8000", waiting=0.0, scraped_at=1.0)]
    eps.append(endpoint_state("10.0.0.2:8000", waiting=4.0, scraped_at=99.9))
    assert QueueScorer().score(CYCLE, request(), eps) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("cls", "parameters", "attribute", "expected"),
    [
        pytest.param(LoadAwareScorer, {}, "threshold", 128.0, id="load-aware-default"),
        pytest.param(LoadAwareScorer, {"threshold": 16}, "threshold", 16.0, id="load-aware"),
        pytest.param(
            TokenLoadScorer, {}, "queue_threshold_tokens", 4_194_304.0, id="token-load-default"
        ),
        pytest.param(
            TokenLoadScorer,
            {"queueThresholdTokens": 1000},
            "queue_threshold_tokens",
            1000.0,
            id="token-load",
        ),
        pytest.param(ActiveRequestScorer, {}, "idle_threshold", 0, id="active-default-idle"),
        pytest.param(ActiveRequestScorer, {}, "max_busy_score", 1.0, id="active-default-busy"),
        pytest.param(
            ActiveRequestScorer,
            {"idleThreshold": 3, "requestTimeout": "1m30s"},
            "idle_threshold",
            3,
            id="active-idle",
        ),
        pytest.param(
            ActiveRequestScorer, {"maxBusyScore": 0.5}, "max_busy_score", 0.5, id="active-busy"
        ),
    ],
)
def test_scorer_parameters_decode_with_llm_d_names(
    cls: type[LoadAwareScorer | TokenLoadScorer | ActiveRequestScorer],
    parameters: dict[str, object],
    attribute: str,
    expected: float,
) -> None:
    scorer = cls.from_config("s", parameters, PluginContext())
    assert getattr(scorer, attribute) == expected
    assert scorer.name == "s"


@pytest.mark.parametrize(
    ("cls", "parameters", "fragment"),
    [
        pytest.param(LoadAwareScorer, {"threshold": 0}, "greater than 0", id="threshold-zero"),
        pytest.param(LoadAwareScorer, {"threshold": "5"}, "valid integer", id="threshold-str"),
        pytest.param(LoadAwareScorer, {"treshold": 5}, "unknown parameter 'treshold'", id="typo"),
        pytest.param(
            TokenLoadScorer, {"queueThresholdTokens": -1}, "greater than 0", id="tokens-negative"
        ),
        pytest.param(
            ActiveRequestScorer, {"maxBusyScore": 1.5}, "less than or equal to 1", id="busy>1"
        ),
        pytest.param(
            ActiveRequestScorer, {"idleThreshold": -1}, "greater than or equal to 0", id="idle<0"
        ),
        pytest.param(
            ActiveRequestScorer, {"requestTimeout": "soon"}, "duration such as", id="timeout"
        ),
        pytest.param(QueueScorer, {"anything": 1}, "none (remove `parameters`)", id="no-params"),
    ],
)
def test_scorer_parameter_errors_name_plugin_and_key(
    cls: type[LoadAwareScorer | TokenLoadScorer | ActiveRequestScorer | QueueScorer],
    parameters: dict[str, object],
    fragment: str,
) -> None:
    with pytest.raises(PluginParameterError) as info:
        cls.from_config("mine", parameters, PluginContext())
    message = str(info.value)
    assert f"plugin 'mine' (type '{cls.type}')" in message
    assert fragment in message
