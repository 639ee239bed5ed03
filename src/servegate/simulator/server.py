"""Running simulated servers: sockets, lifecycle, crash, several in one event loop.

`SimServer` binds its socket(s) first, so a config with port 0 learns its real
port before the app starts (the KV-event topic and P/D `remote_port` carry it).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
from collections.abc import Sequence

from aiohttp import web

from servegate.simulator.app import build_app, build_metrics_app
from servegate.simulator.config import SimConfig
from servegate.simulator.engine import Engine
from servegate.simulator.kv_events import ZmqEventPublisher
from servegate.simulator.state import SimState

log = logging.getLogger("servegate.simulator")

CRASH_EXIT_CODE = 70


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class SimServer:
    """One simulated model server on its own port(s) in the running event loop."""

    def __init__(self, cfg: SimConfig) -> None:
        self.requested = cfg
        self.cfg = cfg
        self.state: SimState | None = None
        self._sock: socket.socket | None = None
        self._metrics_sock: socket.socket | None = None
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._sites: list[web.BaseSite] = []
        self._listen_task: asyncio.Task[None] | None = None

    # -- addresses ---------------------------------------------------------------

    @property
    def port(self) -> int:
        return self.cfg.port

    @property
    def address(self) -> str:
        """`host:port`, as a gateway names the endpoint."""
        return f"{self.cfg.host}:{self.cfg.port}"

    @property
    def url(self) -> str:
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return f"http://{host}:{self.cfg.port}"

    @property
    def metrics_url(self) -> str:
        spec = self._state.persona
        if spec.metrics_on_own_port:
            assert self.cfg.metrics_port is not None
            return f"http://{self.cfg.host}:{self.cfg.metrics_port}{spec.metrics_path}"
        return self.url + spec.metrics_path

    @property
    def health_url(self) -> str:
        return self.url + self._state.persona.health_path

    @property
    def engine(self) -> Engine:
        return self._state.engine

    @property
    def publisher(self) -> ZmqEventPublisher | None:
        return self._state.publisher

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where a subscriber connects (`tcp://127.0.0.1:P` or `ipc://...`)."""
        pub = self.publisher
        if pub is None:
            return None
        return pub.endpoint.replace("0.0.0.0", "127.0.0.1").replace("[::]", "127.0.0.1")

    @property
    def kv_events_topic(self) -> str | None:
        return None if self.publisher is None else self.publisher.topic

    @property
    def _state(self) -> SimState:
        if self.state is None:
            raise RuntimeError("the server is not started")
        return self.state

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> SimServer:
        cfg = self.requested
        self._sock = _bind(cfg.host, cfg.port)
        changes: dict[str, object] = {"port": self._sock.getsockname()[1]}
        if cfg.persona == "triton-tensorrt-llm":
            metrics_port = 8002 if cfg.metrics_port is None else cfg.metrics_port
            self._metrics_sock = _bind(cfg.host, metrics_port)
            changes["metrics_port"] = self._metrics_sock.getsockname()[1]
        self.cfg = cfg.with_overrides(**changes)
        state = SimState(self.cfg)
        state.crash_hooks.append(self._on_crash)
        self.state = state
        state.engine.advertise(self.cfg.host, self.cfg.port)
        self._runner = web.AppRunner(
            build_app(self.cfg, state=state),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=0.5,
        )
        try:
            await self._runner.setup()
            if self._metrics_sock is not None:
                self._metrics_runner = web.AppRunner(
                    build_metrics_app(state), access_log=None, shutdown_timeout=0.5
                )
                await self._metrics_runner.setup()
                await self._start_site(self._metrics_runner, self._metrics_sock)
            delay = self.cfg.faults.startup_delay_s
            if delay > 0 and not self.cfg.faults.startup_listen:
                self._listen_task = asyncio.get_running_loop().create_task(
                    self._listen_later(delay)
                )
            else:
                await self._start_site(self._runner, self._sock)
        except BaseException:
            await self.stop()
            raise
        log.info("simulated %s server for %s on %s", self.cfg.persona, self.cfg.model, self.url)
        return self

    async def _start_site(self, runner: web.AppRunner, sock: socket.socket) -> None:
        site = web.SockSite(runner, sock)
        await site.start()
        self._sites.append(site)

    async def _listen_later(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._runner is not None and self._sock is not None and not self._state.crashed:
            await self._start_site(self._runner, self._sock)

    async def stop(self) -> None:
        if self._listen_task is not None:
            self._listen_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listen_task
            self._listen_task = None
        for runner in (self._runner, self._metrics_runner):
            if runner is not None:
                await runner.cleanup()
        self._runner = self._metrics_runner = None
        self._sites = []
        for sock in (self._sock, self._metrics_sock):
            if sock is not None:
                sock.close()
        self._sock = self._metrics_sock = None

    async def __aenter__(self) -> SimServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- faults --------------------------------------------------------------------

    def crash(self, exit_process: bool = False) -> None:
        """Close every connection abruptly and stop listening (or exit the process)."""
        self._state.crash(exit_process)

    def _on_crash(self, exit_process: bool) -> None:
        for runner in (self._runner, self._metrics_runner):
            if runner is None or runner.server is None:
                continue
            for handler in runner.server.connections:
                transport = handler.transport
                if transport is not None:
                    transport.abort()
        for sock in (self._sock, self._metrics_sock):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for site in self._sites:
            server = getattr(site, "_server", None)
            if server is not None:
                server.close()
        if exit_process:
            os._exit(CRASH_EXIT_CODE)


async def run_servers(configs: Sequence[SimConfig], stop: asyncio.Event | None = None) -> None:
    """Run servers until `stop` is set, or until SIGINT/SIGTERM when `stop` is None."""
    stop = stop or _signal_event()
    servers: list[SimServer] = []
    try:
        for cfg in configs:
            servers.append(await SimServer(cfg).start())
        for server in servers:
            extra = ""
            if server.publisher is not None:
                extra = f" kv-events {server.kv_events_endpoint} topic {server.kv_events_topic}"
            print(
                f"servegate sim: {server.cfg.persona} '{server.cfg.model}' on {server.url} "
                f"(metrics {server.metrics_url}){extra}",
                flush=True,
            )
        gc.freeze()
        await stop.wait()
    finally:
        for server in reversed(servers):
            await server.stop()


def _signal_event() -> asyncio.Event:
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, event.set)
    return event
