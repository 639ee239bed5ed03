"""The online relative-error regression under the latency predictor."""

from __future__ import annotations

import random

import pytest

from servegate.scheduling.latency.model import HUBER_AFTER, OnlineRegression, solve
from servegate.scheduling.latency.unrolled import accumulate, ridge_solver, triangle_index


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


def _eager_theta(
    prior: list[float], scale: list[float], weight: float, forgetting: float, typical: float,
    data: list[tuple[list[float], float]],
) -> list[list[float]]:  # fmt: skip
    """θ after each observation, by the former algorithm: full statistics, prior from
    the solve after each observation, pivoted elimination (the reference)."""
    d = len(prior)
    xtx = [[0.0] * d for _ in range(d)]
    xty = [0.0] * d
    wsum = n = 0.0
    theta = list(prior)
    out = []
    for x, y in data:
        w = 1.0 / y**2
        if n >= HUBER_AFTER:
            miss = abs(y - sum(t * v for t, v in zip(theta, x, strict=True))) / y
            w *= 0.5 / miss if miss > 0.5 else 1.0
        for i in range(d):
            for j in range(d):
                xtx[i][j] = forgetting * xtx[i][j] + w * x[i] * x[j]
            xty[i] = forgetting * xty[i] + w * x[i] * y
        n = forgetting * n + 1.0
        wsum = forgetting * wsum + w
        k = weight * wsum / n
        a = [
            [xtx[i][j] + (k * scale[i] ** 2 if i == j else 0.0) for j in range(d)] for i in range(d)
        ]
        b = [xty[i] + k * scale[i] ** 2 * prior[i] for i in range(d)]
        theta = solve(a, b) or theta
        out.append(theta)
    return out


@pytest.mark.parametrize("d", [1, 6, 9])
def test_the_lazily_solved_theta_equals_the_eagerly_solved_one(d: int) -> None:
    rng = random.Random(d)
    prior = [rng.uniform(0.0, 20.0) for _ in range(d)]
    scale = [rng.uniform(0.2, 4.0) for _ in range(d)]
    data = [
        ([1.0] + [rng.uniform(0.0, 5.0) for _ in range(d - 1)], rng.uniform(5.0, 2000.0))
        for _ in range(120)
    ]
    eager = _eager_theta(prior, scale, 2.0, 0.99, 50.0, data)
    model = OnlineRegression(prior, scale, 2.0, 0.99, 50.0)
    for step, (x, y) in enumerate(data):
        model.observe(x, y)
        if step % 7 == 0 or step >= 100:  # read after some observations only: lazy solves
            assert model.theta == pytest.approx(eager[step], rel=1e-9)
    assert model.effective_n > HUBER_AFTER  # Huber's reads of θ were exercised too


def test_the_prior_at_the_last_observation_is_what_theta_is_solved_towards() -> None:
    model = OnlineRegression([10.0], [1.0], prior_weight=1.0, forgetting=1.0)
    model.observe([1.0], 30.0)
    model.prior = [1000.0]  # set for the next observation, as the predictor does
    assert model.theta == pytest.approx([20.0])  # halfway between 10 and 30, not 1000
    model.observe([1.0], 30.0)
    assert model.theta == pytest.approx([(1000.0 + 2 * 30.0) / 3])


@pytest.mark.parametrize("d", [1, 2, 6, 9])
def test_the_unrolled_steps_match_the_loops_they_replace(d: int) -> None:
    rng = random.Random(10 + d)
    for _ in range(20):
        rows = [[rng.uniform(-3.0, 3.0) for _ in range(d)] for _ in range(d + 3)]
        full = [[sum(r[i] * r[j] for r in rows) for j in range(d)] for i in range(d)]
        tri = [full[i][j] for i in range(d) for j in range(i, d)]
        assert tri[triangle_index(d, d - 1, d - 1)] == full[d - 1][d - 1]
        b = [rng.uniform(-5.0, 5.0) for _ in range(d)]
        scale = [rng.uniform(0.1, 2.0) for _ in range(d)]
        prior = [rng.uniform(-1.0, 1.0) for _ in range(d)]
        k = rng.uniform(1e-3, 1.0)
        a = [[full[i][j] + (k * scale[i] if i == j else 0.0) for j in range(d)] for i in range(d)]
        reference = solve(a, [b[i] + k * scale[i] * prior[i] for i in range(d)])
        assert reference is not None
        assert ridge_solver(d)(tri, b, k, scale, prior) == pytest.approx(reference, rel=1e-9)
        x, w, y, lam = rows[0], rng.uniform(0.1, 2.0), rng.uniform(1.0, 9.0), 0.9
        new_a, new_b = accumulate(d)(tri, b, x, w, y, lam)
        assert new_a == [lam * full[i][j] + w * x[i] * x[j] for i in range(d) for j in range(i, d)]
        assert new_b == [lam * b[i] + w * x[i] * y for i in range(d)]


def test_a_system_that_is_not_positive_definite_falls_back_to_elimination() -> None:
    indefinite = [1.0, 2.0, 1.0]  # [[1, 2], [2, 1]]: what rounding could leave, in extremis
    assert ridge_solver(2)(indefinite, [3.0, 3.0], 0.0, [1.0, 1.0], [0.0, 0.0]) is None
    model = OnlineRegression([0.0, 0.0], [1.0, 1.0], 1e-300, forgetting=1.0)
    model.observe([1.0, 1.0], 1.0)
    model._xtx, model._xty = indefinite, [3.0, 3.0]
    model.refit()
    assert model.theta == pytest.approx([1.0, 1.0])
