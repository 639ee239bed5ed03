"""The Grafana dashboard loads both ways Grafana loads dashboards, and its queries parse.

- File provisioning (the ConfigMap, through Grafana's sidecar or deploy/monitoring/grafana)
  resolves no `__inputs`, so every panel, target and query variable takes its datasource
  from the dashboard's own `datasource` variable; a `${DS_...}` left over would be
  "Datasource not found" in every panel.
- UI import then needs nothing filled in either: the variable picks a Prometheus.
- Every PromQL expression parses with the real `promtool` (as recording rules, checked
  offline with `promtool check rules`), after Grafana's variables are substituted.
tests/deploy/test_prometheus.py runs the same expressions against a live Prometheus.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.render import build
from tests.deploy.test_prometheus import tool

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "monitoring" / "dashboards" / "servegate.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__range_s", "__interval_ms"}
SUBSTITUTE = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1h",
    "$namespace": "servegate",
    "$pool": "llm-pool",
}
VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")


def load() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


def substitute(expr: str) -> str:
    for name in sorted(SUBSTITUTE, key=len, reverse=True):
        expr = expr.replace(name, SUBSTITUTE[name])
    return expr


def test_datasource_namespace_and_pool_variables_exist() -> None:
    variables = {v["name"]: v for v in load()["templating"]["list"]}
    datasource = variables["datasource"]
    assert datasource["type"] == "datasource"
    assert datasource["query"] == "prometheus"
    for name, label in (("namespace", "namespace"), ("pool", "name")):
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["datasource"] == DATASOURCE
        assert variable["multi"] is True and variable["includeAll"] is True
        assert variable["query"]["query"].startswith("label_values(")
        assert variable["query"]["query"].rstrip(")").endswith(f", {label}")
    assert '$namespace"' in variables["pool"]["query"]["query"]


def test_nothing_needs_an_import_input() -> None:
    dashboard = load()
    assert "__inputs" not in dashboard
    assert "${DS_" not in DASHBOARD.read_text()


def test_every_panel_and_target_uses_the_datasource_variable() -> None:
    dashboard = load()
    data_panels = [p for p in panels(dashboard) if p["type"] != "row"]
    assert data_panels
    for panel in data_panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
    for panel in panels(dashboard):
        if panel["type"] == "row":
            assert "targets" not in panel and "datasource" not in panel


def test_every_variable_used_is_defined() -> None:
    dashboard = load()
    defined = {v["name"] for v in dashboard["templating"]["list"]} | GRAFANA_BUILTINS
    used = set()
    for text in [
        *expressions(dashboard),
        *(v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"),
    ]:
        used |= set(VARIABLE.findall(text))
    assert used <= defined, used - defined
    assert {"namespace", "pool", "__rate_interval"} <= used


def test_every_query_is_scoped_to_the_namespace_variable() -> None:
    for expr in expressions(load()):
        selectors = re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*\{([^}]*)\}", expr)
        assert selectors, expr
        for selector in selectors:
            assert 'namespace=~"$namespace"' in selector, expr


def test_panels_fit_the_grid_and_ids_are_unique() -> None:
    dashboard = load()
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]


def test_dashboard_covers_the_asked_panels() -> None:
    titles = " | ".join(p["title"].lower() for p in panels(load()))
    for needle in (
        "requests per second",
        "time to first token",
        "latency",
        "errors by reason",
        "prefix-cache hit rate (engines' own counters)",
        "share of picks per endpoint",
        "score by scorer",
        "scale-out peers",
        "waiting requests per replica",
        "kv-cache utilisation per replica",
        "running requests per replica",
        "pool saturation",
        "flow-control outcomes",
        "flow-control queue",
        "gpu utilisation",
        "gpu memory",
    ):
        assert needle in titles, needle
    exprs = " ".join(expressions(load()))
    for metric in (
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "servegate_endpoint_picks_total",
        "servegate_scheduler_picked_score_sum",
        "inference_objective_request_error_total",
        "inference_extension_flow_control_pool_saturation",
        "DCGM_FI_DEV_GPU_UTIL",
    ):
        assert metric in exprs, metric


def promtool_check_rules(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    rules = {
        "groups": [
            {
                "name": "servegate-dashboard",
                "rules": [
                    {"record": f"servegate_dashboard:expr_{i}", "expr": expr}
                    for i, expr in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules, width=10_000))
    return subprocess.run(
        [tool("promtool"), "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_every_expression_parses_with_promtool(tmp_path: Path) -> None:
    dashboard = load()
    exprs = [substitute(e) for e in expressions(dashboard)]
    exprs += [
        substitute(v["query"]["query"].removeprefix("label_values(").rsplit(",", 1)[0])
        for v in dashboard["templating"]["list"]
        if v["type"] == "query"
    ]
    assert len(exprs) >= 25
    assert not any("$" in e for e in exprs)
    result = promtool_check_rules(exprs, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


@pytest.mark.parametrize(
    "broken",
    ["sum(rate(vllm:prefix_cache_hits_total[5m])", "rate(x[$__rate_interval])", "sum by (pod (x)"],
)
def test_promtool_check_rules_rejects_a_broken_expression(tmp_path: Path, broken: str) -> None:
    assert promtool_check_rules([broken], tmp_path).returncode != 0


def test_the_provisioned_config_map_is_the_dashboard_file() -> None:
    (config_map,) = build(ROOT / "deploy" / "monitoring" / "dashboards")
    assert config_map["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert json.loads(config_map["data"]["servegate.json"]) == load()
