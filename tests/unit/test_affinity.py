"""`prefix-cache-affinity-filter` and `no-hit-lru-scorer`: the load guards of prefix affinity."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest

from servegate.pool.endpoint import Endpoint, EndpointState
from servegate.scheduling import affinity_filter as filter_module
from servegate.scheduling.affinity import NoHitLRUScorer
from servegate.scheduling.affinity_filter import SPLIT_LOOP_LIMIT, PrefixCacheAffinityFilter
from servegate.scheduling.config import PickerConfigError, load_picker_config
from servegate.scheduling.factory import PluginContext, PluginParameterError
from servegate.scheduling.framework import CycleState, Decision, ProfileResult
from servegate.scheduling.prefix.lookup import find_prefix_scorer
from servegate.scheduling.request import LLMRequest, RequestKind


class FixedPrefix:
    """A prefix scorer whose scores the test sets per address."""

    type: ClassVar[str] = "prefix-cache-scorer"

    def __init__(self, scores: dict[str, float], name: str = "prefix-cache-scorer") -> None:
        self.name = name
        self.scores = scores
        self.calls = 0

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> Sequence[float]:
        self.calls += 1
        return [self.scores.get(s.address, 0.0) for s in endpoints]


def eps(*in_flight: tuple[int, int]) -> list[EndpointState]:
    """One endpoint per (requests, tokens) in flight, addresses e0, e1, ..."""
    out = []
    for i, (requests, tokens) in enumerate(in_flight):
        s = EndpointState(Endpoint(address=f"e{i}:1", url=f"http://e{i}:1"))
        s.in_flight_requests, s.in_flight_tokens = requests, tokens
        out.append(s)
    return out


def req(prompt_tokens: int = 1000) -> LLMRequest:
    r = LLMRequest("r", RequestKind.COMPLETION, "m", "m", "m", prompt="x")
    r.prompt_tokens = prompt_tokens
    return r


def cycle(seed: int = 0) -> CycleState:
    return CycleState(now=10.0, rng=random.Random(seed))


def affinity_filter(scores: dict[str, float], **params: Any) -> PrefixCacheAffinityFilter:
    f = PrefixCacheAffinityFilter.from_config("f", params, PluginContext())
    f.prefix = FixedPrefix(scores)
    return f


def names(states: list[EndpointState]) -> list[str]:
    return [s.address for s in states]


@pytest.mark.parametrize(
    ("scores", "loads", "params", "kept", "outcome"),
    [
        pytest.param(
            {"e0:1": 0.9, "e1:1": 0.5}, [(0, 0), (0, 0)], {}, ["e0:1"], "sticky", id="sticky"
        ),
        pytest.param(
            {"e0:1": 0.8, "e1:1": 0.8},
            [(0, 0), (0, 0), (0, 0)],
            {},
            ["e0:1", "e1:1"],
            "sticky",
            id="threshold-inclusive",
        ),
        pytest.param(
            {"e0:1": 0.5}, [(0, 0), (0, 0)], {}, ["e0:1", "e1:1"], "no-match", id="none-sticky"
        ),
        # TTFT = tokens / 1000 tok/s: sticky 20 s, other 1 s → 19 s > 18 s → keep all
        pytest.param(
            {"e0:1": 1.0},
            [(5, 20_000), (1, 1_000)],
            {"peakPrefillThroughput": 1000},
            ["e0:1", "e1:1"],
            "load-override",
            id="ttft-gate-breaks",
        ),
        # sticky 18.5 s, other 1 s → 17.5 s ≤ 18 s → stay sticky
        pytest.param(
            {"e0:1": 1.0},
            [(5, 18_500), (1, 1_000)],
            {"peakPrefillThroughput": 1000},
            ["e0:1"],
            "sticky",
            id="ttft-gate-holds",
        ),
        # penalty 0 means always stick, however loaded
        pytest.param(
            {"e0:1": 1.0},
            [(50, 10**9), (0, 0)],
            {"maxTTFTPenaltyMs": 0},
            ["e0:1"],
            "sticky",
            id="penalty-zero-always-sticks",
        ),
        pytest.param({"e0:1": 1.0}, [(0, 0)], {}, ["e0:1"], "not-applicable", id="single-endpoint"),
        pytest.param(
            {"e0:1": 1.0},
            [(0, 0), (0, 0)],
            {"affinityThreshold": 0},
            ["e0:1", "e1:1"],
            "not-applicable",
            id="threshold-zero-disables",
        ),
        # in-flight gate: sticky has 9 requests, e1 (within the TTFT penalty) has 1: 8 > 4
        pytest.param(
            {"e0:1": 1.0},
            [(9, 100), (1, 100), (0, 10**9)],
            {"maxInFlightRequestsDelta": 4},
            ["e0:1", "e1:1"],
            "request-load-override",
            id="in-flight-delta-adds-the-close-ones",
        ),
        pytest.param(
            {"e0:1": 1.0},
            [(3, 100), (1, 100)],
            {"maxInFlightRequestsDelta": 4},
            ["e0:1"],
            "sticky",
            id="in-flight-delta-small",
        ),
    ],
)
def test_affinity_filter(
    scores: dict[str, float],
    loads: list[tuple[int, int]],
    params: dict[str, Any],
    kept: list[str],
    outcome: str,
) -> None:
    f = affinity_filter(scores, **params)
    assert names(f.filter(cycle(), req(), eps(*loads))) == kept
    assert f.decisions == {outcome: 1}


def test_exploration_keeps_everything_with_its_probability() -> None:
    f = affinity_filter({"e0:1": 1.0}, explorationProbability=0.25)
    rng = random.Random(3)
    kept_all = sum(
        len(f.filter(CycleState(0.0, rng), req(), eps((0, 0), (0, 0)))) == 2 for _ in range(4000)
    )
    # 4000 × 0.25 = 1000 expected; binomial sd ≈ 27
    assert 850 < kept_all < 1150


def test_the_prefix_scores_are_computed_once_per_cycle() -> None:
    f = affinity_filter({"e0:1": 1.0})
    c = cycle()
    states = eps((0, 0), (0, 0))
    f.filter(c, req(), states)
    f.filter(c, req(), states)
    assert isinstance(f.prefix, FixedPrefix) and f.prefix.calls == 1


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        pytest.param({"affinityThreshold": 1.5}, "less than or equal to 1", id="threshold"),
        pytest.param({"ttftSource": "latency"}, "latencyPredictor", id="ttft-source"),
        pytest.param({"peakPrefillThroughput": 0}, "greater than 0", id="throughput"),
        pytest.param(
            {"maxInFlightRequestsDelta": 2, "maxTTFTPenaltyMs": 0}, "must be > 0", id="delta"
        ),
    ],
)
def test_bad_filter_parameters(params: dict[str, Any], problem: str) -> None:
    with pytest.raises(PluginParameterError) as info:
        PrefixCacheAffinityFilter.from_config("f", params, PluginContext())
    assert problem in str(info.value)


# -- no-hit-lru-scorer -------------------------------------------------------------------------


def lru_scorer(scores: dict[str, float], **params: Any) -> NoHitLRUScorer:
    s = NoHitLRUScorer.from_config("lru", params, PluginContext())
    s.prefix = FixedPrefix(scores)
    return s


def route(scorer: NoHitLRUScorer, states: list[EndpointState], r: LLMRequest) -> list[float]:
    """Score, then pretend the best was picked (ties: first)."""
    scores = list(scorer.score(cycle(), r, states))
    best = states[scores.index(max(scores))]
    scorer.pre_request(r, Decision(endpoint=best, fallbacks=[]), 0.0)
    return scores


def test_a_request_with_a_hit_gets_neutral_scores() -> None:
    s = lru_scorer({"e1:1": 0.3})
    r = req()
    assert list(s.score(cycle(), r, eps((0, 0), (0, 0), (0, 0)))) == [0.5, 0.5, 0.5]
    s.pre_request(r, Decision(endpoint=eps((0, 0))[0], fallbacks=[]), 0.0)
    assert not s.lru


def test_cold_requests_go_round_the_replicas_least_recently_used_first() -> None:
    s = lru_scorer({})
    states = eps((0, 0), (0, 0), (0, 0))
    # 3 candidates: rank r scores 1 - r/2
    assert route(s, states, req()) == [1.0, 0.5, 0.0]  # e0 never used, first → picked
    assert route(s, states, req()) == [0.0, 1.0, 0.5]  # e1, e2 never used; e0 last
    assert route(s, states, req()) == [0.5, 0.0, 1.0]  # e2 never used; then e0, e1
    assert route(s, states, req()) == [1.0, 0.5, 0.0]  # all used: e0 least recently
    assert list(s.lru) == ["e1:1", "e2:1", "e0:1"]


def test_two_cold_candidates_rank_as_the_sort_does() -> None:
    """Two candidates take a shortcut: the scores the stable sort gives, for every mix of
    never-placed and placed replicas, in both orders."""
    s = lru_scorer({})
    three = eps((0, 0), (0, 0), (0, 0))
    pairs = [[a, b] for a in three for b in three if a is not b]

    def by_sorting(pair: list[EndpointState]) -> list[float]:
        position = s.placements.position()
        order = [position.get(p.address, -1) for p in pair]
        ranked = sorted(range(2), key=order.__getitem__)
        return [1.0 - rank for rank in sorted(range(2), key=ranked.__getitem__)]

    for placed in ([], ["e2:1"], ["e0:1", "e1:1"], ["e1:1", "e2:1", "e0:1"]):
        s.placements.lru.clear()
        for address in placed:
            s.placements.touch(address)
        for pair in pairs:
            assert list(s.score(cycle(), req(), pair)) == by_sorting(pair), (placed, pair)


def test_the_lru_is_bounded() -> None:
    s = lru_scorer({}, lruSize=2)
    states = eps((0, 0), (0, 0), (0, 0))
    for _ in range(3):
        route(s, states, req())
    assert list(s.lru) == ["e1:1", "e2:1"]


def test_a_cold_prefill_target_is_also_recorded() -> None:
    s = lru_scorer({})
    decode, prefill = eps((0, 0), (0, 0))
    r = req()
    s.score(cycle(), r, [decode, prefill])
    s.pre_request(r, Decision(endpoint=decode, fallbacks=[], prefill=prefill), 0.0)
    assert list(s.lru) == ["e0:1", "e1:1"]
    r = req()
    s.score(cycle(), r, [decode, prefill])
    result = ProfileResult(ranked=[prefill], scores={}, totals={})
    s.pre_request(r, Decision(endpoint=decode, fallbacks=[], results={"prefill": result}), 0.0)
    assert list(s.lru) == ["e0:1", "e1:1"]


# -- finding the prefix scorer -------------------------------------------------------------------

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"


@pytest.mark.parametrize(
    ("plugins", "expected"),
    [
        pytest.param(
            "- type: prefix-cache-scorer\n- type: no-hit-lru-scorer\n",
            "prefix-cache-scorer",
            id="default-name",
        ),
        pytest.param(
            "- type: precise-prefix-cache-scorer\n- type: no-hit-lru-scorer\n",
            "precise-prefix-cache-scorer",
            id="the-only-one",
        ),
        pytest.param(
            "- {type: prefix-cache-scorer, name: approx}\n- type: precise-prefix-cache-scorer\n"
            "- {type: no-hit-lru-scorer, parameters: {prefixPluginName: approx}}\n",
            "approx",
            id="named",
        ),
    ],
)
def test_no_hit_lru_finds_its_prefix_scorer(plugins: str, expected: str) -> None:
    scheduler = load_picker_config(HEAD + "plugins:\n" + plugins, PluginContext())
    lru = scheduler.plugins["no-hit-lru-scorer"]
    assert isinstance(lru, NoHitLRUScorer) and lru.prefix is not None
    assert lru.prefix.name == expected


@pytest.mark.parametrize(
    ("plugins", "problem"),
    [
        pytest.param(
            "- {type: prefix-cache-scorer, name: a}\n- {type: prefix-cache-scorer, name: b}\n"
            "- type: prefix-cache-affinity-filter\n",
            "say which one with `prefixMatchInfoProducerName`",
            id="ambiguous",
        ),
        pytest.param(
            "- type: queue-scorer\n- type: prefix-cache-affinity-filter\n"
            "  parameters: {prefixMatchInfoProducerName: queue-scorer}\n",
            "it must name a prefix-cache-scorer or precise-prefix-cache-scorer",
            id="not-a-prefix-scorer",
        ),
        pytest.param(
            "- type: no-hit-lru-scorer\n  parameters: {prefixPluginName: nope}\n",
            "prefixPluginName 'nope' names no declared plugin",
            id="missing-name",
        ),
    ],
)
def test_prefix_scorer_mistakes_are_load_errors(plugins: str, problem: str) -> None:
    with pytest.raises(PickerConfigError) as info:
        load_picker_config(HEAD + "plugins:\n" + plugins, PluginContext())
    assert problem in str(info.value)


def test_find_prefix_scorer_returns_the_declared_instance() -> None:
    prefix = FixedPrefix({}, name="p")
    assert find_prefix_scorer("x", {"p": prefix}, None, "n") is prefix  # type: ignore[dict-item]


def test_the_affinity_filter_alone_keeps_its_own_prefix_index() -> None:
    """llm-d's predicted-latency guides declare no prefix scorer beside the filter."""
    scheduler = load_picker_config(
        HEAD + "plugins:\n- type: prefix-cache-affinity-filter\n- type: queue-scorer\n",
        PluginContext(),
    )
    flt = scheduler.plugins["prefix-cache-affinity-filter"]
    assert isinstance(flt, PrefixCacheAffinityFilter) and flt.prefix is not None
    assert any("its own approximate prefix index" in w for w in flt.startup_warnings())
    assert flt in scheduler._hooks_pre  # it learns what was routed where


# -- the default profile: sticky until saturated, every replica still a fallback -----------


def _default_scheduler() -> Any:
    from servegate.scheduling.config import DEFAULT_PICKER_CONFIG
    from servegate.scheduling.prefix.approx import PrefixCacheScorer

    scheduler = load_picker_config(DEFAULT_PICKER_CONFIG, PluginContext())
    approx = scheduler.plugins["prefix-cache-scorer"]
    assert isinstance(approx, PrefixCacheScorer)
    return scheduler, approx


def test_the_default_keeps_a_held_prefix_on_its_replica_and_the_rest_as_fallbacks() -> None:
    """The affinity filter narrows the choice to the holder, but a dead holder must still have
    somewhere to retry: the replicas it removed follow as last-resort fallbacks."""
    scheduler, approx = _default_scheduler()
    states = eps((0, 0), (0, 0), (0, 0))
    request = LLMRequest("r", RequestKind.COMPLETION, "m", "m", "m", prompt="p " * 400)
    approx.index.insert("e1:1", approx.block_keys(request))
    for seed in range(5):
        decision = scheduler.schedule(request, states, cycle(seed))
        assert decision.endpoint.address == "e1:1"
        assert sorted(s.address for s in decision.fallbacks) == ["e0:1", "e2:1"]
    # saturated: 4 more in flight on the holder than elsewhere opens the filter, and the
    # scorers weigh the others against it
    states[1].in_flight_requests = 4
    decision = scheduler.schedule(request, states, cycle())
    assert set(decision.results["default"].totals) == {"e0:1", "e1:1", "e2:1"}
    assert scheduler.plugins["prefix-cache-affinity-filter"].decisions == {
        "sticky": 5,
        "request-load-override": 1,
    }


def test_the_default_spreads_new_prefixes_over_idle_replicas() -> None:
    """Cold prompts (held nowhere) go to the replica least recently given one, not to a
    random one among tied idle replicas: 9 new prefixes on 3 idle replicas land 3/3/3."""
    scheduler, _ = _default_scheduler()
    states = eps((0, 0), (0, 0), (0, 0))
    placed: dict[str, int] = {}
    for g in range(9):
        request = LLMRequest(f"r{g}", RequestKind.COMPLETION, "m", "m", "m", prompt=f"{g} " * 400)
        decision = scheduler.schedule(request, states, cycle(g))
        scheduler.pre_request(request, decision, 10.0)
        placed[decision.endpoint.address] = placed.get(decision.endpoint.address, 0) + 1
    assert placed == {"e0:1": 3, "e1:1": 3, "e2:1": 3}


@pytest.mark.parametrize("seed", range(6))
def test_a_small_pool_gets_the_verdict_the_list_wise_code_gives(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pools up to SPLIT_LOOP_LIMIT take the verdict in one pass; forced through the
    list-wise code, every random pool (loads, matches with NaN and above-1 scores, guard
    parameters) keeps the same endpoints, in the same order, with the same outcome."""
    rng = random.Random(seed)
    outcomes: set[str] = set()
    small = SPLIT_LOOP_LIMIT
    for _ in range(300):
        n = rng.randint(2, small)
        loads = [(rng.randint(0, 12), rng.choice([0, rng.randint(0, 400_000)])) for _ in range(n)]
        pool = eps(*loads)
        scores = {
            s.address: rng.choice([0.0, 0.5, 0.79, 0.8, 0.95, 1.0, 1.2, float("nan")]) for s in pool
        }
        params: dict[str, Any] = {
            "maxInFlightRequestsDelta": rng.choice([0, 1, 3]),
            "maxTTFTPenaltyMs": rng.choice([1.0, 500.0, 18000.0]),
            "maxTokensInFlightPenalty": rng.choice([0, 0, 50_000]),
        }
        request = req(rng.choice([10, 1000, 100_000]))
        verdicts = []
        for limit in (small, 0):
            monkeypatch.setattr(filter_module, "SPLIT_LOOP_LIMIT", limit)
            flt = affinity_filter(scores, **params)
            kept = flt.filter(cycle(), request, pool)
            verdicts.append((names(kept), dict(flt.decisions)))
        assert verdicts[0] == verdicts[1]
        outcomes.update(verdicts[0][1])
    assert {"sticky", "load-override", "request-load-override", "no-match"} <= outcomes


@pytest.mark.parametrize("n", [2, 12])
def test_a_nan_match_first_is_no_match_not_an_error(n: int) -> None:
    """`max` keeps a leading NaN, so the threshold test passed with nothing sticky and the
    load guards took the least of no loads (ValueError)."""
    pool = eps(*[(1, 100)] * n)
    flt = affinity_filter({pool[0].address: float("nan"), pool[1].address: 0.5})
    assert flt.filter(cycle(), req(), pool) == pool
    assert flt.decisions == {"no-match": 1}
