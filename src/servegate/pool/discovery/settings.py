"""Discovery settings: `pool.discovery` in servegate's YAML.

`static` (the default) uses only `pool.endpoints`. `kubernetes` watches pods the
way an InferencePool's endpoint picker does, either by a label selector with
target ports written here or by reading an `InferencePool` object::

    pool:
      discovery:
        kind: kubernetes
        namespace: llm              # None = the gateway pod's own namespace
        selector: {matchLabels: {llm-d.ai/inferenceServing: "true"}}
        target_ports: [8000]        # one endpoint per port (data-parallel ranks)
        kv_events_port: 5557        # rank r publishes on 5557 + r

    pool:
      discovery: {kind: kubernetes, inference_pool: qwen-pool}

Either way the namespace's InferenceObjectives (priorities) and InferenceModelRewrites
(model aliases and weighted splits) whose `poolRef` names the pool are read too and
followed as they change (`watch_objectives`, `watch_model_rewrites`; policy.py).

`ray` follows the model-server replicas of a Ray Serve application (deploy/ray)::

    pool:
      discovery: {kind: ray, registry: ReplicaRegistry}
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

IN_CLUSTER_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
KV_EVENTS_ANNOTATION = "servegate.io/kv-events"
KV_EVENTS_REPLAY_ANNOTATION = "servegate.io/kv-events-replay"
LABEL_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class LabelRequirement(_Strict):
    """One Kubernetes `matchExpressions` entry."""

    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _values_fit_operator(self) -> LabelRequirement:
        needs_values = self.operator in ("In", "NotIn")
        if needs_values and not self.values:
            raise ValueError(f"operator {self.operator} needs at least one value")
        if not needs_values and self.values:
            raise ValueError(f"operator {self.operator} takes no values")
        return self


class LabelSelector(_Strict):
    """A Kubernetes `LabelSelector`; empty selects every pod."""

    match_labels: dict[str, str] = Field(default_factory=dict, alias="matchLabels")
    match_expressions: tuple[LabelRequirement, ...] = Field((), alias="matchExpressions")

    def to_query(self) -> str:
        """The `labelSelector` query string the API server understands."""
        parts = [f"{key}={value}" for key, value in sorted(self.match_labels.items())]
        for req in self.match_expressions:
            if req.operator == "In":
                parts.append(f"{req.key} in ({','.join(req.values)})")
            elif req.operator == "NotIn":
                parts.append(f"{req.key} notin ({','.join(req.values)})")
            elif req.operator == "Exists":
                parts.append(req.key)
            else:
                parts.append(f"!{req.key}")
        return ",".join(parts)

    def matches(self, labels: dict[str, str]) -> bool:
        for key, value in self.match_labels.items():
            if labels.get(key) != value:
                return False
        for req in self.match_expressions:
            present = req.key in labels
            if req.operator == "In" and not (present and labels[req.key] in req.values):
                return False
            if req.operator == "NotIn" and present and labels[req.key] in req.values:
                return False
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
        return True


Port = Annotated[int, Field(ge=1, le=65535)]


class StaticDiscoverySettings(_Strict):
    kind: Literal["static"] = "static"


class KubernetesDiscoverySettings(_Strict):
    kind: Literal["kubernetes"]
    namespace: str | None = None
    """None = the gateway's own namespace (in-cluster) or the kubeconfig context's."""
    selector: LabelSelector | None = None
    """Which pods; give this with `target_ports`, or `inference_pool` instead."""
    target_ports: tuple[Port, ...] = ()
    """Ports of each pod; each one is its own endpoint (a data-parallel rank)."""
    inference_pool: str | None = None
    """Read `spec.selector` and `spec.targetPorts` of this InferencePool (and follow changes)."""
    inference_pool_api: str = "inference.networking.k8s.io/v1"
    """`group/version` of the InferencePool; `inference.networking.x-k8s.io/v1alpha2` is older."""
    scheme: Literal["http", "https"] = "http"
    kv_events_port: Port | None = None
    """Subscribe to `tcp://<pod IP>:<port + rank>` when the pod has no annotation."""
    kv_events_replay_port: Port | None = None
    kv_events_annotation: str = KV_EVENTS_ANNOTATION
    """A pod annotation holding the KV-events port (or a full `tcp://…` endpoint)."""
    kv_events_replay_annotation: str = KV_EVENTS_REPLAY_ANNOTATION
    watch_objectives: bool = True
    """Apply the InferenceObjectives whose poolRef names this pool (`inference_pool`, else
    the pool's name) as `flow_control.objectives`; a cluster object wins over a config
    entry of the same name. No CRD installed = none."""
    watch_model_rewrites: bool = True
    """Apply the InferenceModelRewrites whose poolRef names this pool after the config's
    `model_rewrites`: a model the config (or an older rewrite) matches keeps that match."""
    extension_api: str = "inference.networking.x-k8s.io/v1alpha2"
    """`group/version` of InferenceObjective and InferenceModelRewrite."""
    kubeconfig: str | None = None
    """A kubeconfig file; None = in-cluster when running in a pod, else $KUBECONFIG or ~/.kube/config."""
    context: str | None = None
    watch_timeout_s: int = Field(300, ge=1, le=3600)
    """The server ends each watch after this long (`timeoutSeconds`); the watch resumes from there."""
    backoff_initial_s: float = Field(0.2, gt=0)
    backoff_max_s: float = Field(30.0, gt=0)
    request_timeout_s: float = Field(10.0, gt=0)
    """For list and get requests, and for a watch that sends nothing (not even a bookmark)."""

    @field_validator("target_ports")
    @classmethod
    def _unique_ports(cls, ports: tuple[int, ...]) -> tuple[int, ...]:
        if len(set(ports)) != len(ports):
            raise ValueError("target_ports lists a port twice")
        if len(ports) > 8:
            raise ValueError("at most 8 target_ports (as an InferencePool allows)")
        return ports

    @model_validator(mode="after")
    def _one_source(self) -> KubernetesDiscoverySettings:
        if self.inference_pool is not None:
            if self.selector is not None or self.target_ports:
                raise ValueError(
                    "give either inference_pool or selector + target_ports, not both: "
                    "the InferencePool's spec holds its own selector and ports"
                )
        elif self.selector is None or not self.target_ports:
            raise ValueError(
                "kubernetes discovery needs `selector` and `target_ports`, "
                "or `inference_pool` naming an InferencePool"
            )
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be at least backoff_initial_s")
        for name in ("inference_pool_api", "extension_api"):
            group, sep, version = getattr(self, name).partition("/")
            if not sep or not group or not version:
                raise ValueError(f"{name} must look like group/version")
        return self


class RayDiscoverySettings(_Strict):
    """Model-server replicas of a Ray Serve application (deploy/ray, docs/backends.md)."""

    kind: Literal["ray"]
    app: str | None = None
    """The Serve application holding the registry; None = the gateway replica's own."""
    registry: str = Field("ReplicaRegistry", min_length=1)
    """The registry deployment the model-server replicas report their addresses to."""
    poll_interval_s: float = Field(1.0, gt=0)
    request_timeout_s: float = Field(5.0, gt=0)


DiscoverySettings = Annotated[
    StaticDiscoverySettings | KubernetesDiscoverySettings | RayDiscoverySettings,
    Field(discriminator="kind"),
]
