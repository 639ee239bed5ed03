"""deploy/extproc: the Envoy config is a valid Envoy bootstrap, the manifests agree with each other
and with servegate's own config loader."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.bootstrap.v3.bootstrap_pb2 import Bootstrap
from google.protobuf import json_format

from servegate.config import ServegateConfig, parse_config
from servegate.extproc.protocol import (
    DESTINATION_KEY,
    DESTINATION_NAMESPACE,
    SUBSET_NAMESPACE,
    Modes,
    read_modes,
)
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


ENVOY_CONFIGS = ("envoy-buffered.yaml", "envoy.yaml")


def envoy_bootstrap(name: str = "envoy-buffered.yaml") -> Any:
    for module in TYPED_CONFIG_MODULES:
        importlib.import_module(module)
    doc = yaml.safe_load((DEPLOY / name).read_text())
    return json_format.ParseDict(doc, Bootstrap())


# ProcessingMode: HeaderSendMode SEND 1, SKIP 2; BodySendMode NONE 0, BUFFERED 2,
# FULL_DUPLEX_STREAMED 4 (full duplex needs trailers sent both ways)
@pytest.mark.parametrize(
    ("name", "bodies", "trailers", "modes"),
    [
        pytest.param("envoy-buffered.yaml", (2, 0), (2, 2), Modes(True, False), id="buffered"),
        pytest.param("envoy.yaml", (4, 4), (1, 1), Modes(False, True), id="duplex"),
    ],
)
def test_envoy_config_is_a_valid_bootstrap_with_ext_proc_modes_the_picker_speaks(
    name: str, bodies: tuple[int, int], trailers: tuple[int, int], modes: Modes
) -> None:
    from envoy.extensions.filters.http.ext_proc.v3.ext_proc_pb2 import ExternalProcessor
    from envoy.extensions.filters.network.http_connection_manager.v3 import (
        http_connection_manager_pb2 as hcm_pb2,
    )
    from envoy.service.ext_proc.v3.external_processor_pb2 import (
        ProcessingRequest,
        ProtocolConfiguration,
    )

    bootstrap = envoy_bootstrap(name)
    hcm = hcm_pb2.HttpConnectionManager()
    bootstrap.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    ext_proc = ExternalProcessor()
    hcm.http_filters[0].typed_config.Unpack(ext_proc)
    mode = ext_proc.processing_mode
    assert (mode.request_header_mode, mode.response_header_mode) == (1, 1)
    assert (mode.request_body_mode, mode.response_body_mode) == bodies
    assert (mode.request_trailer_mode, mode.response_trailer_mode) == trailers
    # what Envoy announces with these modes is what the picker reads
    announced = ProtocolConfiguration(
        request_body_mode=mode.request_body_mode, response_body_mode=mode.response_body_mode
    )
    assert read_modes(ProcessingRequest(protocol_config=announced)) == modes
    if modes.buffered_request:  # Envoy answers 413 to a body over its buffer, not servegate
        limit = bootstrap.static_resources.listeners[0].per_connection_buffer_limit_bytes.value
        assert limit >= ServegateConfig().gateway.max_body_bytes
    assert list(ext_proc.metadata_options.receiving_namespaces.untyped) == [DESTINATION_NAMESPACE]
    assert SUBSET_NAMESPACE in ext_proc.metadata_options.forwarding_namespaces.untyped
    assert not ext_proc.failure_mode_allow
    assert hcm.http_filters[-1].name == "envoy.filters.http.router"
    retries = hcm.route_config.virtual_hosts[0].routes[0].route.retry_policy.num_retries.value
    assert retries == ServegateConfig().gateway.max_retries


@pytest.mark.parametrize("name", ENVOY_CONFIGS)
def test_envoy_pool_cluster_reads_the_destination_header_and_metadata(name: str) -> None:
    from envoy.extensions.load_balancing_policies.override_host.v3.override_host_pb2 import (
        OverrideHost,
    )

    clusters = {c.name: c for c in envoy_bootstrap(name).static_resources.clusters}
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
