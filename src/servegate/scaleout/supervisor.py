"""`servegate serve --workers N`: N gateway processes on one port, kept alive.

The supervisor reserves the port (SO_REUSEPORT, bound but not listening, so a
port of 0 becomes one real port for all), writes the resolved config where the
workers read it, runs the host's bus hub (and the replica bridge), and starts
the workers. A worker that exits is reported gone on the bus (its in-flight
counts are released at once) and started again after a backoff that doubles
while it keeps dying young. SIGTERM/SIGINT are forwarded and the workers get
`gateway.drain_timeout_s` to finish; SIGHUP is forwarded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servegate.config import ServegateConfig
from servegate.gateway.reload import ConfigSource
from servegate.gateway.server import event_loop_factory
from servegate.scaleout.hub import Hub
from servegate.scaleout.replica import ReplicaLink
from servegate.scaleout.settings import WORKER_ENV, WorkerIdentity
from servegate.scaleout.wiring import default_replica_id

log = logging.getLogger("servegate.supervisor")

HEALTHY_UPTIME_S = 10.0
"""A worker that ran this long resets its restart backoff."""
KILL_GRACE_S = 5.0


def reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock, int(sock.getsockname()[1])


@dataclass(slots=True)
class WorkerSlot:
    index: int
    generation: int = 0
    process: asyncio.subprocess.Process | None = None
    origin: str = ""
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.0


class Supervisor:
    def __init__(
        self,
        config: ServegateConfig,
        config_dir: Path | None,
        source: ConfigSource | None = None,
        python: str = sys.executable,
    ) -> None:
        self.config = config
        self.config_dir = config_dir
        self.source = source
        self.python = python
        self.settings = config.scaleout
        self.replica_id = self.settings.replica_id or default_replica_id()
        self.slots = [WorkerSlot(i) for i in range(self.settings.workers)]
        self.port = 0
        self._stopping = asyncio.Event()
        self._hub: Hub | None = None
        self._directory = ""

    async def run(self, stop: asyncio.Event | None = None) -> int:
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
        gw = self.config.gateway
        reserved, self.port = reserve_port(gw.host, gw.port)
        self._directory = tempfile.mkdtemp(prefix="servegate-")
        config = self.config.model_copy(
            update={"gateway": gw.model_copy(update={"port": self.port})}
        )
        config_path = Path(self._directory) / "config.json"
        config_path.write_text(config.model_dump_json())
        link = ReplicaLink(self.settings) if self.settings.replicates else None
        hub = self._hub = Hub(self._directory, self.replica_id, link)
        watchers: list[asyncio.Task[None]] = []
        try:
            if link is not None:
                await link.start()
            hub.start()
            log.info(
                "supervising %d workers", len(self.slots),
                extra={"fields": {"port": self.port, "replica": self.replica_id}},
            )  # fmt: skip
            for slot in self.slots:
                watchers.append(loop.create_task(self._keep_alive(slot, str(config_path))))
            await stop.wait()
            self._stopping.set()
            await self._terminate()
        finally:
            self._stopping.set()
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            for slot in self.slots:
                if slot.process is not None and slot.process.returncode is None:
                    slot.process.kill()
            await hub.stop()
            reserved.close()
            shutil.rmtree(self._directory, ignore_errors=True)
        return 0

    def _identity(self, slot: WorkerSlot, config_path: str) -> WorkerIdentity:
        assert self._hub is not None
        overrides: dict[str, Any] = {}
        if self.source is not None:
            overrides = dict(self.source.overrides)
            overrides["gateway"] = {**overrides.get("gateway", {}), "port": self.port}
        return WorkerIdentity(
            index=slot.index,
            origin=f"{self.replica_id}/w{slot.index}.{slot.generation}",
            replica_id=self.replica_id,
            hub_in=self._hub.hub_in,
            hub_out=self._hub.hub_out,
            config_path=config_path,
            config_dir=str(self.config_dir) if self.config_dir else None,
            config_file=str(self.source.path) if self.source and self.source.path else None,
            overrides=overrides,
        )

    async def _spawn(self, slot: WorkerSlot, config_path: str) -> asyncio.subprocess.Process:
        slot.generation += 1
        identity = self._identity(slot, config_path)
        env = dict(os.environ)
        env[WORKER_ENV] = identity.to_env()
        process = await asyncio.create_subprocess_exec(
            self.python, "-m", "servegate.scaleout.worker", env=env
        )
        slot.process = process
        slot.origin = identity.origin
        slot.started_at = time.monotonic()
        log.info("worker %d started", slot.index, extra={"fields": {"pid": process.pid}})
        return process

    async def _keep_alive(self, slot: WorkerSlot, config_path: str) -> None:
        base, cap = self.settings.restart_backoff_s, self.settings.restart_backoff_max_s
        while not self._stopping.is_set():
            process = await self._spawn(slot, config_path)
            code = await process.wait()
            if self._stopping.is_set():
                return
            assert self._hub is not None
            self._hub.gone(slot.origin)
            lived = time.monotonic() - slot.started_at
            slot.backoff_s = (
                base if lived >= HEALTHY_UPTIME_S else min(cap, max(base, slot.backoff_s * 2))
            )
            slot.restarts += 1
            log.warning(
                "worker %d (pid %d) exited with %s after %.1fs; restarting in %.1fs",
                slot.index, process.pid, code, lived, slot.backoff_s,
            )  # fmt: skip
            try:
                await asyncio.wait_for(self._stopping.wait(), slot.backoff_s)
            except TimeoutError:
                pass

    def _forward(self, sig: int) -> None:
        for slot in self.slots:
            if slot.process is not None and slot.process.returncode is None:
                slot.process.send_signal(sig)

    async def _terminate(self) -> None:
        self._forward(signal.SIGTERM)
        live = [s.process for s in self.slots if s.process is not None]
        grace = self.config.gateway.drain_timeout_s + KILL_GRACE_S
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in live)), grace)
        except TimeoutError:
            log.warning("workers still running %.0fs after SIGTERM: killing them", grace)
            for process in live:
                if process.returncode is None:
                    process.kill()


def supervise(
    config: ServegateConfig, config_dir: Path | None = None, source: ConfigSource | None = None
) -> int:
    from servegate.gateway.app import build_gateway

    build_gateway(config, config_dir)  # configuration errors surface here, once, not N times
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(Supervisor(config, config_dir, source).run())
