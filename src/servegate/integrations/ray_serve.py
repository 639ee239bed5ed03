"""servegate on Ray Serve: the gateway and a pool of model-server replicas as one application.

Three deployments:

* `ModelServer` — each replica runs one engine (the simulator in-process, or any
  command such as `vllm serve` as a child process) on a port of its node, and
  keeps a lease on its address in the registry.
* `ReplicaRegistry` — one replica holding those leases (`pool.discovery.kind: ray`
  reads it).
* `Gateway` — the ingress: servegate's gateway in the replica, behind Serve's
  HTTP proxy (`asgi_gateway`); it routes across the model servers by their own
  scraped metrics, since Serve's proxy would only spread requests blindly.

The gateway talks to the engines directly, so Serve's count of ongoing requests
never sees that load. Each model server therefore reports its engine's own
running + waiting requests (`record_autoscaling_stats`), and `engine_load_policy`
sizes the deployment on that sum against `target_ongoing_requests`; Serve still
applies `min_replicas`/`max_replicas` and the up/down-scale delays.

Ray is imported only when a function here runs, never at import time, so the
package imports (and type-checks) where Ray is not installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import aiohttp
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from servegate.datalayer.metrics_parser import MetricsParser
from servegate.engines.registry import builtin_engines
from servegate.pool.discovery.ray import ReplicaRecord, ReplicaRegistry
from servegate.simulator.config import parse_sim_config
from servegate.simulator.server import SimServer

log = logging.getLogger("servegate.integrations")

ENGINE_LOAD_METRIC = "servegate_engine_requests"
"""Running + waiting requests of a replica's engine, as its replica reports them."""
POLICY_PATH = "servegate.integrations.ray_serve:engine_load_policy"
REGISTRY_DEPLOYMENT = "ReplicaRegistry"
_ENGINE_OF_PERSONA = {
    "vllm": "vllm",
    "sglang": "sglang",
    "trtllm-serve": "trtllm",
    "triton-tensorrt-llm": "triton",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SimEngineSettings(_Strict):
    kind: Literal["sim"] = "sim"
    sim: dict[str, Any] = Field(default_factory=dict)
    """Simulator settings (`servegate sim`); host and port are the replica's."""


class CommandEngineSettings(_Strict):
    """Any OpenAI-compatible server started as a child process, e.g. `vllm serve`."""

    kind: Literal["command"]
    argv: tuple[str, ...] = Field(min_length=1)
    """`{host}` and `{port}` are replaced by the replica's address."""
    engine: str = "vllm"
    model: str | None = None
    startup_timeout_s: float = Field(600.0, gt=0)

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        known = builtin_engines()
        if name not in known:
            raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(known))}")
        return name


EngineSettings = Annotated[SimEngineSettings | CommandEngineSettings, Field(discriminator="kind")]


class AutoscalingSettings(_Strict):
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0)
    """Engine requests (running + waiting) per replica that the policy aims for."""
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    metrics_interval_s: float = Field(1.0, gt=0)
    look_back_period_s: float = Field(5.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSettings:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be at least min_replicas")
        return self

    def serve_config(self) -> dict[str, Any]:
        return {**self.model_dump(), "policy": {"policy_function": POLICY_PATH}}


class ModelServerSettings(_Strict):
    engine: EngineSettings = SimEngineSettings()
    host: str | None = None
    """Address the engine binds and is reached at; None = the Ray node's IP."""
    num_replicas: int | None = Field(None, ge=1)
    """A fixed count instead of autoscaling."""
    autoscaling: AutoscalingSettings = AutoscalingSettings()
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})
    heartbeat_s: float = Field(1.0, gt=0)
    """How often a replica renews its lease in the registry."""


class RayAppSettings(_Strict):
    """The `args` of the Serve application (`deploy/ray/serve_config.yaml`)."""

    gateway: dict[str, Any] = Field(default_factory=dict)
    """servegate's config (as in its YAML); `pool.discovery` defaults to `kind: ray`."""
    gateway_replicas: int = Field(1, ge=1)
    gateway_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0})
    gateway_max_ongoing_requests: int = Field(4096, ge=1)
    """Serve's per-replica cap in front of the gateway; the gateway's flow control is the real one."""
    model_server: ModelServerSettings = ModelServerSettings()
    registry_lease_s: float = Field(5.0, gt=0)

    @model_validator(mode="after")
    def _lease_outlives_heartbeat(self) -> RayAppSettings:
        if self.registry_lease_s <= 2 * self.model_server.heartbeat_s:
            raise ValueError("registry_lease_s must exceed twice model_server.heartbeat_s")
        return self

    def gateway_config(self) -> dict[str, Any]:
        doc = dict(self.gateway)
        pool = dict(doc.get("pool") or {})
        pool.setdefault("discovery", {"kind": "ray", "registry": REGISTRY_DEPLOYMENT})
        doc["pool"] = pool
        return doc


def decode_app_settings(args: Mapping[str, Any]) -> RayAppSettings:
    """Strict decoding of the application's args; `ValueError` says which field is wrong."""
    try:
        return RayAppSettings.model_validate(dict(args))
    except ValidationError as exc:
        raise ValueError(f"servegate Ray Serve app args: {exc}") from exc


def engine_load_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Replicas wanted = the engines' reported requests / `target_ongoing_requests`.

    Serve calls this with an `AutoscalingContext` and clamps the answer to the
    deployment's bounds after its delays; before any replica has reported, the
    current target stands.
    """
    per_replica: Mapping[Any, float] = (ctx.aggregated_metrics or {}).get(ENGINE_LOAD_METRIC, {})
    if not per_replica:
        return float(ctx.target_num_replicas), {}
    target = ctx.config.target_ongoing_requests or 1.0
    return sum(per_replica.values()) / target, {}


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ReplicaRegistryDeployment:
    """The registry deployment's class: `ReplicaRegistry` behind Serve handle calls."""

    def __init__(self, lease_s: float) -> None:
        self._registry = ReplicaRegistry(lease_s)

    def register(self, record: dict[str, Any]) -> None:
        self._registry.register(record)

    def deregister(self, replica_id: str) -> None:
        self._registry.deregister(replica_id)

    def snapshot(self) -> list[dict[str, Any]]:
        return self._registry.snapshot()


class ModelServer:
    """One model-server replica: an engine on a port of this node, announced to the registry."""

    async def __init__(self, settings: dict[str, Any], registry: Any) -> None:  # type: ignore[misc]
        self.settings = ModelServerSettings.model_validate(settings)
        self._registry = registry
        serve = importlib.import_module("ray.serve")
        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        host = self.settings.host or importlib.import_module("ray.util").get_node_ip_address()
        self._sim: SimServer | None = None
        self._process: asyncio.subprocess.Process | None = None
        engine = self.settings.engine
        model: str | None
        if isinstance(engine, SimEngineSettings):
            cfg = parse_sim_config({**engine.sim, "host": host, "port": 0})
            self._sim = await SimServer(cfg).start()
            url, name, model = self._sim.url, _ENGINE_OF_PERSONA[cfg.persona], cfg.model
        else:
            port = _free_port(host)
            argv = [a.replace("{host}", host).replace("{port}", str(port)) for a in engine.argv]
            self._process = await asyncio.create_subprocess_exec(*argv)
            url, name, model = _url(host, port), engine.engine, engine.model
        self.record = ReplicaRecord(replica_id=self.replica_id, url=url, engine=name, model=model)
        spec = builtin_engines()[name]
        endpoint = self.record.to_endpoint("ray")
        self._metrics_url = spec.metrics_url(endpoint)
        self._parser = MetricsParser(spec)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        if isinstance(engine, CommandEngineSettings):
            await self._wait_healthy(spec.health_url(endpoint), engine.startup_timeout_s)
        await self._registry.register.remote(self.record.model_dump(mode="json"))
        self._heartbeat = asyncio.get_running_loop().create_task(self._renew())
        log.info("model server replica up", extra={"fields": {"url": url}})

    async def _wait_healthy(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.returncode is not None:
                raise RuntimeError(f"engine exited with code {self._process.returncode}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self._session.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"engine not healthy at {url} after {timeout_s:g}s")

    async def _renew(self) -> None:
        record = self.record.model_dump(mode="json")
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                await self._registry.register.remote(record)
            except Exception as exc:  # the registry restarting: renew at the next beat
                log.warning("lease renewal failed: %s", exc)

    async def engine_load(self) -> float:
        """Running + waiting requests of this replica's engine, from its own metrics."""
        async with self._session.get(self._metrics_url) as resp:
            text = await resp.text()
        metrics = self._parser.parse(text, time.monotonic()).metrics
        return metrics.running + metrics.waiting

    async def record_autoscaling_stats(self) -> dict[str, float]:
        try:
            return {ENGINE_LOAD_METRIC: await self.engine_load()}
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("engine metrics not readable: %s", exc)
            return {}

    def address(self) -> str:
        return self.record.url

    def check_health(self) -> None:
        if self._process is not None and self._process.returncode is not None:
            raise RuntimeError(f"engine exited with code {self._process.returncode}")

    async def __del__(self) -> None:
        self._heartbeat.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._registry.deregister.remote(self.replica_id), 5)
        await self._session.close()
        if self._sim is not None:
            await self._sim.stop()
        if self._process is not None and self._process.returncode is None:
            self._process.terminate()
            try:
                await asyncio.wait_for(self._process.wait(), 30)
            except TimeoutError:
                self._process.kill()
                await self._process.wait()


class GatewayReplica:
    """The ingress deployment's class; the gateway itself is its ASGI app."""

    def __init__(self, model_servers: Any) -> None:
        self.model_servers = model_servers


def build_app(args: dict[str, Any]) -> Any:
    """The Serve application (`import_path: servegate.integrations.ray_serve:build_app`)."""
    serve = importlib.import_module("ray.serve")
    settings = decode_app_settings(args)
    gateway_doc = settings.gateway_config()
    from servegate.integrations.asgi_gateway import GatewayASGI

    GatewayASGI.from_mapping(gateway_doc)  # a bad gateway config fails here, not in a replica

    def gateway_app() -> GatewayASGI:
        return GatewayASGI.from_mapping(gateway_doc)

    registry = serve.deployment(
        ReplicaRegistryDeployment,
        name=REGISTRY_DEPLOYMENT,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
    ).bind(settings.registry_lease_s)
    ms = settings.model_server
    scaling: dict[str, Any] = (
        {"num_replicas": ms.num_replicas}
        if ms.num_replicas is not None
        else {"autoscaling_config": ms.autoscaling.serve_config()}
    )
    servers = serve.deployment(
        ModelServer, name="ModelServer", ray_actor_options=ms.ray_actor_options, **scaling
    ).bind(ms.model_dump(mode="json"), registry)
    gateway = serve.deployment(
        serve.ingress(gateway_app)(GatewayReplica),
        name="Gateway",
        num_replicas=settings.gateway_replicas,
        max_ongoing_requests=settings.gateway_max_ongoing_requests,
        ray_actor_options=settings.gateway_actor_options,
    )
    # The gateway reaches the registry by name (pool.discovery), not through this
    # argument; binding the servers here makes them part of the application.
    return gateway.bind(servers)


def read_serve_config(path: Path) -> tuple[str, str, dict[str, Any]]:
    """(name, route_prefix, args) of the servegate application in a Serve config file."""
    doc = yaml.safe_load(path.read_text())
    apps = doc.get("applications") if isinstance(doc, dict) else None
    if not isinstance(apps, list):
        raise ValueError(f"{path}: no `applications` list")
    for app in apps:
        if isinstance(app, dict) and str(app.get("import_path", "")).endswith(":build_app"):
            return (
                str(app.get("name", "servegate")),
                str(app.get("route_prefix", "/")),
                dict(app.get("args") or {}),
            )
    raise ValueError(f"{path}: no application with import_path …ray_serve:build_app")


def main(argv: list[str] | None = None) -> int:
    """Run the application on a local Ray started here; stops on SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="python -m servegate.integrations.ray_serve",
        description="servegate's gateway and model servers on a local Ray Serve",
    )
    parser.add_argument("--serve-config", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--num-cpus", type=int, default=4)
    opts = parser.parse_args(argv)
    try:
        name, prefix, args = read_serve_config(opts.serve_config)
        decode_app_settings(args)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ray = importlib.import_module("ray")
    serve = importlib.import_module("ray.serve")
    ray.init(
        address="local",
        num_cpus=opts.num_cpus,
        include_dashboard=False,
        _node_ip_address=opts.host,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": opts.host, "port": opts.port})
        # By module name, not `__main__`: Ray must pickle these classes by reference.
        this = importlib.import_module("servegate.integrations.ray_serve")
        serve.run(this.build_app(args), name=name, route_prefix=prefix, blocking=False)
        print(f"servegate ray: serving on {_url(opts.host, opts.port)}", flush=True)
        stop.wait()
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
