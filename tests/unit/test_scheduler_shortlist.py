"""Large pools are scored on a shortlist: prefix holders plus a uniform sample.

Compared against exhaustive scoring of the same pool, state and request: the
cache decision (how much of the prompt the chosen replica holds) must be the
same; when the affinity filter keeps the holders alone, both score the same
replicas, so the totals are equal and the choice is an exhaustive best; a
load-only decision must land near the top of the exhaustive ranking. Whatever
the path, the totals are each scorer's clamped score times its weight, summed.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Collection, Sequence

import pytest

from servegate.pool.endpoint import EndpointState, LoraInfo
from servegate.scheduling.config import DEFAULT_PICKER_CONFIG, load_picker_config
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.framework import CycleState, Decision, SchedulerProfile, WeightedScorer
from servegate.scheduling.pickers import MaxScorePicker
from servegate.scheduling.prefix.approx import PrefixCacheScorer
from servegate.scheduling.prefix.events import BlockStored
from servegate.scheduling.prefix.precise import PrecisePrefixCacheScorer
from servegate.scheduling.profiles import SingleProfileHandler
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.scheduling.scheduler import Scheduler, clamp, spread_sample
from servegate.scheduling.scorers import QueueScorer
from servegate.testing.endpoints import random_endpoint_states

POOL = 1000


def _request(i: int, lora: str | None = None) -> LLMRequest:
    prompt = f"system prompt {i % 7} " * 200 + f"question {i}"
    return LLMRequest(
        request_id=f"r{i}",
        kind=RequestKind.COMPLETION,
        model=lora or "base",
        target_model=lora or "base",
        base_model="base",
        lora=lora,
        prompt=prompt,
        prompt_tokens=len(prompt) // 4,
        max_tokens=16,
    )


FILTER_LINES = (
    "- type: prefix-cache-affinity-filter\n"
    "  parameters: {maxInFlightRequestsDelta: 3, prefixMatchInfoProducerName: prefix-cache-scorer}\n",
    "  - {pluginRef: prefix-cache-affinity-filter}\n",
)
"""The default profile's affinity filter: it narrows a held prefix to its holders before
any scorer runs, so the shortlist is checked with the default's scorers alone too."""


def _default(
    seed: int, filtered: bool = True
) -> tuple[Scheduler, list[EndpointState], PrefixCacheScorer]:
    config = DEFAULT_PICKER_CONFIG
    if not filtered:
        for line in FILTER_LINES:
            assert line in config
            config = config.replace(line, "")
    scheduler = load_picker_config(config, PluginContext(staleness_s=2.0))
    states = random_endpoint_states(POOL, random.Random(seed))
    scorer = scheduler.plugins["prefix-cache-scorer"]
    assert isinstance(scorer, PrefixCacheScorer)
    return scheduler, states, scorer


def _decide(
    scheduler: Scheduler, request: LLMRequest, states: list[EndpointState], exhaustive: bool
) -> Decision:
    limit = scheduler.exhaustive_limit
    if exhaustive:
        scheduler.exhaustive_limit = 1 << 30
    try:
        return scheduler.schedule(request, states, CycleState(now=100.0, rng=random.Random(1)))
    finally:
        scheduler.exhaustive_limit = limit


def _held(scorer: PrefixCacheScorer, request: LLMRequest, state: EndpointState) -> int:
    keys = scorer.block_keys(request)
    return scorer.index.match_lengths(keys, [state.address])[state.address]


@pytest.mark.parametrize("filtered", [True, False], ids=["default", "default-scorers"])
@pytest.mark.parametrize("seed", range(12))
def test_the_cache_decision_matches_exhaustive_scoring(seed: int, filtered: bool) -> None:
    scheduler, states, scorer = _default(seed, filtered)
    rng = random.Random(seed)
    request = _request(seed)
    keys = scorer.block_keys(request)
    # a few replicas hold the whole prompt, more hold a part of it, most nothing
    for state in rng.sample(states, 3):
        scorer.index.insert(state.address, keys)
    for state in rng.sample(states, 20):
        scorer.index.insert(state.address, keys[: rng.randrange(1, len(keys))])
    short = _decide(scheduler, request, states, exhaustive=False)
    full = _decide(scheduler, request, states, exhaustive=True)
    assert scheduler.stats.shortlisted == 1
    assert _held(scorer, request, short.endpoint) == _held(scorer, request, full.endpoint)
    assert _held(scorer, request, short.endpoint) > 0


ADAPTERS = ("a1", "a2", "a3", "a4")


def _with_lora(states: list[EndpointState], rng: random.Random) -> None:
    """Random adapter state: running one or two adapters, some waiting, or none reported."""
    for state in states:
        if rng.random() < 0.2:
            continue  # no lora_requests_info series yet
        state.metrics.lora = LoraInfo(
            max_lora=2,
            running=frozenset(rng.sample(ADAPTERS, rng.randint(0, 2))),
            waiting=frozenset(rng.sample(ADAPTERS, rng.randint(0, 1))),
        )


@pytest.mark.parametrize("seed", range(16))
def test_a_sticky_decision_is_an_exhaustive_best(seed: int) -> None:
    """Random loads, LoRA slots and prefix holders, an adapter request half the time.

    The holders are few (all on the shortlist) and lightly loaded, so the affinity filter
    keeps them alone on both paths: shortlist and exhaustive scoring then score the same
    replicas, and must give them the same totals and choose a replica with the best one
    (ties are broken by the cycle's random draws, which the shortlist's sample shifts).
    """
    scheduler, states, scorer = _default(seed)
    rng = random.Random(seed)
    _with_lora(states, rng)
    request = _request(seed, lora=rng.choice([None, "a1", "a3"]))
    keys = scorer.block_keys(request)
    full = rng.sample(states, rng.randint(2, 6))
    partial = rng.sample([s for s in states if s not in full], rng.randint(0, 12))
    for state in full:
        scorer.index.insert(state.address, keys)
    for state in partial:
        scorer.index.insert(state.address, keys[: rng.randrange(1, len(keys))])
    for state in [*full, *partial]:
        state.in_flight_requests = rng.randint(0, 2)  # the least loaded other may have 0
    short = _decide(scheduler, request, states, exhaustive=False)
    whole = _decide(scheduler, request, states, exhaustive=True)
    assert scheduler.stats.shortlisted == 1
    affinity = scheduler.plugins["prefix-cache-affinity-filter"]
    assert affinity.decisions == {"sticky": 2}
    short_totals = dict(short.results["default"].totals)
    whole_totals = dict(whole.results["default"].totals)
    assert short_totals == whole_totals
    assert short_totals[short.endpoint.address] == max(whole_totals.values())
    assert short.endpoint in full or _held(scorer, request, short.endpoint) >= 0.8 * len(keys)


def _plain_totals(
    scheduler: Scheduler, request: LLMRequest, scored: list[EndpointState]
) -> dict[str, float]:
    """Each scorer alone on a fresh cycle (nothing shared), clamped, weighted, summed in order."""
    totals = dict.fromkeys((s.address for s in scored), 0.0)
    for weighted in scheduler.profiles["default"].scorers:
        raw = weighted.scorer.score(CycleState(100.0, random.Random(0)), request, scored)
        for state, x in zip(scored, raw, strict=True):
            totals[state.address] += weighted.weight * clamp(x)
    return totals


@pytest.mark.parametrize("pool", [8, 100, POOL])
@pytest.mark.parametrize("seed", range(6))
def test_the_totals_are_the_plain_weighted_sum(seed: int, pool: int) -> None:
    """Randomized traffic through the default profile (cold and warm prompts, adapters,
    never-scraped replicas whose metrics score NaN): the totals the scheduler reports equal
    a plain recomputation, column by column, for the replicas it scored."""
    scheduler = load_picker_config(DEFAULT_PICKER_CONFIG, PluginContext(staleness_s=2.0))
    rng = random.Random(seed)
    states = random_endpoint_states(pool, rng)
    _with_lora(states, rng)
    for state in rng.sample(states, max(1, pool // 10)):
        state.metrics.scraped_at = 0.0
    for i in range(40):
        request = _request(rng.randrange(10**6) if rng.random() < 0.3 else i % 5)
        request.lora = rng.choice([None, None, "a2", "a4"])
        cycle = CycleState(100.0 + i, random.Random(i))
        decision = scheduler.schedule(request, states, cycle)
        result = decision.results["default"]
        scored = [s for s in states if s.address in result.totals]
        assert dict(result.totals) == _plain_totals(scheduler, request, scored)
        scheduler.pre_request(request, decision, cycle.now)
        decision.endpoint.in_flight_requests += 1
    assert scheduler.stats.shortlisted == (40 if pool > scheduler.exhaustive_limit else 0)


def test_a_load_only_decision_is_near_the_exhaustive_best() -> None:
    """No replica holds anything: the best of 64 sampled replicas against all 1,000."""
    scheduler, states, _ = _default(99)
    percentiles = []
    for i in range(100):
        request = _request(10_000 + i)
        short = _decide(scheduler, request, states, exhaustive=False)
        full = _decide(scheduler, request, states, exhaustive=True)
        totals = full.results["default"].totals
        ranked = sorted(totals.values(), reverse=True)
        percentiles.append(ranked.index(totals[short.endpoint.address]) / POOL)
    # expected rank of the best of 64 uniform draws among 1,000: ~1.5 %
    assert statistics.median(percentiles) <= 0.03
    assert max(percentiles) <= 0.10


def test_small_pools_are_scored_exhaustively() -> None:
    scheduler = load_picker_config(DEFAULT_PICKER_CONFIG, PluginContext(staleness_s=2.0))
    states = random_endpoint_states(scheduler.exhaustive_limit, random.Random(3))
    decision = scheduler.schedule(_request(1), states, CycleState(100.0, random.Random(1)))
    assert scheduler.stats.shortlisted == 0
    assert len(decision.results["default"].totals) == len(states)


def test_a_large_pool_scores_a_bounded_shortlist() -> None:
    scheduler, states, _ = _default(5)
    decision = _decide(scheduler, _request(3), states, exhaustive=False)
    scored = len(decision.results["default"].totals)
    assert scheduler.sample_size <= scored <= scheduler.sample_size + scheduler.hint_limit * 2


def test_a_preference_filter_chooses_within_the_shortlist(monkeypatch: pytest.MonkeyPatch) -> None:
    """The affinity filter matches the prompt against every endpoint it is given: in a large
    pool it is given the shortlist (holders and sample), not all 1,000, and the holder wins."""
    scheduler, states, scorer = _default(8)
    seen: list[int] = []
    real = scorer.match

    # the prefix match the filter reads, spied on the scorer (plain Python; the filter is
    # compiled, native.txt, and its methods cannot be patched)
    def spy(request: LLMRequest, endpoints: Sequence[EndpointState]) -> list[float]:
        seen.append(len(endpoints))
        return real(request, endpoints)

    monkeypatch.setattr(scorer, "match", spy)
    request = _request(8)
    holder = states[777]
    scorer.index.insert(holder.address, scorer.block_keys(request))
    decision = _decide(scheduler, request, states, exhaustive=False)
    assert seen and max(seen) == len(decision.results["default"].totals)
    assert max(seen) <= scheduler.sample_size + scheduler.hint_limit
    assert decision.endpoint is holder


class _CannotSay:
    type = "cannot-say-scorer"
    name = "cannot-say-scorer"

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[float]:
        return [0.0] * len(endpoints)

    def shortlist(
        self, cycle: CycleState, request: LLMRequest, limit: int
    ) -> Collection[str] | None:
        return None


def test_a_shortlister_that_cannot_say_gets_every_candidate() -> None:
    profile = SchedulerProfile(
        "default",
        filters=[],
        scorers=[WeightedScorer(_CannotSay()), WeightedScorer(QueueScorer())],
        picker=MaxScorePicker(),
    )
    scheduler = Scheduler({"default": profile}, SingleProfileHandler(), {})
    states = random_endpoint_states(POOL, random.Random(4))
    decision = scheduler.schedule(_request(1), states, CycleState(100.0, random.Random(1)))
    assert len(decision.results["default"].totals) == POOL
    assert scheduler.stats.shortlisted == 0


def test_hashed_cold_placement_scores_everyone_until_a_prefix_is_held() -> None:
    config = DEFAULT_PICKER_CONFIG.replace(
        "- type: prefix-cache-scorer\n",
        "- type: prefix-cache-scorer\n  parameters: {coldPlacement: hash}\n",
    )
    scheduler = load_picker_config(config, PluginContext(staleness_s=2.0))
    states = random_endpoint_states(POOL, random.Random(6))
    request = _request(2)
    first = scheduler.schedule(request, states, CycleState(100.0, random.Random(1)))
    assert scheduler.stats.shortlisted == 0
    again = scheduler.schedule(request, states, CycleState(100.0, random.Random(2)))
    assert again.endpoint is first.endpoint  # the rendezvous choice, every time


@pytest.mark.parametrize("seed", range(6))
def test_replicas_the_kv_events_name_are_on_the_shortlist(seed: int) -> None:
    """The precise index (fed by BlockStored events) names its holders, at their block size."""
    scheduler, states, _ = _default(seed)
    precise = scheduler.plugins["precise-prefix-cache-scorer"]
    assert isinstance(precise, PrecisePrefixCacheScorer)
    rng = random.Random(seed)
    request = _request(seed)
    tokens = list(range(1000, 1000 + 64 * 20))
    request.cache["token_ids"] = tokens
    holders = rng.sample(states, 4)
    for state in holders:
        precise.index.store(
            state.address,
            BlockStored(
                block_hashes=list(range(1, 21)),
                parent_block_hash=None,
                token_ids=tokens,
                block_size=64,
            ),
        )
    short = _decide(scheduler, request, states, exhaustive=False)
    assert scheduler.stats.shortlisted == 1
    scored = set(short.results["default"].totals)
    assert {s.address for s in holders} <= scored


@pytest.mark.parametrize(("n", "k"), [(129, 64), (1000, 64), (1024, 64), (200, 200)])
def test_the_sample_is_distinct_and_uniform(n: int, k: int) -> None:
    rng = random.Random(n)
    hits = [0] * n
    for _ in range(2000):
        drawn = [i % n for i in spread_sample(rng, n, k)]
        assert len(set(drawn)) == k
        for i in drawn:
            hits[i] += 1
    expected = 2000 * k / n
    assert min(hits) > 0.5 * expected and max(hits) < 1.5 * expected
