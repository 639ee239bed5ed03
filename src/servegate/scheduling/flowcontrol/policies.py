"""llm-d's flow-control policy plugins, referenced from `flowControl`.

servegate's queue (`queues.py`) dispatches the highest non-empty priority band
first, round-robin between the flows (fairness ids) of a band, first come first
served inside a flow. That is exactly llm-d's `round-robin-fairness-policy` with
`fcfs-ordering-policy`, so those two are implemented. Other fairness, ordering,
usage-limit and eviction policies change which queued request goes next in ways
servegate's queue does not; each is accepted with a startup warning saying that
the round-robin/FCFS order applies instead.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from servegate.scheduling.declared import DeclaredPlugin, ParamsModel
from servegate.scheduling.factory import Parameters

FAIRNESS_KIND = "fairness-policy"
ORDERING_KIND = "ordering-policy"
USAGE_LIMIT_KIND = "usage-limit-policy"
EVICTION_KIND = "eviction-policy"

_ORDER = (
    "servegate's queue dispatches round-robin between the flows of a band and first come "
    "first served inside a flow"
)


class RoundRobinFairnessPolicy(DeclaredPlugin):
    """One request per flow per turn inside a band: servegate's queue."""

    __slots__ = ()
    type: ClassVar[str] = "round-robin-fairness-policy"
    kind: ClassVar[str] = FAIRNESS_KIND


class FCFSOrderingPolicy(DeclaredPlugin):
    """Oldest request of a flow first: servegate's queue."""

    __slots__ = ()
    type: ClassVar[str] = "fcfs-ordering-policy"
    kind: ClassVar[str] = ORDERING_KIND


class GlobalStrictFairnessPolicy(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "global-strict-fairness-policy"
    kind: ClassVar[str] = FAIRNESS_KIND
    unsupported: ClassVar[str] = f"strict global order across flows is not implemented; {_ORDER}"


class ProgramAwareParameters(Parameters):
    strategy: str = ""
    eviction_ttl_seconds: float = Field(0.0, alias="evictionTtlSeconds", ge=0)
    eviction_sweep_seconds: float = Field(0.0, alias="evictionSweepSeconds", ge=0)
    las_weight_service: float = Field(0.0, alias="lasWeightService")
    las_weight_head_wait: float = Field(0.0, alias="lasWeightHeadWait")
    las_half_life_seconds: float = Field(0.0, alias="lasHalfLifeSeconds", ge=0)


class ProgramAwareFairness(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "program-aware-fairness"
    kind: ClassVar[str] = FAIRNESS_KIND
    parameters_model: ClassVar[ParamsModel] = ProgramAwareParameters
    unsupported: ClassVar[str] = f"program-aware (agent) fairness is not implemented; {_ORDER}"


class EDFOrderingPolicy(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "edf-ordering-policy"
    kind: ClassVar[str] = ORDERING_KIND
    unsupported: ClassVar[str] = f"earliest-deadline-first is not implemented; {_ORDER}"


class SLODeadlineOrderingPolicy(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "slo-deadline-ordering-policy"
    kind: ClassVar[str] = ORDERING_KIND
    unsupported: ClassVar[str] = f"SLO-deadline ordering is not implemented; {_ORDER}"


class StaticUsageLimitParameters(Parameters):
    threshold: float | None = Field(None, ge=0.0, le=1.0)


class StaticUsageLimitPolicy(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "static-usage-limit-policy"
    kind: ClassVar[str] = USAGE_LIMIT_KIND
    parameters_model: ClassVar[ParamsModel] = StaticUsageLimitParameters
    unsupported: ClassVar[str] = (
        "per-band usage limits are not implemented; servegate gates dispatch on the "
        "saturation detector alone"
    )


class SoftCeilingParameters(Parameters):
    shape: str | None = None
    domain: str | None = None
    min_ceiling: float | None = Field(None, alias="minCeiling")
    max_ceiling: float | None = Field(None, alias="maxCeiling")


class SoftReflectiveCeilingPolicy(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "soft-reflective-ceiling-policy"
    kind: ClassVar[str] = USAGE_LIMIT_KIND
    parameters_model: ClassVar[ParamsModel] = SoftCeilingParameters
    unsupported: ClassVar[str] = StaticUsageLimitPolicy.unsupported


class PriorityHoldbackPolicy(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "priority-holdback-policy"
    kind: ClassVar[str] = USAGE_LIMIT_KIND
    unsupported: ClassVar[str] = StaticUsageLimitPolicy.unsupported


class SheddableEvictionFilter(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "sheddable-eviction-filter"
    kind: ClassVar[str] = EVICTION_KIND
    unsupported: ClassVar[str] = (
        "servegate does not evict dispatched requests; queued ones leave only by TTL or "
        "client disconnect"
    )


class PriorityThenTimeEvictionOrder(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "priority-then-time-eviction-order-policy"
    kind: ClassVar[str] = EVICTION_KIND
    unsupported: ClassVar[str] = SheddableEvictionFilter.unsupported


POLICIES: tuple[type[DeclaredPlugin], ...] = (
    RoundRobinFairnessPolicy,
    FCFSOrderingPolicy,
    GlobalStrictFairnessPolicy,
    ProgramAwareFairness,
    EDFOrderingPolicy,
    SLODeadlineOrderingPolicy,
    StaticUsageLimitPolicy,
    SoftReflectiveCeilingPolicy,
    PriorityHoldbackPolicy,
    SheddableEvictionFilter,
    PriorityThenTimeEvictionOrder,
)
