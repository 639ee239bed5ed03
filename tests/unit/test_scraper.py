from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from fake_replica import FakeReplica, fixture_page, wait_until
from pydantic import ValidationError

from servegate.datalayer.metrics_parser import MetricsParser, ParseResult
from servegate.datalayer.scraper import Scraper, ScrapeSettings, ScrapeStats
from servegate.engines import builtin_engines
from servegate.pool.endpoint import Endpoint
from servegate.pool.pool import Pool

ENGINES = builtin_engines()
FAST = ScrapeSettings(scrape_interval_s=0.05, scrape_timeout_s=0.3)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def replica() -> AsyncIterator[FakeReplica]:
    server = await FakeReplica(fixture_page("vllm")).start()
    yield server
    await server.stop()


def make_scraper(
    replica: FakeReplica,
    session: aiohttp.ClientSession,
    engine: str = "vllm",
    settings: ScrapeSettings = FAST,
    max_body_bytes: int = 16 * 1024 * 1024,
) -> tuple[Pool, Scraper]:
    pool = Pool(staleness=0.2)
    endpoint = Endpoint(replica.address, replica.url, engine=engine)
    pool.add(endpoint)
    return pool, Scraper(
        pool,
        session,
        endpoint,
        MetricsParser(ENGINES[engine]),
        settings,
        max_body_bytes=max_body_bytes,
    )


@contextlib.asynccontextmanager
async def running(scraper: Scraper) -> AsyncIterator[None]:
    task = asyncio.create_task(scraper.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_scrape_writes_metrics(replica: FakeReplica, session: aiohttp.ClientSession) -> None:
    pool, scraper = make_scraper(replica, session)
    assert scraper.url == f"{replica.url}/metrics"
    assert await scraper.scrape_once()
    metrics = pool.get(replica.address).metrics  # type: ignore[union-attr]
    assert (metrics.block_size, metrics.num_blocks, metrics.prefix_cache_queries) == (32, 128, 12.0)
    assert metrics.scraped_at > 0
    assert scraper.stats.scrapes == 1
    assert scraper.stats.failures == {}
    assert scraper.stats.last_duration > 0


@pytest.mark.parametrize(
    ("engine", "fixture", "path", "waiting"),
    [
        pytest.param("sglang", "sglang", "/metrics", 3.0, id="sglang"),
        pytest.param("trtllm-serve", "trtllm", "/prometheus/metrics", 2.0, id="trtllm"),
    ],
)
async def test_scrape_uses_the_engine_path(
    replica: FakeReplica,
    session: aiohttp.ClientSession,
    engine: str,
    fixture: str,
    path: str,
    waiting: float,
) -> None:
    replica.page = fixture_page(fixture)
    pool, scraper = make_scraper(replica, session, engine)
    assert await scraper.scrape_once()
    assert replica.requests[path] == 1
    assert pool.get(replica.address).metrics.waiting == waiting  # type: ignore[union-attr]


async def test_run_keeps_scraping_and_scraped_at_advances(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    pool, scraper = make_scraper(replica, session)
    state = pool.get(replica.address)
    assert state is not None
    async with running(scraper):
        await wait_until(lambda: scraper.stats.scrapes >= 1)
        first = state.metrics.scraped_at
        replica.page = replica.page.replace(
            'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0',
            'vllm:num_requests_waiting{engine="0",model_name="tiny"} 6.0',
        )
        await wait_until(lambda: state.metrics.waiting == 6.0)
        assert state.metrics.scraped_at > first
        assert state.is_fresh(state.metrics.scraped_at, pool.staleness)


@pytest.mark.parametrize(
    ("breakage", "reason"),
    [
        pytest.param("status", "http_status", id="http-503"),
        pytest.param("down", "connection", id="server-down"),
        pytest.param("slow", "timeout", id="timeout"),
        pytest.param("garbage", "no_signals", id="no-signals"),
    ],
)
async def test_failures_keep_old_metrics_and_count_the_reason(
    replica: FakeReplica, session: aiohttp.ClientSession, breakage: str, reason: str
) -> None:
    pool, scraper = make_scraper(replica, session)
    assert await scraper.scrape_once()
    state = pool.get(replica.address)
    assert state is not None
    before = state.metrics
    if breakage == "status":
        replica.metrics_status = 503
    elif breakage == "down":
        await replica.stop()
    elif breakage == "slow":
        replica.delay = 0.5  # > timeout 0.3
    else:
        replica.page = "<html>not prometheus</html>\n"
    assert not await scraper.scrape_once()
    assert not await scraper.scrape_once()
    assert state.metrics is before
    assert scraper.stats.failures == {reason: 2}
    assert scraper.stats.consecutive_failures == 2
    assert scraper.stats.scrapes == 1
    # the old metrics age: fresh now, stale once the staleness window has passed
    assert not state.is_fresh(before.scraped_at + pool.staleness + 0.01, pool.staleness)


async def test_recovery_resets_consecutive_failures(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    _, scraper = make_scraper(replica, session)
    replica.metrics_status = 500
    assert not await scraper.scrape_once()
    replica.metrics_status = 200
    assert await scraper.scrape_once()
    assert scraper.stats == ScrapeStats(
        scrapes=1,
        failures={"http_status": 1},
        consecutive_failures=0,
        last_duration=scraper.stats.last_duration,
        last_success=scraper.stats.last_success,
    )
    assert scraper.stats.attempts == 2


async def test_server_restart_on_the_same_port(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    _, scraper = make_scraper(replica, session)
    async with running(scraper):
        await wait_until(lambda: scraper.stats.scrapes >= 1)
        await replica.stop()
        await wait_until(lambda: scraper.stats.failures.get("connection", 0) >= 2)
        scrapes = scraper.stats.scrapes
        await replica.start()
        await wait_until(lambda: scraper.stats.scrapes > scrapes)
        assert scraper.stats.consecutive_failures == 0


async def test_body_over_the_limit(replica: FakeReplica, session: aiohttp.ClientSession) -> None:
    _, scraper = make_scraper(replica, session, max_body_bytes=1000)
    assert not await scraper.scrape_once()
    assert scraper.stats.failures == {"too_large": 1}


async def test_malformed_lines_are_counted(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    replica.page += "vllm:num_requests_running{broken 1\n"
    _, scraper = make_scraper(replica, session)
    assert await scraper.scrape_once()
    assert scraper.stats.malformed_lines == 1


class ExplodingParser(MetricsParser):
    __slots__ = ("calls",)

    def __init__(self) -> None:
        super().__init__(ENGINES["vllm"])
        self.calls = 0

    def parse(self, text: str, now: float) -> ParseResult:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("bug")
        return super().parse(text, now)


async def test_run_survives_unexpected_errors(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    pool = Pool()
    endpoint = Endpoint(replica.address, replica.url)
    pool.add(endpoint)
    scraper = Scraper(pool, session, endpoint, ExplodingParser(), FAST)
    async with running(scraper):
        await wait_until(lambda: scraper.stats.scrapes >= 1)
    assert scraper.stats.failures == {"error": 1}


async def test_scrape_of_a_removed_endpoint_is_harmless(
    replica: FakeReplica, session: aiohttp.ClientSession
) -> None:
    pool, scraper = make_scraper(replica, session)
    pool.remove(replica.address)
    assert await scraper.scrape_once()
    assert pool.get(replica.address) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"scrape_interval_s": 0.01}, "greater than or equal to 0.05", id="interval-too-small"
        ),
        pytest.param({"scrape_timeout_s": 0.0}, "greater than 0", id="zero-timeout"),
        pytest.param({"scrape_every": 1.0}, "Extra inputs are not permitted", id="unknown-key"),
    ],
)
def test_settings_validation(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ScrapeSettings.model_validate(kwargs)


def test_a_zero_body_limit_is_refused(replica: FakeReplica, session: aiohttp.ClientSession) -> None:
    with pytest.raises(ValueError, match="max_body_bytes must be positive"):
        make_scraper(replica, session, max_body_bytes=0)


@pytest.mark.parametrize(
    ("interval", "timeout", "effective"),
    [
        pytest.param(0.1, None, 1.0, id="default-floor"),  # max(1.0, 5 x 0.1)
        pytest.param(0.5, None, 2.5, id="five-intervals"),  # 5 x 0.5
        pytest.param(0.1, 0.2, 0.2, id="explicit"),
    ],
)
def test_effective_timeout(interval: float, timeout: float | None, effective: float) -> None:
    assert (
        ScrapeSettings(scrape_interval_s=interval, scrape_timeout_s=timeout).effective_timeout
        == effective
    )
