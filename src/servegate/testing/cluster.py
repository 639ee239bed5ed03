"""Simulated model-server clusters for tests, benchmarks and demos.

`SimCluster` runs N simulators inside the current event loop, on free loopback
ports, and hands out each one's URL, address, config and engine (to assert on
the KV cache or the queue, or to inject faults without HTTP).
`SimClusterProcess` runs each simulator as a `python -m servegate.simulator`
child process instead (so a crash can really kill a process) and always kills
the children on exit.

    async with SimCluster(3, base={"num_blocks": 64}, kv_events="ipc") as cluster:
        url = cluster.urls[0]
        cluster[1].fault("hang")
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, BinaryIO, Generic, Literal, Protocol, TypeVar

import aiohttp
import yaml

from servegate.simulator.config import SimConfig, parse_sim_config
from servegate.simulator.engine import Engine
from servegate.simulator.faults import FaultCommand
from servegate.simulator.server import SimServer
from servegate.simulator.state import SimState

KVTransport = Literal["ipc", "tcp"]
ConfigLike = SimConfig | Mapping[str, Any] | None


def _as_dict(cfg: ConfigLike) -> dict[str, Any]:
    if cfg is None:
        return {}
    if isinstance(cfg, SimConfig):
        return cfg.model_dump()
    return dict(cfg)


def _merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _configs(
    n: int,
    base: ConfigLike,
    overrides: Sequence[Mapping[str, Any]] | None,
    kv_events: KVTransport | None,
    sockdir: str | None,
    host: str,
) -> list[dict[str, Any]]:
    if overrides is not None and len(overrides) != n:
        raise ValueError(f"got {len(overrides)} per-server overrides for {n} servers")
    out = []
    for i in range(n):
        data = _merge({"host": host, "port": 0, "seed": i}, _as_dict(base))
        data["port"] = 0
        if data.get("persona") == "triton-tensorrt-llm":
            data.setdefault("metrics_port", 0)
        if kv_events == "ipc":
            data = _merge(data, {"kv_events": {"endpoint": f"ipc://{sockdir}/kv-{i}.sock"}})
        elif kv_events == "tcp":
            data = _merge(data, {"kv_events": {"endpoint": "tcp://127.0.0.1:0", "bind": True}})
        if overrides is not None:
            data = _merge(data, overrides[i])
        out.append(data)
    return out


class _Server(Protocol):
    @property
    def url(self) -> str: ...

    @property
    def address(self) -> str: ...


S = TypeVar("S", bound=_Server)


class _Servers(Generic[S]):
    """What both cluster kinds answer about their servers."""

    servers: list[S]

    def __getitem__(self, index: int) -> S:
        return self.servers[index]

    def __len__(self) -> int:
        return len(self.servers)

    def __iter__(self) -> Iterator[S]:
        return iter(self.servers)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]


class SimHandle:
    """One in-process simulator of a `SimCluster`."""

    def __init__(self, server: SimServer) -> None:
        self.server = server

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def config(self) -> SimConfig:
        return self.server.cfg

    @property
    def engine(self) -> Engine:
        return self.server.engine

    @property
    def state(self) -> SimState:
        assert self.server.state is not None
        return self.server.state

    @property
    def metrics_url(self) -> str:
        return self.server.metrics_url

    @property
    def health_url(self) -> str:
        return self.server.health_url

    @property
    def kv_events_endpoint(self) -> str | None:
        return self.server.kv_events_endpoint

    @property
    def kv_events_topic(self) -> str | None:
        return self.server.kv_events_topic

    def fault(self, mode: str, duration_s: float | None = None, factor: float = 10.0) -> None:
        """Same as `POST /admin/fault`; `crash` closes connections and stops listening."""
        if mode == "crash":
            self.server.crash(exit_process=False)
            return
        self.state.faults.apply(
            FaultCommand.parse({"mode": mode, "duration_s": duration_s, "factor": factor})
        )


class SimCluster(_Servers[SimHandle]):
    def __init__(
        self,
        n: int = 1,
        *,
        base: ConfigLike = None,
        overrides: Sequence[Mapping[str, Any]] | None = None,
        kv_events: KVTransport | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.n = n
        self._base = base
        self._overrides = overrides
        self._kv_events = kv_events
        self._host = host
        self._sockdir: str | None = None
        self.servers: list[SimHandle] = []

    async def __aenter__(self) -> SimCluster:
        if self._kv_events == "ipc":
            self._sockdir = tempfile.mkdtemp(prefix="sgsim-")
        try:
            for data in _configs(
                self.n, self._base, self._overrides, self._kv_events, self._sockdir, self._host
            ):
                server = SimServer(parse_sim_config(data))
                await server.start()
                self.servers.append(SimHandle(server))
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for handle in reversed(self.servers):
            await handle.server.stop()
        self.servers = []
        if self._sockdir is not None:
            shutil.rmtree(self._sockdir, ignore_errors=True)
            self._sockdir = None

    @property
    def configs(self) -> list[SimConfig]:
        return [s.config for s in self.servers]

    @property
    def engines(self) -> list[Engine]:
        return [s.engine for s in self.servers]


_READY_LINE = re.compile(
    r"servegate sim: .* on (http://\S+) \(metrics (\S+)\)(?: kv-events (\S+) topic (\S+))?"
)


class SimProcess:
    """One simulator child process."""

    def __init__(
        self, proc: asyncio.subprocess.Process, config: dict[str, Any], log_path: str
    ) -> None:
        self.proc = proc
        self.config = config
        self.log_path = log_path
        self.url = ""
        self.metrics_url = ""
        self.kv_events_endpoint: str | None = None
        self.kv_events_topic: str | None = None
        self._drain: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        return self.url.removeprefix("http://")

    @property
    def health_url(self) -> str:
        if self.config.get("persona") == "triton-tensorrt-llm":
            return self.url + "/v2/health/ready"
        return self.url + "/health"

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()


class SimClusterProcess(_Servers[SimProcess]):
    """N simulators as child processes; children are killed on exit, always."""

    def __init__(
        self,
        n: int = 1,
        *,
        base: ConfigLike = None,
        overrides: Sequence[Mapping[str, Any]] | None = None,
        kv_events: KVTransport | None = None,
        host: str = "127.0.0.1",
        startup_timeout: float = 30.0,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.n = n
        self._base = base
        self._overrides = overrides
        self._kv_events = kv_events
        self._host = host
        self._timeout = startup_timeout
        self._python = python
        self._env = env
        self._dir: str | None = None
        self.servers: list[SimProcess] = []

    async def __aenter__(self) -> SimClusterProcess:
        self._dir = tempfile.mkdtemp(prefix="sgsimp-")
        try:
            configs = _configs(
                self.n, self._base, self._overrides, self._kv_events, self._dir, self._host
            )
            for i, data in enumerate(configs):
                parse_sim_config(data)
                self.servers.append(await self._spawn(i, data))
            deadline = time.monotonic() + self._timeout
            for server in self.servers:
                await self._wait_line(server, deadline)
            async with aiohttp.ClientSession() as session:
                for server in self.servers:
                    await _wait_healthy(session, server, deadline)
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _spawn(self, index: int, data: dict[str, Any]) -> SimProcess:
        assert self._dir is not None
        path = os.path.join(self._dir, f"sim-{index}.yaml")
        _write_yaml(path, data)
        log_path = os.path.join(self._dir, f"sim-{index}.log")
        env = {**os.environ, **(self._env or {})}
        with _open_log(log_path) as log:
            proc = await asyncio.create_subprocess_exec(
                self._python,
                "-m",
                "servegate.simulator",
                "--config",
                path,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                env=env,
            )
        return SimProcess(proc, data, log_path)

    async def _wait_line(self, server: SimProcess, deadline: float) -> None:
        stdout = server.proc.stdout
        assert stdout is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"simulator {server.pid} did not start; see {server.log_path}")
            line = await asyncio.wait_for(stdout.readline(), remaining)
            if not line:
                raise RuntimeError(
                    f"simulator exited with {await server.proc.wait()}: {_tail(server.log_path)}"
                )
            match = _READY_LINE.search(line.decode(errors="replace"))
            if match:
                server.url, server.metrics_url = match.group(1), match.group(2)
                server.kv_events_endpoint, server.kv_events_topic = match.group(3), match.group(4)
                server._drain = asyncio.get_running_loop().create_task(_drain(stdout))
                return

    async def close(self) -> None:
        for server in self.servers:
            if server.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    server.proc.terminate()
        for server in self.servers:
            try:
                await asyncio.wait_for(server.proc.wait(), 3.0)
            except TimeoutError:
                server.kill()
                await server.proc.wait()
            if server._drain is not None:
                server._drain.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await server._drain
        self.servers = []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _write_yaml(path: str, data: Mapping[str, Any]) -> None:
    with open(path, "w") as fh:
        yaml.safe_dump(dict(data), fh)


def _open_log(path: str) -> BinaryIO:
    return open(path, "wb")


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


async def _wait_healthy(
    session: aiohttp.ClientSession, server: SimProcess, deadline: float
) -> None:
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(
                server.health_url, timeout=aiohttp.ClientTimeout(total=2)
            ) as resp:
                if resp.status == 200:
                    return
        if server.proc.returncode is not None:
            raise RuntimeError(f"simulator exited: {_tail(server.log_path)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"simulator {server.url} not healthy in time; see {server.log_path}")
        await asyncio.sleep(0.05)


def _tail(path: str, size: int = 2000) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read()[-size:].decode(errors="replace")
    except OSError:
        return ""
