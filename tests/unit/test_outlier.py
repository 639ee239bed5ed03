import pytest

from servegate.datalayer.outlier import OutlierDetectionSettings, OutlierDetector
from servegate.pool.pool import Pool
from servegate.testing.endpoints import endpoint_state


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool_of(n: int) -> Pool:
    pool = Pool()
    for i in range(n):
        state = pool.add(endpoint_state(f"10.0.0.{i}:8000").endpoint)
        pool.set_health(state.address, True)
    return pool


def detector(pool: Pool, clock: Clock, **settings: object) -> OutlierDetector:
    cfg = OutlierDetectionSettings(consecutive_failures=3, base_ejection_time_s=10, **settings)  # type: ignore[arg-type]
    return OutlierDetector(pool, cfg, clock=clock)


def fail(d: OutlierDetector, pool: Pool, address: str, times: int) -> bool:
    state = pool.get(address)
    assert state is not None
    return any([d.failure(state, "connect") for _ in range(times)])


def test_consecutive_failures_eject_for_base_time() -> None:
    pool, clock = pool_of(3), Clock()
    d = detector(pool, clock)
    assert not fail(d, pool, "10.0.0.0:8000", 2)
    assert fail(d, pool, "10.0.0.0:8000", 1)
    state = pool.get("10.0.0.0:8000")
    assert state is not None
    assert state.ejected_until == 110.0  # 100 + 10 x 1
    assert d.ejected() == ["10.0.0.0:8000"]
    assert pool.ready_count(clock.now) == 2
    assert pool.ready_count(110.0) == 3


def test_success_resets_the_run() -> None:
    pool, clock = pool_of(3), Clock()
    d = detector(pool, clock)
    state = pool.get("10.0.0.0:8000")
    assert state is not None
    fail(d, pool, state.address, 2)
    d.success(state)
    assert not fail(d, pool, state.address, 2)


def test_repeat_ejections_grow_and_cap() -> None:
    pool, clock = pool_of(3), Clock()
    d = detector(pool, clock, max_ejection_time_s=25)
    state = pool.get("10.0.0.1:8000")
    assert state is not None
    lengths = []
    for _ in range(3):
        fail(d, pool, state.address, 3)
        lengths.append(state.ejected_until - clock.now)
        clock.now = state.ejected_until
    # 10 x 1, 10 x 2, min(10 x 3, 25)
    assert lengths == [10.0, 20.0, 25.0]


@pytest.mark.parametrize(
    ("endpoints", "percent", "allowed"),
    [
        pytest.param(1, 100.0, 0, id="one-never"),
        pytest.param(2, 100.0, 1, id="two-all-but-one"),
        pytest.param(2, 10.0, 1, id="at-least-one"),  # floor(0.2) = 0 → raised to 1
        pytest.param(10, 50.0, 5, id="half"),
        pytest.param(10, 100.0, 9, id="never-all"),
    ],
)
def test_max_ejected(endpoints: int, percent: float, allowed: int) -> None:
    d = OutlierDetector(Pool(), OutlierDetectionSettings(max_ejection_percent=percent))
    assert d.max_ejected(endpoints) == allowed


def test_never_ejects_every_endpoint() -> None:
    pool, clock = pool_of(2), Clock()
    d = detector(pool, clock, max_ejection_percent=100)
    assert fail(d, pool, "10.0.0.0:8000", 3)
    assert not fail(d, pool, "10.0.0.1:8000", 10)
    assert pool.ready_count(clock.now) == 1
    assert d.records["10.0.0.1:8000"].refused_total >= 1


def test_disabled_never_ejects() -> None:
    pool, clock = pool_of(3), Clock()
    d = detector(pool, clock, enabled=False)
    assert not fail(d, pool, "10.0.0.0:8000", 10)
