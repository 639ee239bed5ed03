"""Saturation detectors: is the pool too busy to take one more request now?

Both detectors have llm-d's type strings, parameters and defaults, and play
llm-d's two roles: `saturation()` is the flow controller's gate (the pool is
saturated at 1.0 or more) and `filter()` is a scheduling filter that drops
endpoints over their safety limit `threshold x (1 + headroom)`.

`utilization-detector` (closed loop, from scraped metrics)::

    endpoint score = max((waiting + credit) / queueDepthThreshold, kv_usage / kvCacheUtilThreshold)
    credit         = max(0, in_flight - (waiting + running)) + pending / fresh endpoints
    pool           = average endpoint score

`credit` is llm-d's scrape-lag compensation: requests the gateway has sent (or
released from its queue) that the last scrape cannot show yet. An endpoint whose
metrics are older than `metricsStalenessThreshold` scores 1.0 (`saturated`,
the default) or is left out (`ignore`). When every endpoint is stale the pool
reads 0.0 (fail open): servegate keeps serving through a scrape outage, where
llm-d's `saturated` policy halts dispatch (PROTOCOLS.md §4).

`concurrency-detector` (open loop, from the gateway's own in-flight counts)::

    requests: (sum in_flight + pending) / (endpoints x maxConcurrency)
    tokens:   (sum in_flight_tokens + pending_tokens) / (endpoints x maxTokenConcurrency)
    hybrid:   average over endpoints of max(request ratio, token ratio)

| parameter | default | detector |
|---|---|---|
| `queueDepthThreshold` | 5 | utilization |
| `kvCacheUtilThreshold` | 0.8 | utilization |
| `metricsStalenessThreshold` | `200ms` | utilization |
| `stalenessPolicy` | `saturated` | utilization |
| `concurrencyMode` | `requests` | concurrency |
| `maxConcurrency` | 100 | concurrency |
| `maxTokenConcurrency` | 1000000 | concurrency |
| `headroom` | 0.0 | both |

    - type: utilization-detector
      parameters: {queueDepthThreshold: 5, kvCacheUtilThreshold: 0.8, metricsStalenessThreshold: 200ms}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, Protocol, Self, runtime_checkable

from pydantic import Field, field_validator

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.factory import Parameters, PluginContext, decode_parameters
from servegate.scheduling.flowcontrol.units import parse_duration
from servegate.scheduling.framework import CycleState
from servegate.scheduling.request import LLMRequest

SATURATED = 1.0
"""Pool saturation at or above this means: hold requests back."""
_MAX_SCORE = 1e12
"""An endpoint score beyond this (or negative, or NaN) comes from impossible metrics."""


@runtime_checkable
class SaturationDetector(Protocol):
    type: ClassVar[str]
    name: str

    def saturation(
        self,
        endpoints: Sequence[EndpointState],
        now: float,
        pending: int = 0,
        pending_tokens: int = 0,
    ) -> float:
        """Pool saturation; `pending` = requests released but not yet counted in flight."""
        ...


class UtilizationParameters(Parameters):
    queue_depth_threshold: int = Field(5, alias="queueDepthThreshold", gt=0)
    kv_cache_util_threshold: float = Field(0.8, alias="kvCacheUtilThreshold", gt=0.0, le=1.0)
    metrics_staleness_threshold: str | float = Field("200ms", alias="metricsStalenessThreshold")
    staleness_policy: Literal["saturated", "ignore"] = Field("saturated", alias="stalenessPolicy")
    headroom: float = Field(0.0, ge=0.0)

    @field_validator("metrics_staleness_threshold")
    @classmethod
    def _duration(cls, value: str | float) -> str | float:
        if parse_duration(value) <= 0:
            raise ValueError("must be a positive duration such as '200ms'")
        return value

    @property
    def staleness_s(self) -> float:
        return parse_duration(self.metrics_staleness_threshold)


class UtilizationDetector:
    __slots__ = ("_kv_limit", "_q_limit", "ignore_stale", "kv_threshold", "name", "params",
                 "q_threshold", "staleness")  # fmt: skip
    type: ClassVar[str] = "utilization-detector"

    def __init__(
        self, name: str | None = None, params: UtilizationParameters | None = None
    ) -> None:
        self.name = name or self.type
        self.params = params or UtilizationParameters()
        p = self.params
        self.q_threshold = float(p.queue_depth_threshold)
        self.kv_threshold = p.kv_cache_util_threshold
        self.staleness = p.staleness_s
        self.ignore_stale = p.staleness_policy == "ignore"
        self._q_limit = self.q_threshold * (1.0 + p.headroom)
        self._kv_limit = self.kv_threshold * (1.0 + p.headroom)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        return cls(name, decode_parameters(UtilizationParameters, cls.type, name, parameters))

    def _fresh(self, state: EndpointState, now: float) -> bool:
        scraped = state.metrics.scraped_at
        return scraped > 0.0 and now - scraped <= self.staleness

    def saturation(
        self,
        endpoints: Sequence[EndpointState],
        now: float,
        pending: int = 0,
        pending_tokens: int = 0,
    ) -> float:
        if not endpoints:
            return SATURATED
        fresh = [s for s in endpoints if self._fresh(s, now)]
        if not fresh:
            return 0.0
        spread = pending / len(fresh)
        total = 0.0
        for state in fresh:
            m = state.metrics
            credit = max(0.0, state.in_flight_requests - (m.waiting + m.running)) + spread
            score = max((m.waiting + credit) / self.q_threshold, m.kv_usage / self.kv_threshold)
            # The pool clamps metrics into range; this guards states built elsewhere: an
            # impossible value counts as saturated, never as a NaN/inf that disables the gate.
            total += score if 0.0 <= score <= _MAX_SCORE else SATURATED
        if self.ignore_stale:
            return total / len(fresh)
        return (total + SATURATED * (len(endpoints) - len(fresh))) / len(endpoints)

    def stale_count(self, endpoints: Sequence[EndpointState], now: float) -> int:
        return sum(1 for s in endpoints if not self._fresh(s, now))

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        now = cycle.now
        kept = [
            s
            for s in endpoints
            if self._fresh(s, now)
            and s.metrics.waiting < self._q_limit
            and s.metrics.kv_usage < self._kv_limit
        ]
        return kept if kept else list(endpoints)

    def __repr__(self) -> str:
        return f"UtilizationDetector(name={self.name!r}, params={self.params!r})"


class ConcurrencyParameters(Parameters):
    concurrency_mode: Literal["requests", "tokens", "hybrid"] = Field(
        "requests", alias="concurrencyMode"
    )
    max_concurrency: int = Field(100, alias="maxConcurrency", gt=0)
    max_token_concurrency: int = Field(1_000_000, alias="maxTokenConcurrency", gt=0)
    headroom: float = Field(0.0, ge=0.0)


class ConcurrencyDetector:
    __slots__ = (
        "_req_limit",
        "_tok_limit",
        "max_requests",
        "max_tokens",
        "mode",
        "name",
        "params",
    )  # fmt: skip
    type: ClassVar[str] = "concurrency-detector"

    def __init__(
        self, name: str | None = None, params: ConcurrencyParameters | None = None
    ) -> None:
        self.name = name or self.type
        self.params = params or ConcurrencyParameters()
        p = self.params
        self.mode = p.concurrency_mode
        self.max_requests = p.max_concurrency
        self.max_tokens = p.max_token_concurrency
        self._req_limit = int(p.max_concurrency * (1.0 + p.headroom))
        self._tok_limit = int(p.max_token_concurrency * (1.0 + p.headroom))

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        return cls(name, decode_parameters(ConcurrencyParameters, cls.type, name, parameters))

    def saturation(
        self,
        endpoints: Sequence[EndpointState],
        now: float,
        pending: int = 0,
        pending_tokens: int = 0,
    ) -> float:
        n = len(endpoints)
        if n == 0:
            return SATURATED
        if self.mode == "requests":
            inflight = sum(s.in_flight_requests for s in endpoints) + pending
            return inflight / (n * self.max_requests)
        if self.mode == "tokens":
            tokens = sum(s.in_flight_tokens for s in endpoints) + pending_tokens
            return tokens / (n * self.max_tokens)
        req_spread = pending / n
        tok_spread = pending_tokens / n
        total = 0.0
        for s in endpoints:
            total += max(
                (s.in_flight_requests + req_spread) / self.max_requests,
                (s.in_flight_tokens + tok_spread) / self.max_tokens,
            )
        return total / n

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        incoming = request.prompt_tokens + (request.max_tokens or 0)
        mode = self.mode
        out = []
        for s in endpoints:
            if mode != "tokens" and s.in_flight_requests >= self._req_limit:
                continue
            if mode != "requests" and s.in_flight_tokens + incoming > self._tok_limit:
                continue
            out.append(s)
        return out

    def __repr__(self) -> str:
        return f"ConcurrencyDetector(name={self.name!r}, params={self.params!r})"
