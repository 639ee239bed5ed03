"""Filters: narrow the candidate list before scoring.

A filter returns a new list (it never mutates its input); an empty result
ends the profile with no candidates. Type strings and parameters follow llm-d.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, model_validator

from servegate.pool.endpoint import ROLE_LABEL, Endpoint, EndpointState, Role
from servegate.scheduling.factory import (
    ParameterlessPlugin,
    Parameters,
    PluginContext,
    decode_parameters,
)
from servegate.scheduling.framework import CycleState
from servegate.scheduling.request import LLMRequest

LEGACY_LABEL_SELECTOR_TYPE = "by-label-selector"
"""llm-d's older, deprecated name of `label-selector-filter`; accepted as an alias."""


class LabelSelectorRequirement(Parameters):
    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _values_fit_operator(self) -> Self:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs a non-empty `values` list")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no `values`; remove them")
        return self


class LabelSelectorParameters(Parameters):
    """A Kubernetes `metav1.LabelSelector`; all requirements must hold (AND)."""

    match_labels: dict[str, str] = Field(default_factory=dict, alias="matchLabels")
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, alias="matchExpressions"
    )


Check = Callable[[Mapping[str, str]], bool]


def _requirement(req: LabelSelectorRequirement) -> Check:
    key = req.key
    values = frozenset(req.values)
    if req.operator == "In":
        return lambda labels: labels.get(key) in values
    if req.operator == "NotIn":
        return lambda labels: labels.get(key) not in values
    if req.operator == "Exists":
        return lambda labels: key in labels
    return lambda labels: key not in labels


_MEMO_LIMIT = 4096


class LabelSelectorFilter:
    """Keeps endpoints whose `labels` match a Kubernetes label selector.

    `NotIn` also matches endpoints without the key, `In` never does, as in Kubernetes.
    An empty selector matches every endpoint. An endpoint's labels never change
    (`Endpoint` is immutable), so the verdict is memoised per `Endpoint` object.
    """

    __slots__ = ("_checks", "_match_labels", "_memo", "name", "selector")
    type: ClassVar[str] = "label-selector-filter"
    identity_only: ClassVar[bool] = True

    def __init__(self, name: str | None = None, selector: LabelSelectorParameters | None = None):
        self.name = name or self.type
        self.selector = selector or LabelSelectorParameters()
        self._match_labels = tuple(self.selector.match_labels.items())
        self._checks = tuple(_requirement(r) for r in self.selector.match_expressions)
        self._memo: dict[int, tuple[Endpoint, bool]] = {}

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        return cls(name, decode_parameters(LabelSelectorParameters, cls.type, name, parameters))

    def matches(self, labels: Mapping[str, str]) -> bool:
        for key, value in self._match_labels:
            if labels.get(key) != value:
                return False
        return all(check(labels) for check in self._checks)

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        if not self._match_labels and not self._checks:
            return list(endpoints)
        memo = self._memo
        get = memo.get
        out = []
        for s in endpoints:
            ep = s.endpoint
            hit = get(id(ep))
            if hit is None or hit[0] is not ep:
                if len(memo) >= _MEMO_LIMIT:
                    memo.clear()
                hit = (ep, self.matches(ep.labels))
                memo[id(ep)] = hit
            if hit[1]:
                out.append(s)
        return out


def role_of(endpoint: Endpoint) -> str | None:
    """The `llm-d.ai/role` label, else a role set explicitly in static config, else None."""
    value = endpoint.labels.get(ROLE_LABEL)
    if value is not None:
        return value
    if endpoint.role is not Role.BOTH:
        return endpoint.role.value
    return None


class _RoleFilter(ParameterlessPlugin):
    __slots__ = ()
    keeps: ClassVar[frozenset[str | None]]
    identity_only: ClassVar[bool] = True

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        keeps = self.keeps
        both = Role.BOTH
        out = []
        for s in endpoints:  # role_of, inlined: this runs for every candidate
            ep = s.endpoint
            role: str | None = ep.labels.get(ROLE_LABEL)
            if role is None and ep.role is not both:
                role = ep.role
            if role in keeps:
                out.append(s)
        return out


class DecodeFilter(_RoleFilter):
    """Keeps endpoints that can decode: roles `decode`, `prefill-decode` (and llm-d's
    `both`, `encode-prefill-decode`) and endpoints without a role label."""

    __slots__ = ()
    type: ClassVar[str] = "decode-filter"
    keeps: ClassVar[frozenset[str | None]] = frozenset(
        {None, "decode", "prefill-decode", "both", "encode-prefill-decode"}
    )


class PrefillFilter(_RoleFilter):
    """Keeps endpoints labelled to prefill: `prefill`, `prefill-decode` (and llm-d's
    `both`, `encode-prefill`, `encode-prefill-decode`). Unlabelled endpoints are dropped."""

    __slots__ = ()
    type: ClassVar[str] = "prefill-filter"
    keeps: ClassVar[frozenset[str | None]] = frozenset(
        {"prefill", "prefill-decode", "both", "encode-prefill", "encode-prefill-decode"}
    )


class FreshMetricsParameters(Parameters):
    max_age_seconds: float | None = Field(None, alias="maxAgeSeconds", gt=0)


class FreshMetricsFilter:
    """servegate's own: drops endpoints whose scraped metrics are stale.

    Fresh = scraped at least once and no more than `maxAgeSeconds` (default: the
    pool's staleness) before `cycle.now`. When no candidate is fresh it keeps them
    all (fail open), like the saturation detector.
    """

    __slots__ = ("max_age", "name")
    type: ClassVar[str] = "fresh-metrics-filter"

    def __init__(self, name: str | None = None, max_age: float = 2.0) -> None:
        self.name = name or self.type
        self.max_age = max_age

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(FreshMetricsParameters, cls.type, name, parameters)
        return cls(name, p.max_age_seconds if p.max_age_seconds is not None else ctx.staleness_s)

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        now = cycle.now
        max_age = self.max_age
        fresh = [s for s in endpoints if s.is_fresh(now, max_age)]
        return fresh if fresh else list(endpoints)


# -- llm-d router filters (issue 17) ---------------------------------------------------------


class ByLabelParameters(Parameters):
    label: str = Field(min_length=1)
    valid_values: list[str] = Field(default_factory=list, alias="validValues")
    allows_no_label: bool = Field(False, alias="allowsNoLabel")

    @model_validator(mode="after")
    def _values(self) -> Self:
        if not self.valid_values and not self.allows_no_label:
            raise ValueError("validValues must not be empty unless allowsNoLabel is true")
        return self


class ByLabelFilter:
    """`by-label` (llm-d, deprecated there for label-selector-filter): keeps endpoints whose
    `label` has one of `validValues`; endpoints without the label pass only with
    `allowsNoLabel`."""

    __slots__ = ("allows_no_label", "label", "name", "values")
    type: ClassVar[str] = "by-label"

    def __init__(self, name: str, params: ByLabelParameters) -> None:
        self.name = name
        self.label = params.label
        self.values = frozenset(params.valid_values)
        self.allows_no_label = params.allows_no_label

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        return cls(name, decode_parameters(ByLabelParameters, cls.type, name, parameters))

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        out = []
        for s in endpoints:
            value = s.endpoint.labels.get(self.label)
            if value is None and self.label == ROLE_LABEL:
                value = role_of(s.endpoint)
            if (value is None and self.allows_no_label) or (
                value is not None and value in self.values
            ):
                out.append(s)
        return out


class EncodeFilter(_RoleFilter):
    """Keeps endpoints labelled to encode (multimodal inputs): `encode`, `encode-prefill`,
    `encode-prefill-decode`. Unlabelled endpoints are dropped."""

    __slots__ = ()
    type: ClassVar[str] = "encode-filter"
    keeps: ClassVar[frozenset[str | None]] = frozenset(
        {"encode", "encode-prefill", "encode-prefill-decode"}
    )


UtilizationMetric = Literal[
    "active-requests", "running-requests", "waiting-queue", "kv-cache-utilization"
]


class UtilizationCondition(Parameters):
    metric: UtilizationMetric
    max_value: float = Field(alias="maxValue", ge=0.0)

    @model_validator(mode="after")
    def _fraction(self) -> Self:
        if self.metric == "kv-cache-utilization" and self.max_value > 1.0:
            raise ValueError("maxValue of kv-cache-utilization is a fraction: at most 1")
        return self


class UtilizationFilterParameters(Parameters):
    conditions: list[UtilizationCondition] = Field(min_length=1)
    fallback_on_empty: bool = Field(False, alias="fallbackOnEmpty")
    in_flight_load_producer_name: str | None = Field(
        None, alias="inFlightLoadProducerName", min_length=1
    )
    """llm-d's reference to the in-flight load; servegate's pool counts it itself."""


def _metric(state: EndpointState, metric: str) -> float:
    if metric == "active-requests":
        return float(state.in_flight_requests)
    m = state.metrics
    if metric == "running-requests":
        return float(m.running)
    if metric == "waiting-queue":
        return float(m.waiting)
    return float(m.kv_usage)


class UtilizationFilter:
    """`utilization-filter`: drops endpoints over any of the configured caps.

    An endpoint is kept when every condition's metric is ≤ its `maxValue`:
    `active-requests` (this router's in flight), `running-requests` and
    `waiting-queue` (the replica's metrics), `kv-cache-utilization` (0-1). When
    nothing is left and `fallbackOnEmpty` is true, every candidate is kept.
    """

    __slots__ = ("conditions", "fallback_on_empty", "name")
    type: ClassVar[str] = "utilization-filter"

    def __init__(self, name: str, params: UtilizationFilterParameters) -> None:
        self.name = name
        self.conditions = tuple((c.metric, c.max_value) for c in params.conditions)
        self.fallback_on_empty = params.fallback_on_empty

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        p = decode_parameters(UtilizationFilterParameters, cls.type, name, parameters)
        return cls(name, p)

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        kept = [
            s
            for s in endpoints
            if all(_metric(s, metric) <= cap for metric, cap in self.conditions)
        ]
        if not kept and self.fallback_on_empty:
            return list(endpoints)
        return kept
