"""Scorers: one number per endpoint, higher is better.

Each scorer is a pure function of the request and the endpoints' state; the
framework clamps what it returns to [0, 1] (NaN counts as 0) and applies the
weight. Type strings, parameter names and defaults are llm-d's / the Gateway API
Inference Extension's; `docs/plugins.md` gives each formula with an example.

Stale metrics: like llm-d, scorers read `EndpointMetrics` as they are, whatever
their age. Dropping endpoints whose metrics are stale is a filter's job
(`fresh-metrics-filter`); the router's own counters (`active-request-scorer`,
`token-load-scorer`) are never stale. Metrics never read (no scrape accepted yet,
`scraped_at == 0`: a replica just added, or one whose every page was refused as
impossible, `pool/sanity.py`) are unknown, not idle: the metric scorers give such an
endpoint NaN, which the framework scores 0, so lying about load cannot attract traffic.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pydantic import Field, field_validator

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.factory import (
    ParameterlessPlugin,
    Parameters,
    PluginContext,
    decode_parameters,
)
from servegate.scheduling.framework import CycleState
from servegate.scheduling.request import LLMRequest

NAN = float("nan")


# A scorer reads `m.x if m.scraped_at > 0.0 else NAN` (NaN while no scrape of the endpoint
# was ever accepted) in one comprehension, `for s in endpoints for m in [s.metrics]` (the
# inner loop over one item is compiled to an assignment: no second list, no call).


LEGACY_KV_CACHE_TYPE = "kv-cache-scorer"
"""The Gateway API Inference Extension's older name of `kv-cache-utilization-scorer`."""


def inverted_min_max(values: list[float]) -> list[float]:
    """`(max - v)/(max - min)` for each value: the smallest gets 1, the largest 0.

    All equal → 1 for everyone. A NaN value is left out of min/max and scores
    NaN (the framework turns that into 0: unknown load is treated as worst).
    """
    if not values:
        return []
    lo = min(values)
    hi = max(values)
    if lo != lo or hi != hi:  # a leading NaN poisons min/max
        finite = [v for v in values if v == v]
        if not finite:
            return [1.0] * len(values)
        lo = min(finite)
        hi = max(finite)
    if hi == lo:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - v) / span for v in values]


class QueueScorer(ParameterlessPlugin):
    """Fewer waiting requests (`metrics.waiting`) is better, min-max normalised over candidates."""

    __slots__ = ()
    type: ClassVar[str] = "queue-scorer"

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[float]:
        return inverted_min_max(
            [m.waiting if m.scraped_at > 0.0 else NAN for s in endpoints for m in [s.metrics]]
        )


class RunningRequestsSizeScorer(ParameterlessPlugin):
    """Fewer running requests (`metrics.running`) is better, min-max normalised over candidates."""

    __slots__ = ()
    type: ClassVar[str] = "running-requests-size-scorer"

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[float]:
        return inverted_min_max(
            [m.running if m.scraped_at > 0.0 else NAN for s in endpoints for m in [s.metrics]]
        )


class KVCacheUtilizationScorer(ParameterlessPlugin):
    """More free KV cache is better: `1 - metrics.kv_usage`."""

    __slots__ = ()
    type: ClassVar[str] = "kv-cache-utilization-scorer"

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[float]:
        return [
            1.0 - m.kv_usage if m.scraped_at > 0.0 else NAN for s in endpoints for m in [s.metrics]
        ]


_GO_DURATION = re.compile(r"^(?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+$")


class ActiveRequestParameters(Parameters):
    idle_threshold: int = Field(0, alias="idleThreshold", ge=0)
    max_busy_score: float = Field(1.0, alias="maxBusyScore", ge=0.0, le=1.0)
    request_timeout: str | None = Field(None, alias="requestTimeout")

    @field_validator("request_timeout")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        if value is not None and not _GO_DURATION.match(value):
            raise ValueError("must be a duration such as '30s', '2m' or '1h'")
        return value


class ActiveRequestScorer:
    """Fewer requests in flight from this router (`in_flight_requests`) is better.

    llm-d's semantics: `count ≤ idleThreshold` → 1; otherwise
    `(maxCount - count)/maxCount · maxBusyScore`, `maxCount` over the candidates.
    The counts are the pool's, maintained by the gateway at dispatch and
    completion, so `requestTimeout` (a leak guard for llm-d's own counter) is
    accepted for compatibility and has nothing to do.
    """

    __slots__ = ("idle_threshold", "max_busy_score", "name")
    type: ClassVar[str] = "active-request-scorer"

    def __init__(
        self, name: str | None = None, idle_threshold: int = 0, max_busy_score: float = 1.0
    ) -> None:
        self.name = name or self.type
        self.idle_threshold = idle_threshold
        self.max_busy_score = max_busy_score

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(ActiveRequestParameters, cls.type, name, parameters)
        return cls(name, p.idle_threshold, p.max_busy_score)

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[float]:
        counts = [s.in_flight_requests for s in endpoints]
        most = max(counts) if counts else 0
        idle = self.idle_threshold
        if most <= idle:
            return [1.0] * len(counts)
        if idle == 0 and self.max_busy_score == 1.0:  # the defaults: count 0 gives 1 by itself
            return [(most - c) / most for c in counts]
        scale = self.max_busy_score / most
        return [1.0 if c <= idle else (most - c) * scale for c in counts]


class LoadAwareParameters(Parameters):
    threshold: int = Field(128, gt=0)


class LoadAwareScorer:
    """llm-d's load-aware scorer: an empty queue scores 0.5, a full one (≥ threshold) 0.

    `q = 0 → 0.5`, else `0.5 · (1 - min(q, threshold)/threshold)`.
    """

    __slots__ = ("name", "threshold")
    type: ClassVar[str] = "load-aware-scorer"

    def __init__(self, name: str | None = None, threshold: int = 128) -> None:
        self.name = name or self.type
        self.threshold = float(threshold)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(LoadAwareParameters, cls.type, name, parameters)
        return cls(name, p.threshold)

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[float]:
        t = self.threshold
        half_per_request = 0.5 / t
        return [
            0.5 - q * half_per_request if q < t else 0.0
            for q in [
                m.waiting if m.scraped_at > 0.0 else NAN for s in endpoints for m in [s.metrics]
            ]
        ]


class TokenLoadParameters(Parameters):
    queue_threshold_tokens: int = Field(4_194_304, alias="queueThresholdTokens", gt=0)


class TokenLoadScorer:
    """Fewer tokens in flight from this router (`in_flight_tokens`) is better.

    `1 - min(1, in_flight_tokens / queueThresholdTokens)`; no tokens → 1.
    """

    __slots__ = ("name", "queue_threshold_tokens")
    type: ClassVar[str] = "token-load-scorer"

    def __init__(self, name: str | None = None, queue_threshold_tokens: int = 4_194_304) -> None:
        self.name = name or self.type
        self.queue_threshold_tokens = float(queue_threshold_tokens)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(TokenLoadParameters, cls.type, name, parameters)
        return cls(name, p.queue_threshold_tokens)

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[float]:
        t = self.queue_threshold_tokens
        return [1.0 - n / t if n < t else 0.0 for n in [s.in_flight_tokens for s in endpoints]]


class LoraAffinityScorer(ParameterlessPlugin):
    """Prefer replicas that already run the requested LoRA adapter, then ones with a free slot.

    1.0 adapter running; 0.8 a slot is free (`|running | waiting| < max_lora`);
    0.6 adapter waiting; 0 otherwise. A request for the base model scores 1.0
    everywhere. vLLM publishes no `lora_requests_info` series until a replica's
    first adapter request, so a replica without LoRA state whose `/v1/models`
    lists adapters (LoRA is enabled, nothing in flight) has a free slot: 0.8; one
    that lists none scores 0.
    """

    __slots__ = ()
    type: ClassVar[str] = "lora-affinity-scorer"

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[float]:
        adapter = request.lora
        if not adapter:
            return [1.0] * len(endpoints)
        out: list[float] = []
        append = out.append
        for s in endpoints:
            info = s.metrics.lora
            if info is None:
                append(0.8 if adapter in s.served_models or len(s.served_models) > 1 else 0.0)
                continue
            running, waiting = info.running, info.waiting
            if adapter in running:
                append(1.0)
                continue
            used = len(running) + len(waiting)
            if used >= info.max_lora and running and waiting:
                used = len(running | waiting)  # an adapter both running and waiting counts once
            if used < info.max_lora:
                append(0.8)
            elif adapter in waiting:
                append(0.6)
            else:
                append(0.0)
        return out


# -- llm-d router scorers (issue 17) ---------------------------------------------------------

CONTEXT_LENGTH_LABEL = "llm-d.ai/context-length-range"
_OUT_OF_RANGE_CEILING = 0.3


class ContextLengthParameters(Parameters):
    label: str = Field(CONTEXT_LENGTH_LABEL, min_length=1)
    enable_filtering: bool = Field(False, alias="enableFiltering")


def parse_range(text: str) -> tuple[int, int] | None:
    """`"min-max"` token counts, or None when the label is not such a range."""
    low, sep, high = text.partition("-")
    if not sep:
        return None
    try:
        lo, hi = int(low.strip()), int(high.strip())
    except ValueError:
        return None
    return (lo, hi) if lo <= hi else None


def range_score(length: int, lo: int, hi: int) -> float:
    """llm-d's context-length score: above 0.3 inside the range, below it outside.

    Inside: 0.3 + 0.7 × (0.7 × narrowness + 0.3 × headroom), narrowness
    `1/(1 + width/10000)` (specialised replicas first), headroom the share of the
    range above the request; a zero-width range that fits scores 1. Outside:
    `0.3 / (1 + distance/1000)`, so the nearest range wins among misfits.
    """
    if lo <= length <= hi:
        width = hi - lo
        if width == 0:
            return 1.0
        narrow = 1.0 / (1.0 + width / 10000.0)
        headroom = (hi - length) / width
        inner = 0.7 * narrow + 0.3 * headroom
        return _OUT_OF_RANGE_CEILING + inner * (1.0 - _OUT_OF_RANGE_CEILING)
    distance = length - hi if length > hi else lo - length
    return _OUT_OF_RANGE_CEILING / (1.0 + distance / 1000.0)


class ContextLengthAware:
    """`context-length-aware`: a scorer (and, with `enableFiltering`, a filter) on the prompt
    length against each replica's `min-max` token range label.

    The length is `request.prompt_tokens` (exact when a tokenizer ran, else the
    estimate). Replicas without the label score 0.5 and always pass the filter; a
    label that is not a range scores 0 and is filtered out.
    """

    __slots__ = ("enable_filtering", "label", "name")
    type: ClassVar[str] = "context-length-aware"

    def __init__(self, name: str, params: ContextLengthParameters) -> None:
        self.name = name
        self.label = params.label
        self.enable_filtering = params.enable_filtering

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        return cls(name, decode_parameters(ContextLengthParameters, cls.type, name, parameters))

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        if not self.enable_filtering:
            return endpoints
        n = request.prompt_tokens
        out = []
        for s in endpoints:
            text = s.endpoint.labels.get(self.label)
            if text is None:
                out.append(s)
                continue
            bounds = parse_range(text)
            if bounds is not None and bounds[0] <= n <= bounds[1]:
                out.append(s)
        return out

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[float]:
        n = request.prompt_tokens
        out = []
        for s in endpoints:
            text = s.endpoint.labels.get(self.label)
            if text is None:
                out.append(0.5)
                continue
            bounds = parse_range(text)
            out.append(0.0 if bounds is None else range_score(n, *bounds))
        return out


class HeaderLabelAffinityParameters(Parameters):
    header_name: str = Field(alias="headerName", min_length=1)
    label_key: str = Field(alias="labelKey", min_length=1)


class HeaderLabelAffinityScorer:
    """`header-label-affinity-scorer`: 1 for endpoints whose label `labelKey` equals the
    request's `headerName` header, 0 for the others (which stay eligible)."""

    __slots__ = ("header", "label", "name")
    type: ClassVar[str] = "header-label-affinity-scorer"

    def __init__(self, name: str, params: HeaderLabelAffinityParameters) -> None:
        self.name = name
        self.header = params.header_name.lower()
        self.label = params.label_key

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(HeaderLabelAffinityParameters, cls.type, name, parameters)
        return cls(name, p)

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[float]:
        wanted = request.headers.get(self.header, "").strip()
        if not wanted:
            return [0.0] * len(endpoints)
        return [1.0 if s.endpoint.labels.get(self.label) == wanted else 0.0 for s in endpoints]
