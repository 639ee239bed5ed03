"""The backends tier (`make test-backends`): Ray Serve and BentoML, in their own venv."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "backends: needs Ray Serve / BentoML (make test-backends)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """SIGTERM the process (it stops what it started), then SIGKILL its whole group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


async def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"exited with {proc.returncode}:\n{tail(log)}")
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.5)
    raise AssertionError(f"{url} not ready after {timeout_s:g}s:\n{tail(log)}")


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


def start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A server process in its own process group, its output in `log`."""
    with log.open("wb") as out:
        return subprocess.Popen(
            argv,
            env=env,
            cwd=log.parent,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
