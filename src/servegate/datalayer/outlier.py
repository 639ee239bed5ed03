"""Passive health: eject an endpoint that keeps failing real requests, never all of them.

The proxy reports every attempt's result. `consecutive_failures` failures in a
row (connect errors, timeouts, 5xx answers, streams cut mid-way) eject the
endpoint for `base_ejection_time_s x times ejected` (capped at
`max_ejection_time_s`), the way Envoy's outlier detection does. Ejection is
refused when it would take more than `max_ejection_percent` of the endpoints
that take traffic out of rotation, and always when it would leave none: a
circuit breaker that opens for every endpoint at once turns a partial failure
into a total one. The multiplier decays once the endpoint has stayed in
rotation for as long as its last ejection lasted.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from servegate.pool.endpoint import EndpointState
from servegate.pool.pool import Pool

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EndpointRecord:
    consecutive_failures: int = 0
    ejections: int = 0
    """Times ejected in a row; sets the length of the next ejection."""
    ejected_total: int = 0
    refused_total: int = 0
    """Ejections refused by the max-ejection-percent guard."""
    last_ejection_s: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)


class OutlierDetectionSettings(BaseModel):
    """Passive health, defined once: the config's `outlier_detection` is this model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    consecutive_failures: int = Field(5, ge=1)
    """Failed attempts in a row (connect, timeout, 5xx, cut stream) that eject an endpoint."""
    base_ejection_time_s: float = Field(30.0, gt=0)
    """First ejection's length; the n-th in a row lasts n times this."""
    max_ejection_time_s: float = Field(300.0, gt=0)
    max_ejection_percent: float = Field(50.0, ge=0, le=100)
    """At most this share of serving endpoints ejected at once, and never all of them."""


class OutlierDetector:
    def __init__(
        self,
        pool: Pool,
        settings: OutlierDetectionSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_eject: Callable[[EndpointState, float], None] | None = None,
    ) -> None:
        self.pool = pool
        self.settings = settings or OutlierDetectionSettings()
        self._clock = clock
        self._on_eject = on_eject
        self.records: dict[str, EndpointRecord] = {}

    def record(self, address: str) -> EndpointRecord:
        rec = self.records.get(address)
        if rec is None:
            rec = self.records[address] = EndpointRecord()
        return rec

    def success(self, state: EndpointState) -> None:
        rec = self.records.get(state.address)
        if rec is None:
            return
        rec.consecutive_failures = 0
        if rec.ejections:
            now = self._clock()
            if now >= state.ejected_until + rec.last_ejection_s:
                rec.ejections = 0

    def failure(self, state: EndpointState, kind: str) -> bool:
        """Count one failed attempt; True when it ejected the endpoint."""
        rec = self.record(state.address)
        rec.failures[kind] = rec.failures.get(kind, 0) + 1
        rec.consecutive_failures += 1
        settings = self.settings
        if not settings.enabled or rec.consecutive_failures < settings.consecutive_failures:
            return False
        now = self._clock()
        if state.ejected_until > now:
            return False
        if not self._may_eject(now):
            rec.refused_total += 1
            return False
        rec.ejections += 1
        rec.ejected_total += 1
        rec.consecutive_failures = 0
        duration = min(settings.base_ejection_time_s * rec.ejections, settings.max_ejection_time_s)
        rec.last_ejection_s = duration
        self.pool.eject(state.address, now + duration)
        log.warning(
            "ejected %s for %.1f s after %d consecutive failures (last: %s)",
            state.address,
            duration,
            settings.consecutive_failures,
            kind,
        )
        if self._on_eject is not None:
            self._on_eject(state, duration)
        return True

    def max_ejected(self, serving: int) -> int:
        """How many of `serving` endpoints may be ejected at once: at most all but one."""
        if serving < 2:
            return 0
        allowed = math.floor(serving * self.settings.max_ejection_percent / 100.0)
        return min(serving - 1, max(1, allowed))

    def _may_eject(self, now: float) -> bool:
        serving = [s for s in self.pool if s.healthy and not s.draining]
        ejected = sum(1 for s in serving if s.ejected_until > now)
        return ejected + 1 <= self.max_ejected(len(serving))

    def ejected(self, now: float | None = None) -> list[str]:
        t = self._clock() if now is None else now
        return sorted(s.address for s in self.pool if s.ejected_until > t)
