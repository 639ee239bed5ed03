"""`servegate sim` (and `python -m servegate.simulator`): run simulated model servers.

Options override the YAML file given with `--config`. `--replicas N` runs N
servers in one process on consecutive ports (KV-event TCP ports and Triton
metrics ports move along with them; `ipc://` endpoints get a `-<index>` suffix).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import typer

from servegate.simulator.config import PERSONAS, SimConfig, SimConfigError, load_sim_config
from servegate.simulator.server import run_servers


def sim_command(
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="Simulator YAML file.")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Listen address.")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port (0 = any free port).")] = None,
    model: Annotated[str | None, typer.Option(help="Served model name.")] = None,
    persona: Annotated[
        str | None,
        typer.Option(help=f"Engine to pose as: {', '.join(PERSONAS)}."),
    ] = None,
    role: Annotated[str | None, typer.Option(help="prefill, decode or prefill-decode.")] = None,
    num_blocks: Annotated[int | None, typer.Option(help="KV-cache blocks.")] = None,
    block_size: Annotated[int | None, typer.Option(help="Tokens per KV block.")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Concurrent sequences.")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Context length.")] = None,
    speed: Annotated[float | None, typer.Option(help="Time speed-up factor.")] = None,
    lora: Annotated[
        str | None,
        typer.Option(help="Preloaded LoRA adapters, comma separated (name or name=path)."),
    ] = None,
    max_loras: Annotated[int | None, typer.Option(help="LoRA slots.")] = None,
    kv_events_endpoint: Annotated[
        str | None,
        typer.Option(help="ZMQ PUB endpoint for KV events, e.g. tcp://*:5557 or ipc:///tmp/kv."),
    ] = None,
    kv_events_encoding: Annotated[str | None, typer.Option(help="map or array.")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Triton persona metrics port.")] = None,
    startup_delay: Annotated[
        float | None, typer.Option(help="Seconds before /health turns 200.")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed.")] = None,
    replicas: Annotated[int, typer.Option(min=1, help="Servers on consecutive ports.")] = 1,
) -> None:
    """Run simulated vLLM-compatible model servers until Ctrl-C."""
    overrides: dict[str, Any] = {}
    for key, value in (
        ("host", host),
        ("port", port),
        ("model", model),
        ("persona", persona),
        ("role", role),
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("max_num_seqs", max_num_seqs),
        ("max_model_len", max_model_len),
        ("speed", speed),
        ("metrics_port", metrics_port),
        ("seed", seed),
    ):
        if value is not None:
            overrides[key] = value
    lora_settings: dict[str, Any] = {}
    if lora:
        lora_settings["adapters"] = [a.strip() for a in lora.split(",") if a.strip()]
    if max_loras is not None:
        lora_settings["max_loras"] = max_loras
    if lora_settings:
        overrides["lora"] = lora_settings
    kv: dict[str, Any] = {}
    if kv_events_endpoint:
        kv["endpoint"] = kv_events_endpoint
    if kv_events_encoding:
        kv["encoding"] = kv_events_encoding
    if kv:
        overrides["kv_events"] = kv
    faults: dict[str, Any] = {"crash_exits_process": replicas == 1}
    if startup_delay is not None:
        faults["startup_delay_s"] = startup_delay
    overrides["faults"] = faults
    try:
        base = load_sim_config(config, overrides)
        configs = replica_configs(base, replicas)
    except SimConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    run_blocking(configs)


def replica_configs(base: SimConfig, replicas: int) -> list[SimConfig]:
    """`replicas` configs on consecutive ports (port 0 stays 0: each picks its own)."""
    out = []
    for i in range(replicas):
        changes: dict[str, Any] = {"seed": base.seed + i}
        if base.port:
            changes["port"] = base.port + i
        if base.metrics_port:
            changes["metrics_port"] = base.metrics_port + i
        endpoint = base.kv_events.endpoint
        if endpoint is not None and i:
            kv = base.kv_events.model_dump()
            kv["endpoint"] = offset_endpoint(endpoint, i)
            if base.kv_events.replay_endpoint:
                kv["replay_endpoint"] = offset_endpoint(base.kv_events.replay_endpoint, i)
            changes["kv_events"] = kv
        out.append(base.with_overrides(**changes))
    return out


def offset_endpoint(endpoint: str, index: int) -> str:
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        if port.isdigit() and int(port) != 0:
            return f"{head}:{int(port) + index}"
        return endpoint
    return f"{endpoint}-{index}"


def run_blocking(configs: list[SimConfig]) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(run_servers(configs))
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run_servers(configs))


def main() -> None:
    typer.run(sim_command)
