import random

import pytest

from servegate.config import RetrySettings
from servegate.gateway.retry import RetryBudget


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_budget_is_a_share_of_requests_plus_a_floor() -> None:
    clock = Clock()
    budget = RetryBudget(
        RetrySettings(budget_percent=20, min_retries_per_s=0.5, window_s=10), clock=clock
    )
    for _ in range(100):
        budget.request()
    # 0.5/s x 10 s + 20% x 100 = 25 retries
    granted = sum(budget.try_retry() for _ in range(40))
    assert granted == 25
    assert budget.exhausted == 15


def test_budget_refills_as_the_window_slides() -> None:
    clock = Clock()
    budget = RetryBudget(
        RetrySettings(budget_percent=0, min_retries_per_s=0.2, window_s=10), clock=clock
    )
    # floor: 0.2 x 10 = 2
    assert [budget.try_retry() for _ in range(3)] == [True, True, False]
    clock.now += 11
    assert budget.try_retry()


@pytest.mark.parametrize(
    ("retry", "cap"),
    [
        pytest.param(1, 0.01, id="first"),  # 0.01 x 2^0
        pytest.param(3, 0.04, id="third"),  # 0.01 x 2^2
        pytest.param(10, 0.25, id="capped"),  # min(0.25, 0.01 x 2^9)
    ],
)
def test_backoff_is_full_jitter_under_the_cap(retry: int, cap: float) -> None:
    budget = RetryBudget(RetrySettings(), rng=random.Random(1))
    delays = [budget.backoff(retry) for _ in range(200)]
    assert all(0.0 <= d <= cap for d in delays)
    assert max(delays) > cap / 2


def test_zero_backoff() -> None:
    assert RetryBudget(RetrySettings(backoff_base_s=0)).backoff(3) == 0.0
