"""llm-d plugins whose input does not exist in servegate, accepted with a startup warning.

Each behaves as llm-d's plugin does when its input is missing, so a
configuration that names one routes the same way llm-d would without that
input, and the warning says so:

- `endpoint-attribute-filter` / `endpoint-attribute-scorer` read custom endpoint
  attributes (DCGM GPU telemetry, custom metrics) that servegate does not
  collect: every endpoint misses the attribute, so the filter keeps all
  (`onMissing: Pass`) or none (`Fail`, then `fallbackOnEmpty`), and the scorer
  gives every endpoint 0;
- `topology-affinity-filter` / `-scorer`: no node/zone topology is known, so the
  filter fails open (keeps every candidate) and the scorer is 0 everywhere;
- `mm-embeddings-cache-scorer`: no multimodal embedding cache is tracked: 0;
- request-control plugins (`agent-identity`, `request-attribute-reporter`,
  `disaggregatedset-rollout-screener`) have no hook in servegate's gateway;
- the `multicluster-*` variants score each endpoint as the single-cluster
  plugins do (servegate routes to endpoints, not to clusters).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, Self

from pydantic import Field

from servegate.pool.endpoint import EndpointState
from servegate.scheduling.affinity import SessionAffinityFilter
from servegate.scheduling.datasources import (
    DISCOVERY_KIND,
    EXTRACTOR_KIND,
    SOURCE_KIND,
    HTTPSourceParameters,
)
from servegate.scheduling.declared import DeclaredPlugin, ParamsModel
from servegate.scheduling.factory import Parameters, PluginContext, decode_parameters
from servegate.scheduling.framework import CycleState
from servegate.scheduling.request import LLMRequest
from servegate.scheduling.scorers import KVCacheUtilizationScorer, QueueScorer

ParametersType = type[Parameters]
"""(Named here: inside the classes `type` is the plugin's type string.)"""


class _Warned:
    """A filter or scorer with a fixed reason it cannot use its input here."""

    type: ClassVar[str]
    reason: ClassVar[str]
    parameters: ClassVar[ParametersType]
    """What its `parameters` block decodes into (llm-d's, checked strictly)."""

    def __init__(self, name: str, params: Parameters) -> None:
        self.name = name
        self.params = params

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], ctx: PluginContext) -> Self:
        return cls(name, decode_parameters(cls.parameters, cls.type, name, parameters))

    def startup_warnings(self) -> list[str]:
        label = f"{self.name!r} (type {self.type!r})" if self.name != self.type else repr(self.name)
        return [f"plugin {label}: {self.reason}"]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class ThresholdSpec(Parameters):
    operator: Literal[
        "LessThan", "LessThanOrEqual", "GreaterThan", "GreaterThanOrEqual", "Equal", "NotEqual"
    ]
    value: float


class FilterAlgorithm(Parameters):
    type: Literal["threshold"]
    threshold: ThresholdSpec


class AttributeFilterParameters(Parameters):
    attribute: str = Field(min_length=1)
    producer: str | None = None
    on_missing: Literal["Pass", "Fail"] = Field("Pass", alias="onMissing")
    fallback_on_empty: bool = Field(False, alias="fallbackOnEmpty")
    algorithm: FilterAlgorithm


class EndpointAttributeFilter(_Warned):
    type: ClassVar[str] = "endpoint-attribute-filter"
    reason: ClassVar[str] = (
        "servegate collects no custom endpoint attributes (DCGM, custom metrics), so every "
        "endpoint misses the attribute and onMissing decides for all of them"
    )

    parameters: ClassVar[ParametersType] = AttributeFilterParameters

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        p = self.params
        assert isinstance(p, AttributeFilterParameters)
        if p.on_missing == "Pass" or p.fallback_on_empty:
            return list(endpoints)
        return []


class AttributeScorerParameters(Parameters):
    attribute_key: str = Field(alias="attributeKey", min_length=1)
    producer: str | None = None
    algorithm: dict[str, Any]


class EndpointAttributeScorer(_Warned):
    type: ClassVar[str] = "endpoint-attribute-scorer"
    reason: ClassVar[str] = (
        "servegate collects no custom endpoint attributes (DCGM, custom metrics); every "
        "endpoint misses the attribute and scores 0, as in llm-d"
    )

    parameters: ClassVar[ParametersType] = AttributeScorerParameters

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> Sequence[float]:
        return [0.0] * len(endpoints)


class TopologyParameters(Parameters):
    min_affinity: Literal["host", "rack", "zone", "region"] | None = Field(
        None, alias="minAffinity"
    )
    peer_profile: str | None = Field(None, alias="peerProfile")


class TopologyAffinityFilter(_Warned):
    type: ClassVar[str] = "topology-affinity-filter"
    reason: ClassVar[str] = (
        "servegate knows no node/rack/zone topology of its endpoints; like llm-d without peer "
        "topology, the filter keeps every candidate"
    )

    parameters: ClassVar[ParametersType] = TopologyParameters

    def filter(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        return list(endpoints)


class TopologyAffinityScorer(_Warned):
    type: ClassVar[str] = "topology-affinity-scorer"
    reason: ClassVar[str] = (
        "servegate knows no node/rack/zone topology of its endpoints; every endpoint scores 0"
    )

    parameters: ClassVar[ParametersType] = TopologyParameters

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> Sequence[float]:
        return [0.0] * len(endpoints)


class MMCacheScorerParameters(Parameters):
    producer_name: str | None = Field(None, alias="mmEmbeddingsCacheProducerName")


class MMEmbeddingsCacheScorer(_Warned):
    type: ClassVar[str] = "mm-embeddings-cache-scorer"
    reason: ClassVar[str] = (
        "servegate does not track multimodal embedding caches; every endpoint scores 0"
    )

    parameters: ClassVar[ParametersType] = MMCacheScorerParameters

    def score(
        self, cycle: CycleState, request: LLMRequest, endpoints: list[EndpointState]
    ) -> Sequence[float]:
        return [0.0] * len(endpoints)


# -- request control --------------------------------------------------------------------

REQUEST_CONTROL_KIND = "request-control"


class AgentIdentityParameters(Parameters):
    additional_session_headers: list[str] = Field(
        default_factory=list, alias="additionalSessionHeaders"
    )


class AgentIdentity(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "agent-identity"
    kind: ClassVar[str] = REQUEST_CONTROL_KIND
    parameters_model: ClassVar[ParamsModel] = AgentIdentityParameters
    unsupported: ClassVar[str] = (
        "servegate derives no agent identity from request headers; flows and sessions come "
        "from x-gateway-inference-fairness-id and session-id headers"
    )


class ReporterParameters(Parameters):
    attributes: list[dict[str, Any]] = Field(default_factory=list)


class RequestAttributeReporter(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "request-attribute-reporter"
    kind: ClassVar[str] = REQUEST_CONTROL_KIND
    parameters_model: ClassVar[ParamsModel] = ReporterParameters
    unsupported: ClassVar[str] = (
        "servegate does not evaluate attribute expressions into Envoy dynamic metadata"
    )


class ScreenerParameters(Parameters):
    scope: dict[str, Any] | None = None
    header_selectors: list[dict[str, Any]] = Field(default_factory=list, alias="headerSelectors")
    revision_gating: dict[str, Any] | None = Field(None, alias="revisionGating")


class DisaggregatedSetRolloutScreener(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "disaggregatedset-rollout-screener"
    kind: ClassVar[str] = REQUEST_CONTROL_KIND
    parameters_model: ClassVar[ParamsModel] = ScreenerParameters
    unsupported: ClassVar[str] = (
        "servegate does not screen endpoints by rollout revision; every candidate stays"
    )


# -- multicluster variants ----------------------------------------------------------------

_MULTICLUSTER = (
    "servegate routes to endpoints, not to clusters: this multicluster variant behaves as "
    "its single-cluster plugin over servegate's endpoints"
)


class MultiClusterQueueScorer(QueueScorer):
    __slots__ = ()
    type: ClassVar[str] = "multicluster-queue-scorer"

    def startup_warnings(self) -> list[str]:
        return [f"plugin {self.name!r}: {_MULTICLUSTER}"]


class MultiClusterKVCacheScorer(KVCacheUtilizationScorer):
    __slots__ = ()
    type: ClassVar[str] = "multicluster-kv-cache-utilization-scorer"

    def startup_warnings(self) -> list[str]:
        return [f"plugin {self.name!r}: {_MULTICLUSTER}"]


class MultiClusterSessionAffinityFilter(SessionAffinityFilter):
    type: ClassVar[str] = "multicluster-session-affinity-filter"

    def startup_warnings(self) -> list[str]:
        return [f"plugin {self.name!r}: {_MULTICLUSTER}"]


class MultiClusterMetricsSource(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "multicluster-metrics-data-source"
    kind: ClassVar[str] = SOURCE_KIND
    parameters_model: ClassVar[ParamsModel] = HTTPSourceParameters
    unsupported: ClassVar[str] = _MULTICLUSTER + "; the pool's own scraper is the source"


class MultiClusterMetricsExtractor(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "multicluster-metrics-extractor"
    kind: ClassVar[str] = EXTRACTOR_KIND
    unsupported: ClassVar[str] = _MULTICLUSTER + "; the pool's own metrics parser extracts"


class DiscoveryParameters(Parameters):
    path: str = Field(min_length=1)


class MultiClusterFileDiscovery(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "multicluster-file-discovery"
    kind: ClassVar[str] = DISCOVERY_KIND
    parameters_model: ClassVar[ParamsModel] = DiscoveryParameters
    unsupported: ClassVar[str] = (
        "servegate's endpoints come from its own `endpoints:`/`discovery:` settings; this "
        "discovery plugin is not used"
    )


SCHEDULING: tuple[Any, ...] = (
    EndpointAttributeFilter,
    EndpointAttributeScorer,
    TopologyAffinityFilter,
    TopologyAffinityScorer,
    MMEmbeddingsCacheScorer,
    MultiClusterQueueScorer,
    MultiClusterKVCacheScorer,
    MultiClusterSessionAffinityFilter,
)
DECLARED: tuple[type[DeclaredPlugin], ...] = (
    AgentIdentity,
    RequestAttributeReporter,
    DisaggregatedSetRolloutScreener,
    MultiClusterMetricsSource,
    MultiClusterMetricsExtractor,
    MultiClusterFileDiscovery,
)
