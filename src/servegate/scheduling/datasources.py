"""llm-d's data layer (`dataLayer:`, formerly `data:`): sources and extractors.

In llm-d a data source polls something per endpoint (the metrics endpoint,
`/v1/models`, DCGM) and hands the result to its extractors, which write
attributes the scorers read. servegate's pool does the same work without
plugins: its scraper polls each replica's metrics endpoint and parses the
engine's series (queue, running, KV usage, LoRA, cache config) into
`EndpointMetrics`, and it asks `/v1/models` for the served models. So:

- `metrics-data-source` + `core-metrics-extractor` are what servegate's pool
  does (the URL and engine come from the pool settings, which is where a
  non-default scheme, path, port or engine mapping must be set: each such
  parameter is a startup warning);
- `models-data-source` + `models-data-extractor` are its `/v1/models` polling;
- `endpoint-notification-source` is its discovery (endpoints come and go as
  discovery says) and, for extractors such as `precise-prefix-cache-producer`,
  the KV-event subscription the pool opens per endpoint;
- DCGM GPU telemetry and topology attributes have no consumer in servegate:
  accepted with a warning.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from servegate.scheduling.declared import DeclaredPlugin, ParamsModel
from servegate.scheduling.factory import Parameters

SOURCE_KIND = "data-source"
EXTRACTOR_KIND = "data-extractor"
DISCOVERY_KIND = "discovery"


class HTTPSourceParameters(Parameters):
    scheme: str = "http"
    path: str = ""
    port: int | None = Field(None, ge=1, le=65535)
    insecure_skip_verify: bool = Field(False, alias="insecureSkipVerify")
    ca_cert_path: str = Field("", alias="caCertPath")
    client_cert_path: str = Field("", alias="clientCertPath")
    client_key_path: str = Field("", alias="clientKeyPath")
    interval: str | int | None = None


class _Source(DeclaredPlugin):
    __slots__ = ()
    kind: ClassVar[str] = SOURCE_KIND


class _Extractor(DeclaredPlugin):
    __slots__ = ()
    kind: ClassVar[str] = EXTRACTOR_KIND


def _http_warnings(p: HTTPSourceParameters, default_path: str, what: str) -> list[str]:
    out = []
    if p.scheme not in ("", "http"):
        out.append(
            f"scheme {p.scheme!r}: servegate reaches {what} at the URL the pool settings give "
            "(endpoint metrics_url, or the engine's port and path); set https there"
        )
    if p.path not in ("", default_path):
        out.append(
            f"path {p.path!r}: servegate takes the {what} path from the pool's engine "
            "settings, not from this plugin"
        )
    if p.port is not None:
        out.append(
            f"port {p.port}: servegate takes the {what} port from the pool's engine settings"
        )
    if p.ca_cert_path or p.client_cert_path or p.client_key_path:
        out.append(
            "TLS client certificates are not configured by this plugin; servegate scrapes "
            "with its default TLS settings"
        )
    if p.interval is not None:
        out.append(
            "interval: servegate's scrape interval is the pool's `scrape_interval_s` setting"
        )
    return out


class MetricsDataSource(_Source):
    """`metrics-data-source`: servegate's per-replica metrics scraper."""

    __slots__ = ()
    type: ClassVar[str] = "metrics-data-source"
    parameters_model: ClassVar[ParamsModel] = HTTPSourceParameters

    def warnings(self) -> list[str]:
        assert isinstance(self.params, HTTPSourceParameters)
        return _http_warnings(self.params, "/metrics", "the metrics endpoint")


class ModelsDataSource(_Source):
    """`models-data-source`: servegate's `/v1/models` polling of each replica."""

    __slots__ = ()
    type: ClassVar[str] = "models-data-source"
    parameters_model: ClassVar[ParamsModel] = HTTPSourceParameters

    def warnings(self) -> list[str]:
        assert isinstance(self.params, HTTPSourceParameters)
        return _http_warnings(self.params, "/v1/models", "/v1/models")


class NotificationParameters(Parameters):
    group: str = ""
    version: str = ""
    kind: str = ""


class EndpointNotificationSource(_Source):
    """`endpoint-notification-source`: endpoint add/remove events, i.e. servegate's discovery."""

    __slots__ = ()
    type: ClassVar[str] = "endpoint-notification-source"
    parameters_model: ClassVar[ParamsModel] = NotificationParameters


class K8sNotificationSource(_Source):
    __slots__ = ()
    type: ClassVar[str] = "k8s-notification-source"
    parameters_model: ClassVar[ParamsModel] = NotificationParameters
    unsupported: ClassVar[str] = (
        "servegate watches only the pods (or InferencePool) its discovery settings name; "
        "notifications of other Kubernetes objects are not delivered to any plugin"
    )


class DCGMSourceParameters(HTTPSourceParameters):
    use_node_address: bool = Field(False, alias="useNodeAddress")


class DCGMDataSource(_Source):
    __slots__ = ()
    type: ClassVar[str] = "dcgm-data-source"
    parameters_model: ClassVar[ParamsModel] = DCGMSourceParameters
    unsupported: ClassVar[str] = (
        "servegate does not scrape DCGM GPU telemetry and no servegate plugin reads it"
    )


class EngineMapping(Parameters):
    name: str = Field(min_length=1)
    queued_requests_spec: str = Field("", alias="queuedRequestsSpec")
    running_requests_spec: str = Field("", alias="runningRequestsSpec")
    kv_usage_spec: str = Field("", alias="kvUsageSpec")
    lora_spec: str = Field("", alias="loraSpec")
    cache_info_spec: str = Field("", alias="cacheInfoSpec")
    cache_block_size_label_name: str = Field("", alias="cacheBlockSizeLabelName")
    cache_num_blocks_label_name: str = Field("", alias="cacheNumBlocksLabelName")
    cache_block_size_spec: str = Field("", alias="cacheBlockSizeSpec")
    cache_num_blocks_spec: str = Field("", alias="cacheNumBlocksSpec")
    custom_metrics: list[dict[str, Any]] = Field(default_factory=list, alias="customMetrics")


class CoreMetricsParameters(Parameters):
    engine_label_key: str = Field("", alias="engineLabelKey")
    default_engine: str = Field("", alias="defaultEngine")
    engine_configs: list[EngineMapping] = Field(default_factory=list, alias="engineConfigs")


class CoreMetricsExtractor(_Extractor):
    """`core-metrics-extractor`: servegate's engine metrics parser (queue, running, KV, LoRA)."""

    __slots__ = ()
    type: ClassVar[str] = "core-metrics-extractor"
    parameters_model: ClassVar[ParamsModel] = CoreMetricsParameters

    def warnings(self) -> list[str]:
        p = self.params
        assert isinstance(p, CoreMetricsParameters)
        out = []
        if p.default_engine or p.engine_label_key:
            out.append(
                "defaultEngine/engineLabelKey: servegate reads the metric names of the engine "
                "the pool's `engine` setting names (vllm, sglang, ...), for every endpoint"
            )
        if p.engine_configs:
            out.append(
                "engineConfigs: servegate's metric names per engine are built in "
                "(servegate.engines); custom mappings are not applied"
            )
        return out


class ModelsDataExtractor(_Extractor):
    """`models-data-extractor`: the served-model list servegate keeps per endpoint."""

    __slots__ = ()
    type: ClassVar[str] = "models-data-extractor"


class DCGMExtractor(_Extractor):
    __slots__ = ()
    type: ClassVar[str] = "dcgm-extractor"
    unsupported: ClassVar[str] = "servegate has no GPU telemetry for this extractor to read"


class TopologyExtractor(_Extractor):
    __slots__ = ()
    type: ClassVar[str] = "topology-extractor"
    unsupported: ClassVar[str] = (
        "servegate keeps no node/zone topology attributes; endpoint labels are available to "
        "label-selector-filter instead"
    )


class FileDiscoveryParameters(Parameters):
    path: str = Field(min_length=1)


class FileDiscovery(DeclaredPlugin):
    __slots__ = ()
    type: ClassVar[str] = "file-discovery"
    kind: ClassVar[str] = DISCOVERY_KIND
    parameters_model: ClassVar[ParamsModel] = FileDiscoveryParameters
    unsupported: ClassVar[str] = (
        "servegate's endpoints come from its own `endpoints:`/`discovery:` settings "
        "(docs/configuration.md); this discovery plugin is not used"
    )


SOURCES: tuple[type[DeclaredPlugin], ...] = (
    MetricsDataSource,
    ModelsDataSource,
    EndpointNotificationSource,
    K8sNotificationSource,
    DCGMDataSource,
)
EXTRACTORS: tuple[type[DeclaredPlugin], ...] = (
    CoreMetricsExtractor,
    ModelsDataExtractor,
    DCGMExtractor,
    TopologyExtractor,
)
