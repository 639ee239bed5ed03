"""The online relative-error regression under the latency predictor."""

from __future__ import annotations

import random

import pytest

from servegate.scheduling.latency.model import OnlineRegression, solve


def test_solve_matches_a_known_system_and_reports_singular_ones() -> None:
    a = [[2.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 4.0]]
    x = solve(a, [3.0, 5.0, 5.0])
    assert x == pytest.approx([1.0, 1.0, 1.0])
    assert a[0] == [2.0, 1.0, 0.0]  # inputs untouched
    assert solve([[1.0, 2.0], [2.0, 4.0]], [1.0, 2.0]) is None
    # a zero leading pivot needs a row swap
    assert solve([[0.0, 1.0], [1.0, 0.0]], [2.0, 3.0]) == pytest.approx([3.0, 2.0])


def test_without_data_the_prior_is_the_prediction() -> None:
    model = OnlineRegression([10.0, 2.0], [1.0, 1.0])
    assert model.predict([1.0, 5.0]) == pytest.approx(20.0)
    assert model.effective_n == 0.0


def test_noiseless_data_recovers_the_coefficients_despite_a_wrong_prior() -> None:
    model = OnlineRegression([1.0, 1.0, 1.0], [1.0] * 3, 1e-6, forgetting=1.0)
    rng = random.Random(3)
    for _ in range(200):
        x = [1.0, rng.uniform(0, 4), rng.uniform(0, 10)]
        model.observe(x, 20.0 + 30.0 * x[1] + 5.0 * x[2])
    assert model.theta == pytest.approx([20.0, 30.0, 5.0], rel=1e-3)


def test_forgetting_follows_drift() -> None:
    model = OnlineRegression([0.0, 0.0], [1.0, 1.0], 1e-6, forgetting=0.95)
    rng = random.Random(4)
    for _ in range(300):
        x = [1.0, rng.uniform(0, 4)]
        model.observe(x, 10.0 + 10.0 * x[1])
    for _ in range(300):  # the endpoint got twice as slow
        x = [1.0, rng.uniform(0, 4)]
        model.observe(x, 20.0 + 20.0 * x[1])
    assert model.theta == pytest.approx([20.0, 20.0], rel=0.02)
    frozen = OnlineRegression([0.0, 0.0], [1.0, 1.0], 1e-6, forgetting=1.0)
    rng = random.Random(4)
    for slope in (10.0, 20.0):
        for _ in range(300):
            x = [1.0, rng.uniform(0, 4)]
            frozen.observe(x, slope + slope * x[1])
    assert frozen.theta[1] < 18.0  # without forgetting it stays between the regimes


def test_the_prior_holds_a_coefficient_the_data_does_not_excite() -> None:
    model = OnlineRegression([5.0, 7.0], [1.0, 1.0], 0.01, forgetting=1.0)
    for _ in range(50):
        model.observe([1.0, 0.0], 12.0)  # the second feature is always 0
    assert model.theta[0] == pytest.approx(12.0, rel=1e-3)
    assert model.theta[1] == pytest.approx(7.0)


def test_error_is_relative_so_small_latencies_are_fitted_as_well_as_large_ones() -> None:
    model = OnlineRegression([0.0, 0.0], [1.0, 1.0], 1e-9, forgetting=1.0)
    # y = 10·x exactly for small x, and a large point that disagrees by 10 %
    for _ in range(20):
        model.observe([0.0, 1.0], 10.0)
    model.observe([0.0, 100.0], 1100.0)
    # absolute least squares would follow the large point (slope ≈ 11); relative
    # weighting keeps the slope near the many small observations
    assert model.theta[1] == pytest.approx(10.05, abs=0.05)


def test_a_wild_observation_after_warm_up_moves_the_fit_less_than_without_huber() -> None:
    def fitted(huber: float) -> float:
        model = OnlineRegression([0.0, 0.0], [1.0, 1.0], 1e-9, forgetting=1.0)
        for _ in range(40):
            model.observe([1.0, 0.0], 100.0, huber=huber)
        model.observe([1.0, 0.0], 1000.0, huber=huber)  # one stalled request
        return model.theta[0]

    assert fitted(0.5) < fitted(1e9)
    assert fitted(0.5) == pytest.approx(100.0, rel=0.02)


def test_the_prior_is_worth_the_same_observations_at_any_latency_scale() -> None:
    for latency in (10.0, 10_000.0):
        model = OnlineRegression([0.0], [1.0], prior_weight=1.0, forgetting=1.0)
        model.observe([1.0], latency)
        # one observation against a prior worth one: halfway
        assert model.theta[0] == pytest.approx(latency / 2)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="same length"):
        OnlineRegression([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="prior_weight"):
        OnlineRegression([1.0], [1.0], prior_weight=0.0)
    with pytest.raises(ValueError, match="forgetting"):
        OnlineRegression([1.0], [1.0], forgetting=0.0)
