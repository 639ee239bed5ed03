"""compose.yaml and the Dockerfile. Docker cannot run on these machines, so their
structure is checked instead: every command parses with servegate's own CLI, every
mounted file exists and loads, every reference points at a service that exists."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from servegate.cli import _register_optional, app
from servegate.config import parse_config
from servegate.gateway.app import build_gateway

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]


@functools.cache
def cli() -> Any:
    """The click group `servegate` runs (typer may bring its own click; duck-typed)."""
    _register_optional()
    return typer.main.get_command(app)


def test_services() -> None:
    assert set(SERVICES) == {"sim-1", "sim-2", "sim-3", "gateway", "prometheus"}
    for name, service in SERVICES.items():
        assert service.get("image"), name
        for dependency in service.get("depends_on", {}):
            assert dependency in SERVICES, f"{name} depends on unknown {dependency}"


@pytest.mark.parametrize("name", ["sim-1", "sim-2", "sim-3", "gateway"])
def test_servegate_services_parse_with_the_cli_and_run_hardened(name: str) -> None:
    service = SERVICES[name]
    command = service["command"]
    group = cli()
    sub = group.get_command(group.make_context("servegate", [command[0]]), command[0])
    assert sub is not None, f"servegate has no `{command[0]}` command"
    sub.make_context(command[0], list(command[1:]))  # raises on an unknown option or bad value
    assert service["read_only"] is True
    assert service["user"].split(":")[0] != "0"
    assert "healthcheck" in service


def test_only_one_service_builds_the_image() -> None:
    builders = [n for n, s in SERVICES.items() if "build" in s]
    assert builders == ["sim-1"]
    assert (ROOT / SERVICES["sim-1"]["build"] / "Dockerfile").exists()


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    out = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        path = (ROOT / source).resolve()
        assert path.exists(), source
        out[target] = path
    return out


def test_gateway_config_loads_with_its_mounted_picker(tmp_path: Path) -> None:
    mounts = _mounts(SERVICES["gateway"])
    etc = tmp_path / "etc"
    etc.mkdir()
    for target, source in mounts.items():
        assert target.startswith("/etc/servegate/")
        shutil.copy(source, etc / Path(target).name)
    cfg = parse_config((etc / "config.yaml").read_text(), "config.yaml", environ={})
    build_gateway(cfg, etc)
    hosts = {e.url for e in cfg.pool.endpoints}
    assert hosts == {f"http://{s}:8000" for s in ("sim-1", "sim-2", "sim-3")}
    assert "8080:8080" in SERVICES["gateway"]["ports"]
    assert cfg.gateway.port == 8080


def test_prometheus_scrapes_the_services_on_their_ports() -> None:
    mounts = _mounts(SERVICES["prometheus"])
    config = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    targets = {
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    ports = {"gateway": "8080", **{f"sim-{i}": "8000" for i in (1, 2, 3)}}
    assert targets == {f"{host}:{port}" for host, port in ports.items()}
    for name in ("sim-1", "sim-2", "sim-3"):
        assert SERVICES[name]["command"][SERVICES[name]["command"].index("--port") + 1] == "8000"


def test_dockerfile_is_slim_and_non_root() -> None:
    lines = [
        line.strip()
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    stages = [line for line in lines if line.startswith("FROM ")]
    assert len(stages) == 2 and all("-slim" in s for s in stages)
    final = lines[lines.index(stages[-1]) :]
    (user,) = [line for line in final if line.startswith("USER ")]
    assert user.split()[1].split(":")[0] not in ("0", "root")
    assert 'ENTRYPOINT ["servegate"]' in final
    for line in lines:
        if line.startswith("COPY ") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
