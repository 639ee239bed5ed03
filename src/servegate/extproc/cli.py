"""`servegate extproc`: run the endpoint picker for an Envoy-based Gateway API Inference Extension."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from servegate.config import ConfigError, load_config


def _overrides(
    endpoints: list[str] | None,
    model: str | None,
    picker: Path | None,
    host: str | None,
    ports: dict[str, int | None],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    extproc: dict[str, Any] = {k: v for k, v in ports.items() if v is not None}
    if host is not None:
        extproc["host"] = host
    if extproc:
        out["extproc"] = extproc
    if endpoints:
        out["pool"] = {
            "endpoints": [{"url": url, **({"model": model} if model else {})} for url in endpoints]
        }
    if picker is not None:
        out["picker"] = str(picker)
    return out


def extproc_command(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file.")] = None,
    endpoint: Annotated[
        list[str] | None,
        typer.Option(
            "--endpoint", "-e", help="Model-server URL (repeatable); replaces the config's."
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(help="Model served by --endpoint URLs (default: ask each replica)."),
    ] = None,
    picker: Annotated[Path | None, typer.Option(help="EndpointPickerConfig YAML file.")] = None,
    host: Annotated[str | None, typer.Option(help="Listen address for all three ports.")] = None,
    port: Annotated[int | None, typer.Option(help="ext_proc gRPC port (9002).")] = None,
    health_port: Annotated[int | None, typer.Option(help="gRPC health port (9003).")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus port (9090).")] = None,
) -> None:
    """Serve Envoy's ext_proc protocol as a Gateway API Inference Extension endpoint picker."""
    from servegate.extproc.server import run
    from servegate.gateway.access_log import configure_logging
    from servegate.scheduling.config import PickerConfigError

    ports = {"port": port, "health_port": health_port, "metrics_port": metrics_port}
    try:
        cfg = load_config(config, overrides=_overrides(endpoint, model, picker, host, ports))
        configure_logging(cfg.log_level)
        run(cfg, config.parent if config else None)
    except (ConfigError, PickerConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
