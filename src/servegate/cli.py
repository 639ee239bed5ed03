"""The `servegate` command: serve, sim, demo, bench, config check."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer

from servegate.config import ConfigError, ServegateConfig, load_config

app = typer.Typer(
    name="servegate",
    help="An OpenAI-compatible LLM gateway that picks the best model-server replica.",
    no_args_is_help=True,
    add_completion=False,
)
config_app = typer.Typer(help="Configuration tools.", no_args_is_help=True)
app.add_typer(config_app, name="config")


def _overrides(
    endpoints: list[str] | None,
    host: str | None,
    port: int | None,
    model: str | None,
    picker: Path | None,
    debug_headers: bool | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gateway: dict[str, Any] = {}
    if host is not None:
        gateway["host"] = host
    if port is not None:
        gateway["port"] = port
    if debug_headers is not None:
        gateway["debug_headers"] = debug_headers
    if gateway:
        out["gateway"] = gateway
    if endpoints:
        eps: list[dict[str, Any]] = []
        for url in endpoints:
            ep: dict[str, Any] = {"url": url}
            if model:
                ep["model"] = model
            eps.append(ep)
        out["pool"] = {"endpoints": eps}
    if picker is not None:
        out["picker"] = str(picker)
    return out


def _load(config: Path | None, overrides: dict[str, Any]) -> ServegateConfig:
    try:
        return load_config(config, overrides=overrides)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command()
def serve(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file.")] = None,
    endpoint: Annotated[
        list[str] | None,
        typer.Option(
            "--endpoint", "-e", help="Model-server URL (repeatable); replaces the config's."
        ),
    ] = None,
    host: Annotated[str | None, typer.Option(help="Listen address.")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port.")] = None,
    model: Annotated[
        str | None,
        typer.Option(help="Model served by --endpoint URLs (default: ask each replica)."),
    ] = None,
    picker: Annotated[Path | None, typer.Option(help="EndpointPickerConfig YAML file.")] = None,
    debug_headers: Annotated[
        bool | None, typer.Option("--debug-headers/--no-debug-headers")
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(help="Gateway processes on one port (SO_REUSEPORT), supervised."),
    ] = None,
) -> None:
    """Run the gateway."""
    from servegate.gateway.access_log import configure_logging
    from servegate.gateway.reload import ConfigSource
    from servegate.gateway.server import run

    overrides = _overrides(endpoint, host, port, model, picker, debug_headers)
    if workers is not None:
        overrides["scaleout"] = {"workers": workers}
    cfg = _load(config, overrides)
    configure_logging(cfg.log_level)
    source = ConfigSource(config, overrides) if config is not None else None
    try:
        if cfg.scaleout.workers > 1:
            from servegate.scaleout.supervisor import supervise

            raise typer.Exit(supervise(cfg, config.parent if config else None, source))
        run(cfg, config.parent if config else None, source)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    except Exception as exc:
        from servegate.scheduling.config import PickerConfigError

        if isinstance(exc, PickerConfigError):
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        raise


@config_app.command("check")
def config_check(
    file: Annotated[Path, typer.Argument(help="servegate YAML config file.")],
) -> None:
    """Validate a config file (including its picker config) and print the resolved form."""
    from servegate.gateway.app import build_gateway
    from servegate.scheduling.config import PickerConfigError

    cfg = _load(file, {})
    try:
        gw = build_gateway(cfg, file.parent)
    except (ConfigError, PickerConfigError, KeyError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    resolved = cfg.model_dump(mode="json")
    for name in ("api_keys", "admin_keys"):  # keys are never printed (tenants' are secrets)
        resolved["gateway"][name] = ["**********"] * len(resolved["gateway"][name])
    resolved["resolved_profiles"] = gw.scheduler.describe()
    sys.stdout.write(orjson.dumps(resolved, option=orjson.OPT_INDENT_2).decode() + "\n")


def _register_optional() -> None:
    """Subcommands owned by other packages, registered in one place."""
    from servegate.bench.cli import bench_command
    from servegate.demo import demo_command
    from servegate.extproc.cli import extproc_command
    from servegate.simulator.cli import sim_command

    app.command("sim", help="Run simulated vLLM-compatible model servers.")(sim_command)
    app.command("bench", help="Compare routers and routing policies on one workload.")(
        bench_command
    )
    app.command(
        "demo", help="Round-robin against servegate's default on a simulated cluster, side by side."
    )(demo_command)
    app.command(
        "extproc", help="Serve Envoy ext_proc as a Gateway API Inference Extension endpoint picker."
    )(extproc_command)


def main() -> None:
    _register_optional()
    app()


if __name__ == "__main__":
    main()
