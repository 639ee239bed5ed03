"""The framework runner: clamping, weights, NaN, ranking, hooks, stats, multi-profile loop."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import ClassVar

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servegate.gateway.histogram import Buckets
from servegate.pool.endpoint import ROLE_LABEL, EndpointState
from servegate.scheduling.filters import DecodeFilter, PrefillFilter
from servegate.scheduling.framework import (
    CycleState,
    Decision,
    NoCandidates,
    ProfileResult,
    SchedulerProfile,
    WeightedScorer,
)
from servegate.scheduling.pickers import MaxScorePicker
from servegate.scheduling.profiles import SingleProfileHandler
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.scheduler import (
    FUSED_LIMIT,
    Scheduler,
    ScoreTable,
    TotalsView,
    add_weighted,
    clamp,
    fused_observe,
    fused_row,
    fused_totals,
    result_as_dict,
)
from servegate.scheduling.scorers import QueueScorer
from servegate.testing.endpoints import addresses, endpoint_state

REQUEST = LLMRequest("r1", RequestKind.CHAT, "m", "m", "m")
INF = float("inf")
NAN = float("nan")


class Fixed:
    """A scorer that returns the scores it was given."""

    type: ClassVar[str] = "fixed"

    def __init__(self, name: str, scores: Sequence[float]) -> None:
        self.name = name
        self.scores = list(scores)

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[float]:
        return self.scores[: len(endpoints)]


class DropAll:
    type: ClassVar[str] = "drop-all"
    name = "drop-all"

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        return []


class Recorder:
    """A plugin with both request hooks."""

    type: ClassVar[str] = "recorder"

    def __init__(self) -> None:
        self.name = "recorder"
        self.calls: list[tuple[str, str, float]] = []

    def pre_request(self, request: LLMRequest, decision: Decision, now: float) -> None:
        self.calls.append(("pre", decision.endpoint.address, now))

    def response_complete(self, request: LLMRequest, endpoint: EndpointState, now: float) -> None:
        self.calls.append(("done", endpoint.address, now))


def pool(n: int) -> list[EndpointState]:
    return [endpoint_state(a) for a in addresses(n)]


def single(*scorers: WeightedScorer, filters: list[object] | None = None) -> Scheduler:
    profile = SchedulerProfile("default", list(filters or []), list(scorers), MaxScorePicker())  # type: ignore[arg-type]
    return Scheduler({"default": profile}, SingleProfileHandler(), {})


def cycle(seed: int = 0) -> CycleState:
    return CycleState(now=50.0, rng=random.Random(seed))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(0.25, 0.25, id="inside"),
        pytest.param(1.5, 1.0, id="above"),
        pytest.param(-0.5, 0.0, id="below"),
        pytest.param(NAN, 0.0, id="nan"),
        pytest.param(INF, 1.0, id="inf"),
        pytest.param(-INF, 0.0, id="minus-inf"),
    ],
)
def test_clamp(value: float, expected: float) -> None:
    assert clamp(value) == expected


def test_scores_are_clamped_then_weighted_then_summed() -> None:
    eps = pool(5)
    a = Fixed("a", [1.5, -0.5, NAN, 0.25, INF])
    b = Fixed("b", [0.5, 0.5, 0.5, 0.5, 0.5])
    scheduler = single(WeightedScorer(a, 2.0), WeightedScorer(b, 3.0))
    decision = scheduler.schedule(REQUEST, eps, cycle())
    result = decision.results["default"]
    # a clamps to [1, 0, 0, 0.25, 1] * 2 = [2, 0, 0, 0.5, 2]; b adds 0.5 * 3 = 1.5 to each
    expected_totals = [3.5, 1.5, 1.5, 2.0, 3.5]
    assert dict(result.totals) == dict(zip(addresses(5), expected_totals, strict=True))
    assert result.scores[eps[0].address] == {"a": 2.0, "b": 1.5}
    assert result.scores[eps[2].address] == {"a": 0.0, "b": 1.5}
    assert result.scores[eps[3].address] == {"a": 0.5, "b": 1.5}
    order = [eps.index(s) for s in decision.targets]
    assert set(order[:2]) == {0, 4}  # 3.5, 3.5
    assert order[2] == 3  # 2.0
    assert set(order[3:]) == {1, 2}  # 1.5, 1.5


def test_zero_weight_keeps_the_breakdown_but_adds_nothing() -> None:
    eps = pool(2)
    scheduler = single(WeightedScorer(Fixed("a", [1.0, 0.0]), 0.0))
    result = scheduler.schedule(REQUEST, eps, cycle()).results["default"]
    assert dict(result.totals) == {eps[0].address: 0.0, eps[1].address: 0.0}
    assert result.scores[eps[0].address] == {"a": 0.0}


def test_fallbacks_follow_descending_total() -> None:
    eps = pool(4)
    scheduler = single(WeightedScorer(Fixed("a", [0.2, 0.9, 0.4, 0.7]), 1.0))
    decision = scheduler.schedule(REQUEST, eps, cycle())
    assert [s.address for s in decision.targets] == [eps[i].address for i in (1, 3, 2, 0)]


def test_tie_break_is_deterministic_for_a_seeded_rng() -> None:
    eps = pool(10)
    scheduler = single(WeightedScorer(Fixed("a", [1.0] * 10), 1.0))
    picks = [scheduler.schedule(REQUEST, eps, cycle(seed)).endpoint for seed in range(30)]
    again = [scheduler.schedule(REQUEST, eps, cycle(seed)).endpoint for seed in range(30)]
    assert picks == again
    assert len({s.address for s in picks}) > 3


def test_no_scorers_means_all_tie() -> None:
    eps = pool(3)
    decision = single().schedule(REQUEST, eps, cycle())
    assert sorted(s.address for s in decision.targets) == sorted(addresses(3))
    assert dict(decision.results["default"].totals) == dict.fromkeys(addresses(3), 0.0)


def test_empty_candidates_raise_no_candidates() -> None:
    scheduler = single()
    with pytest.raises(NoCandidates):
        scheduler.schedule(REQUEST, [], cycle())
    assert (scheduler.stats.cycles, scheduler.stats.no_candidates) == (1, 1)


def test_filters_removing_everything_raise_no_candidates() -> None:
    scheduler = single(WeightedScorer(QueueScorer(), 1.0), filters=[DropAll()])
    with pytest.raises(NoCandidates, match="default"):
        scheduler.schedule(REQUEST, pool(3), cycle())
    assert scheduler.stats.no_candidates == 1
    assert scheduler.stats.plugins[("Scorer", "queue-scorer")].calls == 0


def test_filters_run_in_order_before_scoring() -> None:
    eps = pool(4)
    eps[0] = endpoint_state(eps[0].address, labels={ROLE_LABEL: "prefill"})
    eps[1] = endpoint_state(eps[1].address, labels={ROLE_LABEL: "decode"})
    scheduler = single(WeightedScorer(QueueScorer(), 1.0), filters=[DecodeFilter()])
    decision = scheduler.schedule(REQUEST, eps, cycle())
    assert eps[0] not in decision.targets
    assert set(decision.results["default"].totals) == {s.address for s in eps[1:]}


def test_scorer_with_wrong_length_is_an_error_naming_it() -> None:
    scheduler = single(WeightedScorer(Fixed("short", [1.0]), 1.0))
    with pytest.raises(ValueError, match="scorer 'short' returned 1 scores for 3 endpoints"):
        scheduler.schedule(REQUEST, pool(3), cycle())


@pytest.mark.parametrize("size", [3, FUSED_LIMIT + 2])
@pytest.mark.parametrize(
    ("first", "second", "named"),
    [
        pytest.param(None, [0.5], "second", id="one-short"),
        pytest.param([0.5], [0.5], "first", id="both-short-alike"),
    ],
)
def test_a_wrong_length_names_the_scorer_in_small_and_large_pools(
    size: int, first: list[float] | None, second: list[float], named: str
) -> None:
    scheduler = single(
        WeightedScorer(Fixed("first", first or [0.5] * size), 1.0),
        WeightedScorer(Fixed("second", second), 1.0),
    )
    with pytest.raises(ValueError, match=f"scorer '{named}' returned"):
        scheduler.schedule(REQUEST, pool(size), cycle())


def test_schedule_does_not_touch_its_inputs() -> None:
    eps = pool(3)
    before = [(s.metrics, s.in_flight_requests, s.picks) for s in eps]
    candidates = list(eps)
    single(WeightedScorer(QueueScorer(), 1.0)).schedule(REQUEST, candidates, cycle())
    assert candidates == eps
    assert [(s.metrics, s.in_flight_requests, s.picks) for s in eps] == before


def test_stats_count_calls_and_time_per_plugin() -> None:
    profile = SchedulerProfile(
        "default", [], [WeightedScorer(QueueScorer(), 1.0)], MaxScorePicker()
    )
    scheduler = Scheduler({"default": profile}, SingleProfileHandler(), {}, timing_every=1)
    for seed in range(3):
        scheduler.schedule(REQUEST, pool(4), cycle(seed))
    stats = scheduler.stats
    assert stats.cycles == 3
    assert stats.plugins[("Scorer", "queue-scorer")].calls == 3
    assert stats.plugins[("Picker", "max-score-picker")].calls == 3
    assert stats.plugins[("ProfilePicker", "single-profile-handler")].calls == 6  # pick, again
    assert stats.plugins[("ProcessProfilesResults", "single-profile-handler")].calls == 3
    assert all(t.total_ns >= 0 for t in stats.plugins.values())
    scorer = stats.plugins[("Scorer", "queue-scorer")]
    assert scorer.total_ns > 0 and scorer.type == "queue-scorer"
    # every call lands in exactly one duration bucket
    assert all(sum(t.counts) == t.calls for t in stats.plugins.values())


def test_plugins_are_timed_on_one_cycle_in_timing_every_each_counting_for_that_many() -> None:
    scheduler = single(WeightedScorer(QueueScorer(), 1.0))
    assert scheduler.timing_every == 16
    stats = scheduler.stats
    scorer = stats.plugins[("Scorer", "queue-scorer")]
    scheduler.schedule(REQUEST, pool(4), cycle(0))  # the first cycle is timed
    assert scorer.calls == 16 and sum(scorer.counts) == 16 and scorer.total_ns > 0
    first_ns = scorer.total_ns
    for seed in range(1, 16):  # cycles 2..16 are not
        scheduler.schedule(REQUEST, pool(4), cycle(seed))
    assert scorer.calls == 16 and scorer.total_ns == first_ns
    scheduler.schedule(REQUEST, pool(4), cycle(16))  # cycle 17 is
    assert stats.cycles == 17
    assert scorer.calls == 32
    assert stats.plugins[("Picker", "max-score-picker")].calls == 32
    assert stats.plugins[("ProfilePicker", "single-profile-handler")].calls == 64  # pick, again
    assert stats.plugins[("ProcessProfilesResults", "single-profile-handler")].calls == 32
    assert all(sum(t.counts) == t.calls for t in stats.plugins.values())


def test_untimed_cycles_decide_as_timed_ones() -> None:
    """Untimed cycles of a single-profile handler skip asking it; the decision is the same."""
    eps = pool(6)
    for i, s in enumerate(eps):
        s.metrics.waiting = float((i * 7) % 4)
    profile = SchedulerProfile(
        "only",
        [DecodeFilter()],
        [WeightedScorer(QueueScorer(), 2.0), WeightedScorer(Fixed("f", [0.3, 1.0] * 3), 1.0)],
        MaxScorePicker(),
    )
    timed = Scheduler({"only": profile}, SingleProfileHandler(), {}, timing_every=1)
    untimed = Scheduler({"only": profile}, SingleProfileHandler(), {}, timing_every=1000)
    untimed.schedule(REQUEST, eps, cycle())  # its one timed cycle
    for seed in range(20):
        a = timed.schedule(REQUEST, eps, cycle(seed))
        b = untimed.schedule(REQUEST, eps, cycle(seed))
        assert (a.endpoint, a.fallbacks, a.profile) == (b.endpoint, b.fallbacks, b.profile)
        assert result_as_dict(a.results["only"]) == result_as_dict(b.results["only"])
    assert untimed.stats.plugins[("ProfilePicker", "single-profile-handler")].calls == 2000
    drop = SchedulerProfile("only", [DropAll()], [], MaxScorePicker())
    for every in (1, 1000):
        scheduler = Scheduler({"only": drop}, SingleProfileHandler(), {}, timing_every=every)
        for _ in range(2):
            with pytest.raises(NoCandidates, match=r"profiles \(only\)"):
                scheduler.schedule(REQUEST, eps, cycle())
        assert scheduler.stats.no_candidates == 2


def test_hooks_reach_every_plugin_that_implements_them() -> None:
    recorder = Recorder()
    profile = SchedulerProfile("default", [], [], MaxScorePicker())
    scheduler = Scheduler({"default": profile}, SingleProfileHandler(), {"recorder": recorder})
    eps = pool(1)
    for now in (51.0, 53.0):
        decision = scheduler.schedule(REQUEST, eps, cycle())
        scheduler.pre_request(REQUEST, decision, now)
        scheduler.response_complete(REQUEST, decision.endpoint, now + 1.0)
    assert recorder.calls == [
        ("pre", eps[0].address, 51.0),
        ("done", eps[0].address, 52.0),
        ("pre", eps[0].address, 53.0),
        ("done", eps[0].address, 54.0),
    ]
    hooks = scheduler.stats.hooks
    assert hooks[("PreRequest", "recorder")].calls == 16  # the first call, timed, counts for 16
    assert hooks[("ResponseComplete", "recorder")].calls == 16


class Idle(Recorder):
    """A hook that says it records nothing here (`RECORDS_DECISIONS`)."""

    records_decisions = False


def test_hooks_that_record_nothing_run_only_on_timed_calls() -> None:
    idle, recorder = Idle(), Recorder()
    idle.name = "idle"
    profile = SchedulerProfile("default", [], [], MaxScorePicker())
    scheduler = Scheduler(
        {"default": profile}, SingleProfileHandler(), {"idle": idle, "recorder": recorder}
    )
    eps = pool(1)
    for i in range(32):
        decision = scheduler.schedule(REQUEST, eps, cycle())
        scheduler.pre_request(REQUEST, decision, float(i))
    assert [now for _, _, now in recorder.calls] == [float(i) for i in range(32)]
    assert [now for _, _, now in idle.calls] == [0.0, 16.0]  # the timed calls, 1 in 16
    hooks = scheduler.stats.hooks
    assert hooks[("PreRequest", "idle")].calls == hooks[("PreRequest", "recorder")].calls == 32


def test_an_affinity_filter_records_only_with_an_index_of_its_own() -> None:
    from servegate.scheduling.affinity import AffinityFilterParameters
    from servegate.scheduling.affinity_filter import PrefixCacheAffinityFilter
    from servegate.scheduling.prefix.approx import ApproxPrefixParameters, PrefixCacheScorer

    params = AffinityFilterParameters.model_validate({})
    unbound = PrefixCacheAffinityFilter("f", params)
    assert unbound.records_decisions  # not bound yet: it may keep its own index
    own = PrefixCacheAffinityFilter("f", params)
    own.bind_plugins({})
    assert own.records_decisions
    reader = PrefixCacheAffinityFilter("f", params)
    scorer = PrefixCacheScorer("prefix-cache-scorer", ApproxPrefixParameters())
    reader.bind_plugins({"prefix-cache-scorer": scorer})
    assert not reader.records_decisions


def test_result_views_behave_like_read_only_mappings() -> None:
    eps = pool(2)
    scheduler = single(WeightedScorer(Fixed("a", [0.5, 1.0]), 2.0))
    result = scheduler.schedule(REQUEST, eps, cycle()).results["default"]
    assert isinstance(result.scores, ScoreTable)
    assert isinstance(result.totals, TotalsView)
    assert list(result.scores) == addresses(2)
    assert len(result.totals) == 2
    assert result.totals == {eps[0].address: 1.0, eps[1].address: 2.0}  # 0.5*2, 1.0*2
    assert result.scores == {eps[0].address: {"a": 1.0}, eps[1].address: {"a": 2.0}}
    with pytest.raises(KeyError):
        result.totals["10.9.9.9:1"]
    as_dict = result_as_dict(result)
    assert orjson.loads(orjson.dumps(as_dict)) == {
        "ranked": [eps[1].address, eps[0].address],
        "totals": {eps[0].address: 1.0, eps[1].address: 2.0},
        "scores": {eps[0].address: {"a": 1.0}, eps[1].address: {"a": 2.0}},
    }


class DecodeThenPrefill:
    """A P/D-style handler: decode first, then prefill when the prompt is long."""

    type: ClassVar[str] = "test-pd-handler"
    name = "test-pd-handler"

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, SchedulerProfile],
        results: Mapping[str, ProfileResult | None],
    ) -> list[str]:
        if not results:
            return ["decode"]
        if "prefill" not in results and request.prompt_tokens >= 100:
            return ["prefill"]
        return []

    def process_results(
        self,
        cycle: CycleState,
        request: LLMRequest,
        results: Mapping[str, ProfileResult | None],
    ) -> Decision | None:
        decode = results.get("decode")
        if decode is None:
            return None
        prefill = results.get("prefill")
        ranked = decode.ranked
        return Decision(
            endpoint=ranked[0],
            fallbacks=ranked[1:],
            prefill=prefill.ranked[0] if prefill else None,
            profile="decode",
            results={k: v for k, v in results.items() if v is not None},
            pd_decision="prefill-decode" if prefill else "decode-only",
        )


@pytest.mark.parametrize(
    ("prompt_tokens", "expect_prefill"),
    [pytest.param(500, True, id="long-prompt"), pytest.param(10, False, id="short-prompt")],
)
def test_a_multi_profile_handler_drives_the_loop(prompt_tokens: int, expect_prefill: bool) -> None:
    eps = [
        endpoint_state(a, labels={ROLE_LABEL: role})
        for a, role in zip(addresses(4), ["prefill", "decode", "prefill", "decode"], strict=True)
    ]
    profiles = {
        "decode": SchedulerProfile("decode", [DecodeFilter()], [], MaxScorePicker("pd")),
        "prefill": SchedulerProfile("prefill", [PrefillFilter()], [], MaxScorePicker("pp")),
    }
    scheduler = Scheduler(profiles, DecodeThenPrefill(), {})
    request = LLMRequest("r", RequestKind.COMPLETION, "m", "m", "m", prompt_tokens=prompt_tokens)
    decision = scheduler.schedule(request, eps, cycle())
    assert decision.endpoint.endpoint.labels[ROLE_LABEL] == "decode"
    if expect_prefill:
        assert decision.prefill is not None
        assert decision.prefill.endpoint.labels[ROLE_LABEL] == "prefill"
        assert decision.pd_decision == "prefill-decode"
    else:
        assert decision.prefill is None
        assert set(decision.results) == {"decode"}


class Repeats:
    type: ClassVar[str] = "repeats"
    name = "repeats"

    def __init__(self, answer: str) -> None:
        self.answer = answer

    def pick_profiles(
        self,
        cycle: CycleState,
        request: LLMRequest,
        profiles: Mapping[str, SchedulerProfile],
        results: Mapping[str, ProfileResult | None],
    ) -> list[str]:
        return [self.answer]

    def process_results(
        self,
        cycle: CycleState,
        request: LLMRequest,
        results: Mapping[str, ProfileResult | None],
    ) -> Decision | None:
        return None


@pytest.mark.parametrize(
    ("answer", "fragment"),
    [
        pytest.param("default", "asked to run profile 'default' twice", id="twice"),
        pytest.param("nope", "asked for unknown profile 'nope'", id="unknown"),
    ],
)
def test_a_misbehaving_handler_is_stopped(answer: str, fragment: str) -> None:
    profile = SchedulerProfile("default", [], [], MaxScorePicker())
    scheduler = Scheduler({"default": profile}, Repeats(answer), {})
    with pytest.raises(RuntimeError, match=fragment):
        scheduler.schedule(REQUEST, pool(2), cycle())


def test_scheduler_needs_profiles_the_handler_accepts() -> None:
    with pytest.raises(ValueError, match="at least one scheduling profile"):
        Scheduler({}, SingleProfileHandler(), {})
    two = {n: SchedulerProfile(n, [], [], MaxScorePicker()) for n in ("a", "b")}
    with pytest.raises(ValueError, match="runs exactly one scheduling profile"):
        Scheduler(two, SingleProfileHandler(), {})


def test_describe_lists_the_resolved_configuration() -> None:
    scheduler = single(WeightedScorer(QueueScorer("q"), 2.0), filters=[DecodeFilter()])
    described = scheduler.describe()
    assert orjson.loads(orjson.dumps(described)) == {
        "profileHandler": {"type": "single-profile-handler", "name": "single-profile-handler"},
        "schedulingProfiles": [
            {
                "name": "default",
                "filters": [{"type": "decode-filter", "name": "decode-filter"}],
                "scorers": [{"type": "queue-scorer", "name": "q", "weight": 2.0}],
                "picker": {"type": "max-score-picker", "name": "max-score-picker"},
            }
        ],
        "plugins": [],
        "warnings": [],
    }


def test_totals_are_finite_even_with_hostile_scorers() -> None:
    scheduler = single(WeightedScorer(Fixed("a", [NAN, INF, -INF]), 1.0))
    result = scheduler.schedule(REQUEST, pool(3), cycle()).results["default"]
    assert all(math.isfinite(t) for t in result.totals.values())


@settings(max_examples=150, deadline=None)
@given(
    columns=st.lists(
        st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=6, max_size=6),
        min_size=1,
        max_size=3,
    ),
    weights=st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=3, max_size=3),
    seed=st.integers(0, 2**32),
)
def test_any_scorer_output_gives_bounded_totals_and_a_sorted_ranking(
    columns: list[list[float]], weights: list[float], seed: int
) -> None:
    eps = pool(6)
    scorers = [
        WeightedScorer(Fixed(f"s{i}", column), weights[i]) for i, column in enumerate(columns)
    ]
    result = single(*scorers).schedule(REQUEST, eps, cycle(seed)).results["default"]
    ceiling = sum(weights[: len(columns)])
    totals = [result.totals[s.address] for s in result.ranked]
    assert all(0.0 <= t <= ceiling * (1 + 1e-9) for t in totals)
    assert totals == sorted(totals, reverse=True)
    assert sorted(s.address for s in result.ranked) == sorted(addresses(6))
    for s in eps:
        assert sum(result.scores[s.address].values()) == pytest.approx(result.totals[s.address])


def test_to_dict_matches_row_reads() -> None:
    eps = pool(3)
    scheduler = single(
        WeightedScorer(Fixed("a", [0.5, NAN, 2.0]), 2.0), WeightedScorer(QueueScorer(), 1.0)
    )
    result = scheduler.schedule(REQUEST, eps, cycle()).results["default"]
    assert isinstance(result.scores, ScoreTable)
    assert result.scores.to_dict() == {a: dict(result.scores[a]) for a in result.scores}
    unscored = single().schedule(REQUEST, eps, cycle()).results["default"]
    assert unscored.scores == {address: {} for address in addresses(3)}


WEIGHTS = st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=7, max_size=7)
THREE_ENDPOINT_COLUMNS = st.lists(
    st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=3, max_size=3),
    min_size=0,
    max_size=7,
)


def plain_table(
    columns: list[list[float]], weights: list[float]
) -> tuple[list[EndpointState], list[str], list[float], ScoreTable]:
    """Three endpoints scored by `columns` with the first weights: the table without any
    generated function, to hold a generated one against."""
    used = weights[: len(columns)]
    eps = pool(3)
    names = [f"s{i}" for i in range(len(columns))]
    return eps, names, used, ScoreTable(eps, names, used, list(columns))


@settings(max_examples=200, deadline=None)
@given(
    columns=st.lists(
        st.one_of(
            st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=5, max_size=5),
            st.sampled_from([0.0, 0.5, 1.0, NAN, 2.0]).map(lambda x: [x] * 5),
        ),
        min_size=0,
        max_size=7,
    ),
    weights=WEIGHTS,
)
def test_small_pool_sums_equal_the_column_by_column_sums(
    columns: list[list[float]], weights: list[float]
) -> None:
    """`fused_totals` (pools up to FUSED_LIMIT) adds in the same order as `add_weighted`:
    the same floats, so the same ranking and reported totals."""
    by_column: list[float] | None = None
    for column, w in zip(columns, weights, strict=False):
        by_column = add_weighted(by_column, column, w)
    generated = fused_totals(weights[: len(columns)])(columns)
    if by_column is None:
        assert generated == []
    else:
        assert generated == by_column


@settings(max_examples=200, deadline=None)
@given(
    columns=THREE_ENDPOINT_COLUMNS,
    weights=WEIGHTS,
)
def test_a_generated_row_equals_the_weighted_row(
    columns: list[list[float]], weights: list[float]
) -> None:
    """`fused_row` writes out `ScoreTable.weighted_row`'s expression per scorer: the same
    floats for every position (NaN scores 0, anything ≥ 1 the weight)."""
    eps, names, used, plain = plain_table(columns, weights)
    written = ScoreTable(eps, names, used, list(columns), fused_row(used))
    for s in eps:
        assert written.weighted_row(s) == plain.weighted_row(s)
    assert written.weighted_row(endpoint_state("10.9.9.9:1")) is None


@settings(max_examples=200, deadline=None)
@given(
    columns=THREE_ENDPOINT_COLUMNS,
    weights=WEIGHTS,
)
def test_a_generated_observer_adds_what_the_loop_over_the_row_adds(
    columns: list[list[float]], weights: list[float]
) -> None:
    """`fused_observe` writes out `observe_row`'s loop: each child gets the same count in
    the same bucket and the same sum as observing `weighted_row`'s values one by one."""
    eps, names, used, plain = plain_table(columns, weights)
    written = ScoreTable(eps, names, used, list(columns), None, fused_observe(used))
    bounds = (0.0, 0.25, 0.5, 1.0, 2.0, 3.0)
    for s in eps:
        ours, theirs = [Buckets(bounds) for _ in names], [Buckets(bounds) for _ in names]
        assert written.observe_row(s, ours) == plain.observe_row(s, theirs) == bool(names)
        for child, value in zip(theirs, plain.weighted_row(s) or [], strict=True):
            expected = Buckets(bounds)
            expected.observe(value)
            assert (child.counts, child.sum) == (expected.counts, expected.sum)
        assert [(c.counts, c.sum) for c in ours] == [(c.counts, c.sum) for c in theirs]
    assert not written.observe_row(endpoint_state("10.9.9.9:1"), [])


def test_small_and_large_pools_rank_and_total_alike() -> None:
    """A pool of FUSED_LIMIT endpoints is summed endpoint by endpoint, one more column by
    column; on the same endpoints both give the same totals and ranking."""
    columns = [[0.3, NAN, 1.5, 0.0, 0.7, 0.2, 0.9, 0.4, 0.1], [0.5] * 9, [1.0, 0.2] * 4 + [0.6]]
    eps = pool(FUSED_LIMIT + 1)
    scorers = [
        WeightedScorer(Fixed(f"s{i}", c), w)
        for i, (c, w) in enumerate(zip(columns, (3.0, 1.0, 2.0), strict=True))
    ]
    small = single(*scorers).schedule(REQUEST, eps[:FUSED_LIMIT], cycle(4)).results["default"]
    large = single(*scorers).schedule(REQUEST, eps, cycle(4)).results["default"]
    for s in eps[:FUSED_LIMIT]:
        assert small.totals[s.address] == large.totals[s.address]
