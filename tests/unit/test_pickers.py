"""Pickers: ranking, tie-breaks with a seeded rng, limits, weighted sampling."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from servegate.pool.endpoint import EndpointState
from servegate.pool.pool import Pool
from servegate.scheduling.factory import PluginContext, PluginParameterError
from servegate.scheduling.framework import CycleState
from servegate.scheduling.pickers import (
    MaxScorePicker,
    RandomPicker,
    RoundRobinPicker,
    WeightedRandomPicker,
)
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.testing.endpoints import addresses, endpoint_state

REQUEST = LLMRequest("r1", RequestKind.CHAT, "m", "m", "m")


def pool(n: int) -> list[EndpointState]:
    return [endpoint_state(a) for a in addresses(n)]


def cycle(seed: int) -> CycleState:
    return CycleState(now=100.0, rng=random.Random(seed))


def positions(ranked: list[EndpointState], eps: list[EndpointState]) -> list[int]:
    return [eps.index(s) for s in ranked]


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        pytest.param([0.1, 0.9, 0.5], [1, 2, 0], id="descending"),
        pytest.param([3.0, 2.0, 1.0, 0.0], [0, 1, 2, 3], id="already-sorted"),
        pytest.param([0.0], [0], id="one"),
    ],
)
def test_max_score_picker_ranks_by_score(scores: list[float], expected: list[int]) -> None:
    eps = pool(len(scores))
    ranked = MaxScorePicker().pick(cycle(0), REQUEST, eps, scores)
    assert positions(ranked, eps) == expected


def _ranked_by_sorting(rng: random.Random, scores: list[float]) -> tuple[list[int], float]:
    """The max-score ranking of any pool, written out: a rotation from a random offset,
    a stable descending sort, one of the tied leaders swapped to the front; and the next
    number the rng gives (to check how much of it was used)."""
    n = len(scores)
    offset = rng.randrange(n)
    order = [*range(offset, n), *range(offset)]
    order.sort(key=scores.__getitem__, reverse=True)
    tied = 1
    while tied < n and scores[order[tied]] == scores[order[0]]:
        tied += 1
    if tied > 1:
        j = rng.randrange(tied)
        order[0], order[j] = order[j], order[0]
    return order, rng.random()


@pytest.mark.parametrize("seed", range(4))
def test_max_score_picker_ranks_two_as_the_sort_does(seed: int) -> None:
    """Two endpoints take a shortcut: the same ranking, the same draws from the rng, for
    scores with ties, NaN and signed zeros."""
    values = [0.0, -0.0, 0.5, 1.0, 2.5, float("nan"), float("inf")]
    draw = random.Random(seed)
    eps = pool(2)
    for trial in range(300):
        scores = [draw.choice(values), draw.choice(values)]
        rng = random.Random(trial)
        ranked = MaxScorePicker().pick(CycleState(now=0.0, rng=rng), REQUEST, eps, scores)
        expected, after = _ranked_by_sorting(random.Random(trial), scores)
        assert positions(ranked, eps) == expected, scores
        assert rng.random() == after, scores


def test_max_score_picker_breaks_ties_for_first_place_at_random_but_reproducibly() -> None:
    eps = pool(4)
    scores = [1.0, 2.0, 2.0, 2.0]
    picker = MaxScorePicker()
    firsts = [
        positions(picker.pick(cycle(seed), REQUEST, eps, scores), eps)[0] for seed in range(60)
    ]
    assert set(firsts) == {1, 2, 3}
    again = [
        positions(picker.pick(cycle(seed), REQUEST, eps, scores), eps)[0] for seed in range(60)
    ]
    assert again == firsts
    for seed in range(20):
        ranked = positions(picker.pick(cycle(seed), REQUEST, eps, scores), eps)
        assert sorted(ranked[:3]) == [1, 2, 3]
        assert ranked[3] == 0


def test_max_score_picker_single_pick_ties_are_uniform_enough() -> None:
    eps = pool(3)
    picker = MaxScorePicker(max_num_of_endpoints=1)
    rng = random.Random(11)
    counts = Counter(
        eps.index(picker.pick(CycleState(0.0, rng), REQUEST, eps, [5.0, 5.0, 5.0])[0])
        for _ in range(3000)
    )
    # each of three tied endpoints expects 1000 wins; seeded, so the check is deterministic
    assert all(900 < counts[i] < 1100 for i in range(3))


@pytest.mark.parametrize(
    ("limit", "expected_len"),
    [
        pytest.param(None, 5, id="default-all"),
        pytest.param(1, 1, id="one"),
        pytest.param(3, 3, id="three"),
        pytest.param(10, 5, id="more-than-candidates"),
    ],
)
def test_max_num_of_endpoints_caps_the_ranking(limit: int | None, expected_len: int) -> None:
    eps = pool(5)
    scores = [0.5, 0.1, 0.9, 0.3, 0.7]
    ranked = MaxScorePicker(max_num_of_endpoints=limit).pick(cycle(1), REQUEST, eps, scores)
    assert positions(ranked, eps) == [2, 4, 0, 3, 1][:expected_len]


def test_random_picker_returns_a_reproducible_permutation() -> None:
    eps = pool(6)
    scores = [0.0] * 6
    first = RandomPicker().pick(cycle(3), REQUEST, eps, scores)
    assert sorted(positions(first, eps)) == list(range(6))
    assert RandomPicker().pick(cycle(3), REQUEST, eps, scores) == first
    heads = {
        positions(RandomPicker().pick(cycle(s), REQUEST, eps, scores), eps)[0] for s in range(60)
    }
    assert heads == set(range(6))
    assert len(RandomPicker(max_num_of_endpoints=1).pick(cycle(3), REQUEST, eps, scores)) == 1
    assert len(RandomPicker(max_num_of_endpoints=2).pick(cycle(3), REQUEST, eps, scores)) == 2


def test_weighted_random_picker_first_pick_is_proportional_to_score() -> None:
    eps = pool(2)
    picker = WeightedRandomPicker(max_num_of_endpoints=1)
    rng = random.Random(5)
    wins = sum(
        picker.pick(CycleState(0.0, rng), REQUEST, eps, [3.0, 1.0])[0] is eps[0]
        for _ in range(4000)
    )
    # P(first) = 3 / (3 + 1) = 0.75 → 3000 expected; seeded, so the bound is deterministic
    assert 2850 < wins < 3150


def test_weighted_random_picker_ranks_zero_scores_last() -> None:
    eps = pool(5)
    scores = [0.0, 2.0, 0.0, 1.0, 0.0]
    for seed in range(30):
        ranked = positions(WeightedRandomPicker().pick(cycle(seed), REQUEST, eps, scores), eps)
        assert sorted(ranked[:2]) == [1, 3]
        assert sorted(ranked[2:]) == [0, 2, 4]


def test_weighted_random_picker_with_all_zero_scores_is_uniform_permutation() -> None:
    eps = pool(4)
    heads = Counter(
        positions(WeightedRandomPicker().pick(cycle(seed), REQUEST, eps, [0.0] * 4), eps)[0]
        for seed in range(400)
    )
    assert set(heads) == {0, 1, 2, 3}
    assert min(heads.values()) > 60  # 100 expected each


@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [
        pytest.param({"maxNumOfEndpoints": 0}, "greater than 0", id="zero"),
        pytest.param({"maxNumOfEndpoints": "2"}, "valid integer", id="string"),
        pytest.param({"maxNumOfEndpoints": True}, "valid integer", id="bool"),
        pytest.param({"topK": 3}, "unknown parameter 'topK'", id="unknown"),
    ],
)
@pytest.mark.parametrize(
    "cls", [MaxScorePicker, RandomPicker, WeightedRandomPicker, RoundRobinPicker]
)
def test_picker_parameter_errors(
    cls: type[MaxScorePicker], parameters: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(PluginParameterError) as info:
        cls.from_config("p", parameters, PluginContext())
    assert f"(type '{cls.type}')" in str(info.value)
    assert fragment in str(info.value)


def test_picker_parameters_decode() -> None:
    picker = MaxScorePicker.from_config("p", {"maxNumOfEndpoints": 2}, PluginContext())
    assert (picker.name, picker.max_num_of_endpoints) == ("p", 2)
    assert MaxScorePicker.from_config("q", {}, PluginContext()).max_num_of_endpoints is None


@pytest.mark.parametrize(
    ("last_picked", "expected"),
    [
        pytest.param([0.0, 0.0, 0.0], [0, 1, 2], id="never-picked-by-address"),
        pytest.param([3.0, 1.0, 2.0], [1, 2, 0], id="oldest-first"),
        pytest.param([5.0, 0.0, 5.0], [1, 0, 2], id="new-endpoint-first-then-ties-by-address"),
    ],
)
def test_round_robin_picker_orders_least_recently_picked_first(
    last_picked: list[float], expected: list[int]
) -> None:
    eps = pool(len(last_picked))
    for state, at in zip(eps, last_picked, strict=True):
        state.last_picked_at = at
    ranked = RoundRobinPicker().pick(cycle(0), REQUEST, eps, [1.0, 0.0, 0.5])
    assert positions(ranked, eps) == expected


def test_round_robin_picker_rotates_through_the_pool_it_dispatches_to() -> None:
    pool_ = Pool()
    eps = [pool_.add(s.endpoint) for s in pool(3)]
    picker = RoundRobinPicker(max_num_of_endpoints=1)
    chosen = []
    for step in range(7):
        (target,) = picker.pick(cycle(step), REQUEST, eps, [0.0, 1.0, 0.0])
        pool_.acquire(target, tokens=1, now=10.0 + step)
        chosen.append(eps.index(target))
    # 7 picks over 3 endpoints: 0, 1, 2, then the same cycle again; scores never matter.
    assert chosen == [0, 1, 2, 0, 1, 2, 0]


def test_the_two_endpoint_coin_is_randrange_2_draw_for_draw() -> None:
    from servegate.scheduling.pickers import _coin

    class Counting(random.Random):
        pass

    for kind in (random.Random, Counting):
        ours, theirs = kind(7), kind(7)
        assert [_coin(ours) for _ in range(2000)] == [theirs.randrange(2) for _ in range(2000)]
        assert ours.random() == theirs.random()
