"""From a Pod object (Kubernetes JSON) to the endpoints it serves.

Pure functions over untrusted JSON: a malformed pod yields no endpoints, never
an exception. One endpoint per target port — each port is a data-parallel rank,
which is how an InferencePool's `targetPorts` and llm-d name them. Engine, role
and model come from the `llm-d.ai/*` labels; the KV-events socket from a pod
annotation (a port, or a `tcp://host:port` endpoint) or the configured port,
shifted by the rank as vLLM's data-parallel publishers do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from servegate.pool.discovery.settings import KubernetesDiscoverySettings, LabelSelector
from servegate.pool.endpoint import ENGINE_LABEL, MODEL_LABEL, ROLE_LABEL, Endpoint, Role

_ROLES = {r.value: r for r in Role}


@dataclass(frozen=True, slots=True)
class Target:
    """Which pods and which of their ports; from the settings or an InferencePool."""

    selector: LabelSelector
    ports: tuple[int, ...]


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _str_map(value: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in _mapping(value).items() if isinstance(v, str)}


def pod_name(pod: Mapping[str, Any]) -> str | None:
    name = _mapping(pod.get("metadata")).get("name")
    return name if isinstance(name, str) and name else None


def resource_version(obj: Mapping[str, Any]) -> str | None:
    rv = _mapping(obj.get("metadata")).get("resourceVersion")
    return rv if isinstance(rv, str) and rv else None


def pod_labels(pod: Mapping[str, Any]) -> dict[str, str]:
    return _str_map(_mapping(pod.get("metadata")).get("labels"))


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Running, not terminating, has an IP, and its `Ready` condition is `True`."""
    meta = _mapping(pod.get("metadata"))
    status = _mapping(pod.get("status"))
    if meta.get("deletionTimestamp"):
        return False
    if status.get("phase") != "Running" or not isinstance(status.get("podIP"), str):
        return False
    conditions = status.get("conditions")
    if not isinstance(conditions, Sequence):
        return False
    return any(
        _mapping(c).get("type") == "Ready" and _mapping(c).get("status") == "True"
        for c in conditions
    )


def _kv_endpoint(value: str | None, port: int | None, ip: str, rank: int) -> str | None:
    if value:
        value = value.strip()
        if value.isdigit() and 0 < int(value) + rank <= 65535:
            return f"tcp://{_host(ip)}:{int(value) + rank}"
        parts = urlsplit(value)
        if parts.scheme == "tcp" and parts.hostname and parts.port is not None:
            if parts.hostname in ("*", "0.0.0.0"):
                return f"tcp://{_host(ip)}:{parts.port + rank}"
            return f"tcp://{_host(parts.hostname)}:{parts.port + rank}"
        if rank == 0 and parts.scheme in ("ipc", "tcp"):
            return value
        return None
    if port is not None and port + rank <= 65535:
        return f"tcp://{_host(ip)}:{port + rank}"
    return None


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def pod_endpoints(
    pod: Mapping[str, Any],
    target: Target,
    settings: KubernetesDiscoverySettings,
    pool: str,
) -> tuple[Endpoint, ...]:
    """The endpoints of a ready pod that the target selects; () for any other pod."""
    labels = pod_labels(pod)
    if not is_ready(pod) or not target.selector.matches(labels):
        return ()
    ip = str(_mapping(pod.get("status"))["podIP"])
    annotations = _str_map(_mapping(pod.get("metadata")).get("annotations"))
    engine = labels.get(ENGINE_LABEL) or "vllm"
    role = _ROLES.get(labels.get(ROLE_LABEL, ""), Role.BOTH)
    model = labels.get(MODEL_LABEL) or None
    kv = annotations.get(settings.kv_events_annotation)
    replay = annotations.get(settings.kv_events_replay_annotation)
    out = []
    for rank, port in enumerate(target.ports):
        address = f"{_host(ip)}:{port}"
        out.append(
            Endpoint(
                address=address,
                url=f"{settings.scheme}://{address}",
                engine=engine,
                role=role,
                model=model,
                labels=labels,
                kv_events=_kv_endpoint(kv, settings.kv_events_port, ip, rank),
                kv_events_replay=_kv_endpoint(replay, settings.kv_events_replay_port, ip, rank),
                pool=pool,
            )
        )
    return tuple(out)


def inference_pool_target(obj: Mapping[str, Any]) -> Target:
    """`spec.selector` and `spec.targetPorts` of an InferencePool.

    Accepts v1 (`selector.matchLabels`, `targetPorts: [{number}]`) and the older
    v1alpha2 shape (`selector` as a plain label map, `targetPortNumber`).
    Raises `ValueError` naming the field when the object cannot be used.
    """
    spec = _mapping(obj.get("spec"))
    raw_selector = spec.get("selector")
    if not isinstance(raw_selector, Mapping):
        raise ValueError("InferencePool has no spec.selector")
    if "matchLabels" in raw_selector or "matchExpressions" in raw_selector:
        selector = LabelSelector.model_validate(dict(raw_selector))
    else:
        selector = LabelSelector(match_labels=_str_map(raw_selector))
    if not selector.match_labels and not selector.match_expressions:
        raise ValueError("InferencePool spec.selector selects nothing")
    ports: list[int] = []
    raw_ports = spec.get("targetPorts")
    if isinstance(raw_ports, Sequence) and not isinstance(raw_ports, str):
        for item in raw_ports:
            number = _mapping(item).get("number")
            if isinstance(number, int) and 0 < number <= 65535 and number not in ports:
                ports.append(number)
    elif isinstance(spec.get("targetPortNumber"), int):
        ports.append(spec["targetPortNumber"])
    if not ports:
        raise ValueError("InferencePool has no usable spec.targetPorts")
    return Target(selector=selector, ports=tuple(ports[:8]))
