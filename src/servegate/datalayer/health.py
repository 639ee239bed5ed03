"""Active health checks: readiness probes with thresholds, and the replica's model list.

Each endpoint is probed on its engine's health path every `interval_s` seconds. An
unhealthy endpoint becomes healthy after `success_threshold` consecutive good
probes; a healthy one becomes unhealthy after `failure_threshold` consecutive bad
ones, so one lost probe does not take a replica out. Any 2xx answer is good
(Triton answers 400 while not ready).

Engines that serve OpenAI's API also list what they serve at `/v1/models`: the
base model and each LoRA adapter, whose `parent` is the base model. The list is
read on the first good probe, before the endpoint turns healthy (so it never
becomes a candidate that serves nothing), and again every `models_refresh_every` good
probes, because adapters are loaded and unloaded at run time.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import orjson
from pydantic import BaseModel, ConfigDict, Field

from servegate.datalayer.scraper import MIN_INTERVAL, FetchError, read_limited
from servegate.engines.spec import EngineSpec
from servegate.pool.endpoint import Endpoint
from servegate.pool.pool import ModelEntry, Pool

log = logging.getLogger(__name__)

TIMEOUT = "timeout"
CONNECTION = "connection"
HTTP_STATUS = "http_status"
INVALID = "invalid"
ERROR = "error"

_HEALTH_BODY_LIMIT = 64 * 1024
_MODELS_BODY_LIMIT = 4 * 1024 * 1024
_ERROR_LOG_EVERY = 60.0


class HealthSettings(BaseModel):
    """Active health checking, defined once: `pool.health` in the config is this model
    (config.py imports it) and the checker reads it as it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    interval_s: float = Field(1.0, ge=MIN_INTERVAL)
    """Seconds between probe starts (at least 0.05)."""
    timeout_s: float = Field(1.0, gt=0)
    """Seconds a probe may take before it counts as failed."""
    failure_threshold: int = Field(2, ge=1)
    """Consecutive failed probes that make a healthy endpoint unhealthy."""
    success_threshold: int = Field(1, ge=1)
    """Consecutive good probes that make an unhealthy endpoint healthy."""
    models_refresh_every: int = Field(10, ge=1)
    """Re-read the replica's `/v1/models` after this many good probes (LoRA adapters come
    and go)."""


@dataclass(slots=True)
class HealthStats:
    """One endpoint's probe counters, for the gateway's own `/metrics`."""

    probes: int = 0
    """Probes sent, good or bad."""
    failures: dict[str, int] = field(default_factory=dict)
    """Failed probes by reason: timeout, connection, http_status, error."""
    healthy: bool = False
    """The verdict after thresholds, as written to the pool."""
    transitions: int = 0
    """Times the verdict changed."""
    consecutive_successes: int = 0
    consecutive_failures: int = 0
    last_duration: float = 0.0
    """Seconds the last probe took."""
    model_refreshes: int = 0
    """Successful reads of `/v1/models`."""
    model_failures: dict[str, int] = field(default_factory=dict)
    """Failed reads of `/v1/models` by reason: timeout, connection, http_status, invalid."""


class HealthChecker:
    """Probes one endpoint; `run()` is its task."""

    def __init__(
        self,
        pool: Pool,
        session: aiohttp.ClientSession,
        endpoint: Endpoint,
        spec: EngineSpec,
        settings: HealthSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.session = session
        self.endpoint = endpoint
        self.spec = spec
        self.settings = settings or HealthSettings()
        self.url = spec.health_url(endpoint)
        self.models_url = spec.models_url(endpoint) if spec.openai_models else None
        self.stats = HealthStats()
        self.models: tuple[ModelEntry, ...] | None = None
        """The last model list read from the replica; None = not read yet."""
        self._clock = clock
        self._timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
        self._probes_since_models = 0
        self._last_error_log = -_ERROR_LOG_EVERY

    @property
    def healthy(self) -> bool:
        return self.stats.healthy

    async def probe_once(self) -> bool:
        """One probe, then the thresholds; True when the probe itself was good."""
        stats = self.stats
        stats.probes += 1
        start = self._clock()
        try:
            await self._get(self.url, _HEALTH_BODY_LIMIT)
        except FetchError as failure:
            stats.failures[failure.reason] = stats.failures.get(failure.reason, 0) + 1
            self._record(False, str(failure))
            return False
        finally:
            stats.last_duration = self._clock() - start
        if self.models_url is not None and self._models_due():
            await self.refresh_models()
        self._record(True, "")
        return True

    async def refresh_models(self) -> bool:
        """Read `/v1/models` into the pool; True on success."""
        if self.models_url is None:
            return False
        self._probes_since_models = 0
        try:
            body = await self._get(self.models_url, _MODELS_BODY_LIMIT)
            models = parse_models(body)
        except FetchError as failure:
            failures = self.stats.model_failures
            failures[failure.reason] = failures.get(failure.reason, 0) + 1
            log.debug("reading %s failed (%s)", self.models_url, failure)
            return False
        self.stats.model_refreshes += 1
        if models != self.models:
            self.models = models
            self.pool.set_served_models(self.endpoint.address, models)
            log.info(
                "%s serves %s", self.endpoint.address, ", ".join(m.id for m in models) or "nothing"
            )
        return True

    async def run(self) -> None:
        """Probe every `interval` until cancelled; nothing but cancellation ends it."""
        loop = asyncio.get_running_loop()
        interval = self.settings.interval_s
        await asyncio.sleep(random.uniform(0.0, min(interval, 0.1)))
        deadline = loop.time()
        while True:
            try:
                await self.probe_once()
            except Exception:
                self.stats.failures[ERROR] = self.stats.failures.get(ERROR, 0) + 1
                self._record(False, "unexpected error")
                now = loop.time()
                if now - self._last_error_log >= _ERROR_LOG_EVERY:
                    self._last_error_log = now
                    log.exception("health probe of %s failed unexpectedly", self.url)
            deadline += interval
            now = loop.time()
            if deadline < now:
                deadline = now
            await asyncio.sleep(deadline - now)

    def _models_due(self) -> bool:
        self._probes_since_models += 1
        return (
            self.models is None or self._probes_since_models >= self.settings.models_refresh_every
        )

    def _record(self, good: bool, detail: str) -> None:
        stats = self.stats
        settings = self.settings
        if good:
            stats.consecutive_successes += 1
            stats.consecutive_failures = 0
            if not stats.healthy and stats.consecutive_successes >= settings.success_threshold:
                self._set(True, "healthy")
        else:
            stats.consecutive_failures += 1
            stats.consecutive_successes = 0
            if stats.healthy and stats.consecutive_failures >= settings.failure_threshold:
                self._set(False, f"unhealthy: {detail}")

    def _set(self, healthy: bool, why: str) -> None:
        self.stats.healthy = healthy
        self.stats.transitions += 1
        self.pool.set_health(self.endpoint.address, healthy)
        log.log(logging.INFO if healthy else logging.WARNING, "%s is %s", self.url, why)

    async def _get(self, url: str, limit: int) -> bytes:
        try:
            async with self.session.get(
                url, timeout=self._timeout, allow_redirects=False
            ) as response:
                if not 200 <= response.status < 300:
                    raise FetchError(HTTP_STATUS, f"HTTP {response.status}")
                return await read_limited(response, limit)
        except TimeoutError as exc:
            raise FetchError(TIMEOUT, f"no answer in {self._timeout.total} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise FetchError(CONNECTION, f"{type(exc).__name__}: {exc}") from exc


def parse_models(body: bytes) -> tuple[ModelEntry, ...]:
    """vLLM's `/v1/models`: `{"data": [{"id", "parent", ...}]}`; adapters have a parent."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise FetchError(INVALID, f"not JSON: {exc}") from exc
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        raise FetchError(INVALID, "no 'data' list")
    entries: dict[str, ModelEntry] = {}
    for item in data:
        if not isinstance(item, dict):
            continue
        model_id = item.get("id")
        if not isinstance(model_id, str) or not model_id:
            continue
        parent = item.get("parent")
        entries[model_id] = ModelEntry(
            model_id, parent if isinstance(parent, str) and parent and parent != model_id else None
        )
    return tuple(entries.values())
