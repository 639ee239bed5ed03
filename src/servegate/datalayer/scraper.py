"""Periodic `/metrics` scrapes that keep each endpoint's `EndpointMetrics` fresh.

One task per endpoint GETs the engine's metrics URL every `scrape_interval_s` seconds over
the shared `aiohttp.ClientSession`, parses the families the engine spec needs and
writes the result to the pool with `scraped_at = time.monotonic()`. A failed
scrape writes nothing: the previous metrics stay and age, and the scheduler's
staleness policy decides what old metrics mean. Failures are counted by reason
and logged when an endpoint starts or stops failing, not on every attempt.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

from servegate.datalayer.metrics_parser import MetricsParser, ParseResult
from servegate.pool.endpoint import Endpoint
from servegate.pool.pool import Pool

log = logging.getLogger(__name__)

MIN_INTERVAL = 0.05
CORE_SIGNALS = ("waiting", "running", "kv_usage")

TIMEOUT = "timeout"
CONNECTION = "connection"
HTTP_STATUS = "http_status"
TOO_LARGE = "too_large"
NO_SIGNALS = "no_signals"
OUT_OF_RANGE = "out_of_range"
ERROR = "error"
REASONS = (TIMEOUT, CONNECTION, HTTP_STATUS, TOO_LARGE, NO_SIGNALS, OUT_OF_RANGE, ERROR)
"""Why a scrape failed: `no_signals` = the page had none of waiting/running/KV usage
(e.g. trtllm-serve without `return_perf_metrics`); `out_of_range` = a value no engine can
report (a negative or absurdly large queue, KV usage outside [0, 1]: `servegate.pool.sanity`),
so the page is not believed; `error` = a bug, logged with a traceback."""

_ERROR_LOG_EVERY = 60.0
MAX_BODY_BYTES = 16 * 1024 * 1024
"""A larger metrics page is a failure (`too_large`)."""


class ScrapeSettings(BaseModel):
    """Metrics scraping, defined once: the pool's `scrape_interval_s` and `scrape_timeout_s`
    in the config are these fields (config.py's `PoolSettings` extends this model, so the
    YAML keeps them flat on the pool) and the scraper reads them as they are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scrape_interval_s: float = Field(0.1, ge=MIN_INTERVAL)
    """Seconds between scrape starts, per endpoint (at least 0.05)."""
    scrape_timeout_s: float | None = Field(None, gt=0)
    """Seconds one scrape may take; None = max(1 s, 5 x the interval). Real vLLM on a busy
    CPU answers /metrics in over 0.5 s while it streams, so a tighter default loses scrapes."""

    @property
    def effective_timeout(self) -> float:
        if self.scrape_timeout_s is not None:
            return self.scrape_timeout_s
        return max(1.0, 5 * self.scrape_interval_s)


@dataclass(slots=True)
class ScrapeStats:
    """One endpoint's scrape counters, for the gateway's own `/metrics`."""

    scrapes: int = 0
    """Successful scrapes."""
    failures: dict[str, int] = field(default_factory=dict)
    """Failed scrapes by reason (see `REASONS`)."""
    malformed_lines: int = 0
    """Unreadable lines of needed families, summed over scrapes."""
    consecutive_failures: int = 0
    last_duration: float = 0.0
    """Seconds the last attempt took, request and parse."""
    last_success: float = 0.0
    """`time.monotonic()` of the last successful scrape; 0 = never."""

    @property
    def attempts(self) -> int:
        return self.scrapes + sum(self.failures.values())


class FetchError(Exception):
    """A GET that produced no usable body; `reason` is one of the counted failure reasons."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Scraper:
    """Scrapes one endpoint; `run()` is its task."""

    def __init__(
        self,
        pool: Pool,
        session: aiohttp.ClientSession,
        endpoint: Endpoint,
        parser: MetricsParser,
        settings: ScrapeSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
        self.pool = pool
        self.session = session
        self.endpoint = endpoint
        self.parser = parser
        self.settings = settings or ScrapeSettings()
        self.max_body_bytes = max_body_bytes
        self.url = parser.spec.metrics_url(endpoint)
        self.stats = ScrapeStats()
        self._clock = clock
        self._timeout = aiohttp.ClientTimeout(total=self.settings.effective_timeout)
        self._core = tuple(s for s in CORE_SIGNALS if parser.spec.signal(s))
        self._last_error_log = -_ERROR_LOG_EVERY

    async def scrape_once(self) -> bool:
        """One scrape; True when fresh metrics reached the pool."""
        start = self._clock()
        try:
            result = await self._fetch_and_parse()
        except FetchError as failure:
            self._failed(failure.reason, str(failure))
            return False
        finally:
            self.stats.last_duration = self._clock() - start
        self.stats.malformed_lines += result.malformed
        if self._core and all(signal in result.missing for signal in self._core):
            self._failed(NO_SIGNALS, f"none of {', '.join(self._core)} on the page")
            return False
        if result.out_of_range:
            self._failed(OUT_OF_RANGE, f"impossible {', '.join(result.out_of_range)}")
            return False
        self.pool.set_metrics(self.endpoint.address, result.metrics)
        if self.stats.consecutive_failures:
            log.info(
                "metrics from %s again after %d failed scrapes",
                self.url,
                self.stats.consecutive_failures,
            )
        self.stats.scrapes += 1
        self.stats.consecutive_failures = 0
        self.stats.last_success = result.metrics.scraped_at
        return True

    async def run(self) -> None:
        """Scrape every `scrape_interval_s` until cancelled; nothing but cancellation ends it."""
        loop = asyncio.get_running_loop()
        interval = self.settings.scrape_interval_s
        await asyncio.sleep(random.uniform(0.0, interval))
        deadline = loop.time()
        while True:
            try:
                await self.scrape_once()
            except Exception:
                self._failed(ERROR, "unexpected error")
                now = loop.time()
                if now - self._last_error_log >= _ERROR_LOG_EVERY:
                    self._last_error_log = now
                    log.exception("scraping %s failed unexpectedly", self.url)
            deadline += interval
            now = loop.time()
            if deadline < now:
                deadline = now
            await asyncio.sleep(deadline - now)

    async def _fetch_and_parse(self) -> ParseResult:
        try:
            async with self.session.get(
                self.url,
                timeout=self._timeout,
                headers={"Accept-Encoding": "identity"},
                allow_redirects=False,
            ) as response:
                if response.status != 200:
                    raise FetchError(HTTP_STATUS, f"HTTP {response.status}")
                body = await read_limited(response, self.max_body_bytes)
        except TimeoutError as exc:
            raise FetchError(TIMEOUT, f"no answer in {self._timeout.total} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise FetchError(CONNECTION, f"{type(exc).__name__}: {exc}") from exc
        text = body.decode("utf-8", "replace")
        return self.parser.parse(text, self._clock())

    def _failed(self, reason: str, detail: str) -> None:
        stats = self.stats
        stats.failures[reason] = stats.failures.get(reason, 0) + 1
        stats.consecutive_failures += 1
        if stats.consecutive_failures == 1 and reason != ERROR:
            log.warning("scraping %s failed (%s); keeping the last metrics", self.url, detail)
        else:
            log.debug("scraping %s failed (%s)", self.url, detail)


async def read_limited(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, or `FetchError(too_large)` as soon as it exceeds `limit` bytes."""
    length = response.content_length
    if length is not None and length > limit:
        raise FetchError(TOO_LARGE, f"Content-Length {length} > {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise FetchError(TOO_LARGE, f"body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
