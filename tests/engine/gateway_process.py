"""`servegate serve` as a real subprocess in front of a real vLLM cluster."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import yaml

from servegate.testing.vllm_cluster import LOOPBACK, VllmServer, free_port, http_request

LOG_SOURCES: dict[str, Callable[[], str]] = {}
"""Logs attached to the report of a failing test (see conftest.py)."""


class GatewayProcess:
    def __init__(
        self,
        servers: Sequence[VllmServer],
        workdir: Path,
        *,
        name: str = "gateway",
        model: str = "tiny",
        picker: Mapping[str, Any] | None = None,
        health_interval_s: float = 0.5,
        failure_threshold: int = 2,
        scrape_interval_s: float = 0.1,
        debug_headers: bool = False,
    ) -> None:
        self.servers = list(servers)
        self.workdir = workdir
        self.name = name
        self.model = model
        self.picker = picker
        self.health_interval_s = health_interval_s
        self.health_timeout_s = 1.0
        self.failure_threshold = failure_threshold
        self.scrape_interval_s = scrape_interval_s
        self.debug_headers = debug_headers
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.config_path = workdir / f"{name}.yaml"
        self.log_path = workdir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def config(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "gateway": {
                "host": LOOPBACK,
                "port": self.port,
                "max_retries": 2,
                "debug_headers": self.debug_headers,
            },
            "pool": {
                "name": "engine",
                "endpoints": [
                    {"url": s.url, "model": self.model, "kv_events": s.kv_connect}
                    for s in self.servers
                ],
                "scrape_interval_s": self.scrape_interval_s,
                "health": {
                    "interval_s": self.health_interval_s,
                    "timeout_s": self.health_timeout_s,
                    "failure_threshold": self.failure_threshold,
                    "models_refresh_every": 1,
                },
            },
            "log_level": "info",
        }
        if self.picker is not None:
            doc["picker"] = dict(self.picker)
        return doc

    @property
    def leave_bound_s(self) -> float:
        """How long a dead endpoint may stay in the pool: the probes that must fail, + 1 s."""
        return self.failure_threshold * (self.health_interval_s + self.health_timeout_s) + 1.0

    def command(self) -> list[str]:
        exe = Path(sys.executable).with_name("servegate")
        return [str(exe), "serve", "--config", str(self.config_path)]

    def start(self, timeout_s: float = 60.0) -> None:
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))
        self._log = self.log_path.open("ab")
        env = dict(os.environ)
        env.pop("PYTHONWARNINGS", None)
        self.process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            self.wait_ready(len(self.servers), timeout_s)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, count: int, timeout_s: float) -> float:
        """Seconds until /ready reports exactly `count` ready endpoints."""
        started = time.monotonic()
        last: Any = None
        while time.monotonic() - started < timeout_s:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"servegate exited with code {self.process.returncode}:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError):
                last = self.ready()
                if last.get("ready_endpoints") == count:
                    return time.monotonic() - started
            time.sleep(0.1)
        raise TimeoutError(
            f"gateway /ready did not reach {count} ready endpoints in {timeout_s} s "
            f"(last: {last}):\n{self.log_tail()}"
        )

    def ready(self) -> dict[str, Any]:
        _, _, body = http_request(f"{self.url}/ready", timeout_s=5.0)
        doc: dict[str, Any] = json.loads(body)
        return doc

    def metrics_text(self) -> str:
        status, _, body = http_request(f"{self.url}/metrics", timeout_s=5.0)
        assert status == 200, body
        return body.decode()

    def post(
        self, path: str, body: Any, headers: Mapping[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        return http_request(f"{self.url}{path}", body, timeout_s=120.0, headers=headers)

    def stop(self) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=15)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 80) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@contextlib.contextmanager
def running_gateway(
    servers: Sequence[VllmServer], workdir: Path, **kwargs: Any
) -> Iterator[GatewayProcess]:
    proc = GatewayProcess(servers, workdir, **kwargs)
    LOG_SOURCES[f"{proc.name} log"] = proc.log_tail
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()
        LOG_SOURCES.pop(f"{proc.name} log", None)
