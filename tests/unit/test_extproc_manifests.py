"""deploy/extproc: the Envoy config is a valid Envoy bootstrap, the manifests agree with each other
and with servegate's own config loader."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import yaml
from envoy.config.bootstrap.v3.bootstrap_pb2 import Bootstrap
from google.protobuf import json_format

from servegate.config import ServegateConfig, parse_config
from servegate.extproc.protocol import DESTINATION_KEY, DESTINATION_NAMESPACE, SUBSET_NAMESPACE
from servegate.gateway.app import build_gateway

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "extproc"
TYPED_CONFIG_MODULES = (
    "envoy.extensions.filters.network.http_connection_manager.v3.http_connection_manager_pb2",
    "envoy.extensions.filters.http.ext_proc.v3.ext_proc_pb2",
    "envoy.extensions.filters.http.router.v3.router_pb2",
    "envoy.extensions.upstreams.http.v3.http_protocol_options_pb2",
    "envoy.extensions.load_balancing_policies.override_host.v3.override_host_pb2",
    "envoy.extensions.load_balancing_policies.round_robin.v3.round_robin_pb2",
)


def load_all(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def envoy_bootstrap() -> Any:
    for module in TYPED_CONFIG_MODULES:
        importlib.import_module(module)
    doc = yaml.safe_load((DEPLOY / "envoy.yaml").read_text())
    return json_format.ParseDict(doc, Bootstrap())


def test_envoy_config_is_a_valid_bootstrap_with_full_duplex_ext_proc() -> None:
    from envoy.extensions.filters.http.ext_proc.v3.ext_proc_pb2 import ExternalProcessor
    from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )

    bootstrap = envoy_bootstrap()
    hcm = hcm_pb2.HttpConnectionManager()
    bootstrap.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    ext_proc = ExternalProcessor()
    hcm.http_filters[0].typed_config.Unpack(ext_proc)
    mode = ext_proc.processing_mode
    assert (mode.request_body_mode, mode.response_body_mode) == (
        ProcessingMode.FULL_DUPLEX_STREAMED,
        ProcessingMode.FULL_DUPLEX_STREAMED,
    )
    assert (mode.request_trailer_mode, mode.response_trailer_mode) == (
        ProcessingMode.SEND,
        ProcessingMode.SEND,
    )
    assert list(ext_proc.metadata_options.receiving_namespaces.untyped) == [DESTINATION_NAMESPACE]
    assert SUBSET_NAMESPACE in ext_proc.metadata_options.forwarding_namespaces.untyped
    assert not ext_proc.failure_mode_allow
    assert hcm.http_filters[-1].name == "envoy.filters.http.router"
    retries = hcm.route_config.virtual_hosts[0].routes[0].route.retry_policy.num_retries.value
    assert retries == ServegateConfig().gateway.max_retries


def test_envoy_pool_cluster_reads_the_destination_header_and_metadata() -> None:
    from envoy.extensions.load_balancing_policies.override_host.v3.override_host_pb2 import (
        OverrideHost,
    )

    clusters = {c.name: c for c in envoy_bootstrap().static_resources.clusters}
    picker = clusters["servegate_picker"]
    address = picker.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address
    assert address.socket_address.port_value == ServegateConfig().extproc.port
    override = OverrideHost()
    policy = clusters["servegate_pool"].load_balancing_policy.policies[0]
    policy.typed_extension_config.typed_config.Unpack(override)
    header, metadata = override.override_host_sources
    assert header.header == DESTINATION_KEY
    assert metadata.metadata.key == DESTINATION_NAMESPACE
    assert [p.key for p in metadata.metadata.path] == [DESTINATION_KEY]


def test_picker_config_map_loads_with_servegates_strict_loader() -> None:
    docs = load_all("picker.yaml")
    text = by_kind(docs, "ConfigMap")["data"]["servegate.yaml"]
    config = parse_config(text, "picker.yaml", environ={})
    gw = build_gateway(config)
    assert gw.scheduler.describe()["schedulingProfiles"][0]["name"] == "default"
    service_ports = {p["name"]: p["port"] for p in by_kind(docs, "Service")["spec"]["ports"]}
    assert service_ports == {
        "grpc-ext-proc": config.extproc.port,
        "http-metrics": config.extproc.metrics_port,
    }
    container = by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "extproc"
    probes = {container[p]["grpc"]["service"] for p in ("livenessProbe", "readinessProbe")}
    assert probes == {"liveness", "readiness"}
    assert {container[p]["grpc"]["port"] for p in ("livenessProbe", "readinessProbe")} == {
        config.extproc.health_port
    }


def test_inference_pool_points_at_the_picker_and_the_route_at_the_pool() -> None:
    (pool,) = load_all("inferencepool.yaml")
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    picker_service = by_kind(load_all("picker.yaml"), "Service")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == picker_service["metadata"]["name"]
    assert ref["port"]["number"] == 9002
    assert ref["failureMode"] in ("FailClose", "FailOpen")
    assert 1 <= len(pool["spec"]["targetPorts"]) <= 8
    route = by_kind(load_all("httproute.yaml"), "HTTPRoute")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])
    config = parse_config(
        by_kind(load_all("picker.yaml"), "ConfigMap")["data"]["servegate.yaml"], environ={}
    )
    assert config.pool.discovery.model_dump().get("inference_pool") == pool["metadata"]["name"]
