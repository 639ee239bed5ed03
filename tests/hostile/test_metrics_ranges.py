"""Hostile replica metrics: impossible values never win routing or break flow control.

Reproduces issue 18 item 6: a replica publishing a queue and KV usage of -1e308
won every request and made the utilization detector's pool saturation
non-finite (which disables flow control, since every comparison with NaN is false).
"""

from __future__ import annotations

import math
import random
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from servegate.datalayer.metrics_parser import MetricsParser
from servegate.datalayer.scraper import OUT_OF_RANGE, Scraper, ScrapeSettings
from servegate.engines import builtin_engines
from servegate.pool.endpoint import Endpoint, EndpointMetrics
from servegate.pool.pool import Pool
from servegate.scaleout.codec import METRICS, EndpointReport, Message, decode, encode
from servegate.scaleout.metrics import apply
from servegate.scheduling.config import DEFAULT_PICKER_CONFIG, load_picker_config
from servegate.scheduling.factory import PluginContext
from servegate.scheduling.flowcontrol.saturation import (
    ConcurrencyDetector,
    UtilizationDetector,
)
from servegate.scheduling.framework import CycleState
from servegate.scheduling.request import LLMRequest, RequestKind
from servegate.testing.endpoints import endpoint_state

VLLM = builtin_engines()["vllm"]
SETTINGS = ScrapeSettings(scrape_interval_s=0.05, scrape_timeout_s=1.0)


def page(waiting: str, running: str, kv: str) -> str:
    return (
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}\n'
    )


HONEST = page("2", "3", "0.3")


class Replicas:
    """Metrics pages on 127.0.0.1, one port per replica."""

    def __init__(self) -> None:
        self.pages: dict[int, str] = {}
        self._runners: list[web.AppRunner] = []

    async def add(self, text: str) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        self.pages[port] = text

        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(text=self.pages[port], content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self._runners.append(runner)
        return f"127.0.0.1:{port}"

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()


@pytest.fixture
async def replicas() -> AsyncIterator[Replicas]:
    r = Replicas()
    yield r
    await r.close()


@pytest.mark.parametrize(
    ("values", "bad"),
    [
        (("-1e308", "0", "0.1"), ("waiting",)),
        (("0", "-1e308", "0.1"), ("running",)),
        (("0", "0", "-1e308"), ("kv_usage",)),
        (("1e308", "1e308", "1e308"), ("waiting", "running", "kv_usage")),
        (("-1", "0", "5"), ("waiting", "kv_usage")),
        (("0", "0", "1.000001"), ()),
    ],
)
def test_the_parser_names_impossible_values_and_clamps_them(
    values: tuple[str, str, str], bad: tuple[str, ...]
) -> None:
    result = MetricsParser(VLLM).parse(page(*values), 1.0)
    assert result.out_of_range == bad
    m = result.metrics
    assert 0.0 <= m.waiting <= 1e6 and 0.0 <= m.running <= 1e6 and 0.0 <= m.kv_usage <= 1.0


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_non_finite_values_are_not_read(value: str) -> None:
    result = MetricsParser(VLLM).parse(page(value, value, value), 1.0)
    assert set(result.missing) >= {"waiting", "running", "kv_usage"}
    assert (result.metrics.waiting, result.metrics.kv_usage) == (0.0, 0.0)


FRESH_FILTER_PROFILE = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"type": "fresh-metrics-filter"},
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "max-score-picker"},
    ],
}


@pytest.mark.parametrize(
    "profile",
    [
        pytest.param(FRESH_FILTER_PROFILE, id="fresh-metrics-filter"),
        pytest.param(DEFAULT_PICKER_CONFIG, id="default-profile"),
    ],
)
async def test_a_replica_publishing_minus_1e308_wins_no_request(
    replicas: Replicas, profile: Any
) -> None:
    pool = Pool(staleness=2.0)
    honest = [await replicas.add(HONEST) for _ in range(2)]
    liar = await replicas.add(page("-1e308", "-1e308", "-1e308"))
    scrapers = []
    async with aiohttp.ClientSession() as session:
        for address in [*honest, liar]:
            endpoint = Endpoint(address, f"http://{address}")
            pool.add(endpoint)
            pool.set_health(address, True)
            scrapers.append(Scraper(pool, session, endpoint, MetricsParser(VLLM), SETTINGS))
        results = [await s.scrape_once() for s in scrapers]
    assert results == [True, True, False]
    assert scrapers[2].stats.failures == {OUT_OF_RANGE: 1}
    assert pool.get(liar).metrics.scraped_at == 0.0  # type: ignore[union-attr]

    scheduler = load_picker_config(profile, PluginContext(staleness_s=2.0))
    now = max(s.metrics.scraped_at for s in pool)
    wins = 0
    for i in range(30):
        request = LLMRequest(f"r{i}", RequestKind.CHAT, "m", "m", "m", prompt="hello")
        decision = scheduler.schedule(request, list(pool), CycleState(now, random.Random(i)))
        wins += decision.endpoint.address == liar
    assert wins == 0


def test_pool_saturation_stays_finite_whatever_a_replica_reports() -> None:
    pool = Pool()
    for i, (w, r, kv) in enumerate([(-1e308, -1e308, -1e308), (1e308, 1e308, 1e308), (1, 1, 0.5)]):
        address = f"127.0.0.1:{8000 + i}"
        pool.add(Endpoint(address, f"http://{address}"))
        pool.set_metrics(address, EndpointMetrics(waiting=w, running=r, kv_usage=kv, scraped_at=1))
        pool.set_peer_in_flight(address, (1 << 64) - 1, (1 << 64) - 1)
    for detector in (UtilizationDetector(), ConcurrencyDetector()):
        value = detector.saturation(list(pool), 1.0, pending=3)
        assert math.isfinite(value) and value >= 0.0, (detector, value)


@pytest.mark.parametrize("value", [-1e308, 1e308, math.nan, math.inf])
def test_the_detector_guards_states_that_bypassed_the_pool(value: float) -> None:
    state = endpoint_state(waiting=value, running=value, kv_usage=value, scraped_at=1.0)
    saturation = UtilizationDetector().saturation([state, endpoint_state(scraped_at=1.0)], 1.0)
    assert math.isfinite(saturation) and saturation >= 0.5


def test_a_bus_report_with_impossible_metrics_is_clamped() -> None:
    pool = Pool()
    pool.add(Endpoint("127.0.0.1:8000", "http://127.0.0.1:8000"))
    metrics = EndpointMetrics(waiting=-1e308, running=1e300, kv_usage=-5.0, scraped_at=1.0)
    report = EndpointReport("127.0.0.1:8000", True, metrics, ())
    msg = decode(encode(Message(METRICS, "r/0", pool.name, (report,))))
    assert msg.body is not None
    apply(pool, msg.body[0])  # type: ignore[arg-type]
    m = pool.get("127.0.0.1:8000").metrics  # type: ignore[union-attr]
    assert (m.waiting, m.running, m.kv_usage) == (0.0, 1e6, 0.0)
