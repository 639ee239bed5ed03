"""`Pool.candidates` hands out one list per state of the pool, rebuilt only on change."""

from __future__ import annotations

from types import MappingProxyType

from servegate.pool.endpoint import Endpoint, Role
from servegate.pool.pool import CANDIDATE_LISTS, ModelEntry, Pool


def _pool(n: int = 4) -> Pool:
    pool = Pool()
    for i in range(n):
        address = f"127.0.0.1:{8100 + i}"
        pool.add(
            Endpoint(
                address=address,
                url=f"http://{address}",
                engine="vllm",
                role=Role.BOTH,
                model="m",
                labels=MappingProxyType({}),
            )
        )
        pool.set_health(address, True)
    return pool


def _addresses(pool: Pool, now: float = 10.0, adapter: str | None = None) -> list[str]:
    return [s.address for s in pool.candidates("m", now, adapter)]


def test_a_steady_pool_returns_the_same_list() -> None:
    pool = _pool()
    first = pool.candidates("m", 10.0)
    assert pool.candidates("m", 11.0) is first
    assert len(first) == 4


def test_health_drain_membership_and_models_rebuild_the_list() -> None:
    pool = _pool()
    pool.set_health("127.0.0.1:8100", False)
    assert "127.0.0.1:8100" not in _addresses(pool)
    pool.set_health("127.0.0.1:8100", True)
    assert "127.0.0.1:8100" in _addresses(pool)
    pool.set_draining("127.0.0.1:8101", True)
    assert "127.0.0.1:8101" not in _addresses(pool)
    pool.remove("127.0.0.1:8102")
    assert "127.0.0.1:8102" not in _addresses(pool)
    pool.set_served_models("127.0.0.1:8103", [ModelEntry("m"), ModelEntry("a1", "m")])
    assert _addresses(pool, adapter="a1") == ["127.0.0.1:8103"]


def test_an_ejection_ends_on_time_without_any_write() -> None:
    pool = _pool()
    pool.eject("127.0.0.1:8100", until=20.0)
    assert "127.0.0.1:8100" not in _addresses(pool, now=19.9)
    assert "127.0.0.1:8100" in _addresses(pool, now=20.0)


def test_client_chosen_adapter_names_keep_the_cache_bounded() -> None:
    pool = _pool()
    for i in range(CANDIDATE_LISTS * 3):
        pool.candidates("m", 10.0, f"adapter-{i}")
    assert len(pool._candidates) <= CANDIDATE_LISTS
