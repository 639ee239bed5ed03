"""A `servegate serve` child process for tests that need a real process: signals, /proc, RSS."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


class SubprocessGateway:
    def __init__(
        self, config: dict[str, Any], ready_endpoints: int, nofile: int | None = None
    ) -> None:
        """`nofile`: the child's file-descriptor limit (RLIMIT_NOFILE), None = inherited."""
        self.nofile = nofile
        self.port = free_port()
        self.config = {**config, "gateway": {**config.get("gateway", {}), "port": self.port}}
        self.config["gateway"].setdefault("host", "127.0.0.1")
        self.ready_endpoints = ready_endpoints
        self._dir = tempfile.TemporaryDirectory(prefix="sg-gw-")
        self.log_path = Path(self._dir.name) / "gateway.log"
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def __aenter__(self) -> SubprocessGateway:
        path = Path(self._dir.name) / "gateway.yaml"
        path.write_text(yaml.safe_dump(self.config))
        with self.log_path.open("wb") as log:
            if self.nofile is None:
                command = [sys.executable, "-m", "servegate.cli"]
            else:
                prelude = (
                    "import resource, runpy, sys; "
                    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({self.nofile}, {self.nofile})); "
                    "sys.argv[0] = 'servegate'; runpy.run_module('servegate.cli', run_name='__main__')"
                )
                command = [sys.executable, "-c", prelude]
            self.proc = await asyncio.create_subprocess_exec(
                *command,
                "serve",
                "--config",
                str(path),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=log,
            )
        try:
            await self._wait_ready(30.0)
        except BaseException:
            await self.close()
            raise
        return self

    async def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.returncode is not None:
                    raise RuntimeError(f"gateway exited: {self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with session.get(
                        self.url + "/ready", timeout=aiohttp.ClientTimeout(total=2)
                    ) as resp:
                        body = await resp.json()
                        if body.get("ready_endpoints") == self.ready_endpoints:
                            return
                await asyncio.sleep(0.05)
        raise TimeoutError(f"gateway not ready: {self.log_tail()}")

    def log_tail(self, size: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-size:].decode(errors="replace")
        except OSError:
            return ""

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self._dir.cleanup()
