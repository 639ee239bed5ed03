"""A `servegate serve` child process per compared policy.

Each gateway of a comparison runs in its own process, as users run it, so the
load generator's event loop never delays a gateway's and vice versa. The
gateway binds port 0; its port is read from its own structured log line
(`{"msg": "listening", "port": N}` on stderr), so no port is guessed. It is
ready when `/ready` counts every replica; it is stopped with SIGTERM (graceful
drain), then SIGKILL if it lingers. Stdout (the access log) and stderr go to
files beside its config, for reading after the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0


class GatewayStartError(RuntimeError):
    """The gateway exited or did not become ready; the message ends with its log tail."""


class GatewayProcess:
    """`async with GatewayProcess(name, config, workdir) as gw:` — `gw.url` once ready."""

    def __init__(
        self,
        name: str,
        config: dict[str, Any],
        workdir: Path,
        *,
        replicas: int,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        python: str = sys.executable,
    ) -> None:
        self.name = name
        self.config = config
        self.replicas = replicas
        self.config_path = workdir / f"{name}.yaml"
        self.stdout_path = workdir / f"{name}.access.log"
        self.stderr_path = workdir / f"{name}.log"
        self._timeout = startup_timeout_s
        self._python = python
        self._proc: asyncio.subprocess.Process | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> GatewayProcess:
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _start(self) -> None:
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self._proc = await asyncio.create_subprocess_exec(
                self._python,
                "-m",
                "servegate.cli",
                "serve",
                "--config",
                str(self.config_path),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )
        deadline = time.monotonic() + self._timeout
        self.port = await self._wait_listening(deadline)
        await self._wait_ready(deadline)

    async def _wait_listening(self, deadline: float) -> int:
        while time.monotonic() < deadline:
            port = listening_port(self.stderr_path.read_bytes())
            if port is not None:
                return port
            self._check_alive()
            await asyncio.sleep(0.05)
        raise GatewayStartError(f"gateway {self.name} did not start listening: {self.log_tail()}")

    async def _wait_ready(self, deadline: float) -> None:
        last = "no answer"
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                self._check_alive()
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with session.get(
                        self.url + "/ready", timeout=aiohttp.ClientTimeout(total=2)
                    ) as response:
                        body = await response.read()
                        last = body.decode(errors="replace")
                        if orjson.loads(body).get("ready_endpoints") == self.replicas:
                            return
                await asyncio.sleep(0.05)
        raise GatewayStartError(
            f"gateway {self.name} did not see {self.replicas} ready replicas "
            f"(last /ready: {last}): {self.log_tail()}"
        )

    def _check_alive(self) -> None:
        if self._proc is not None and self._proc.returncode is not None:
            raise GatewayStartError(
                f"gateway {self.name} exited with {self._proc.returncode}: {self.log_tail()}"
            )

    def log_tail(self, size: int = 2000) -> str:
        try:
            return self.stderr_path.read_bytes()[-size:].decode(errors="replace")
        except OSError:
            return "(no log)"

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def listening_port(log: bytes) -> int | None:
    """The port of the first `listening` line of a gateway's JSON log, if any."""
    for line in log.splitlines():
        if b'"listening"' not in line:
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(record, dict) or record.get("msg") != "listening":
            continue
        port = record.get("port")
        if isinstance(port, int) and port > 0:
            return port
    return None
